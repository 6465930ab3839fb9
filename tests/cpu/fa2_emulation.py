"""Pure-PyTorch emulations of the FlashAttention-2 entry points NSA calls (CPU tests of the providers).

They follow the kernels' contracts exactly as NSA relies on them, so that the folding, padding,
layout and LSE fix-ups of the providers are tested on any machine; the GPU tests then check the real
kernels against the same oracle.

- GQA natively: query head h reads KV head h // (Hq / Hkv) (no K/V copy).
- Masks: key j is visible to query row i of a (seqlen_q, seqlen_k) pair iff
  (left < 0 or j >= i + seqlen_k - seqlen_q - left) and (right < 0 or j <= i + seqlen_k - seqlen_q + right);
  is_causal sets right = 0 (bottom-right alignment); a window >= seqlen_k means no limit.
- A row with no visible key: output 0 and LSE +inf (what the FA-2 kernels write when they exit early).
- LSE layouts: dense [B, H, seqlen_q]; varlen [H, total_q].
"""

from __future__ import annotations

import torch


def _attend(q, k, v, scale, left, right):
    """q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> (o [Tq, Hq, Dv], lse [Hq, Tq])."""
    Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[:2]
    G = Hq // Hkv
    if Tk == 0 or Tq == 0:
        return q.new_zeros(Tq, Hq, v.shape[-1]), torch.full((Hq, Tq), float("inf"), dtype=torch.float32,
                                                           device=q.device)
    if left >= Tk:
        left = -1
    if right >= Tk:
        right = -1
    i = torch.arange(Tq, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    shift = Tk - Tq
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if left >= 0:
        mask &= j >= i + shift - left
    if right >= 0:
        mask &= j <= i + shift + right
    qg = q.view(Tq, Hkv, G, D)
    logits = torch.einsum("thgd,shd->hgts", qg, k) * scale  # [Hkv, G, Tq, Tk]
    logits = logits.masked_fill(~mask, float("-inf"))
    mx = logits.detach().amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    w = torch.exp(logits - mx)
    s = w.sum(-1, keepdim=True)
    p = w / torch.where(s > 0, s, torch.ones_like(s))
    o = torch.einsum("hgts,shd->thgd", p, v).reshape(Tq, Hq, v.shape[-1])
    lse = (torch.log(s.detach()) + mx).squeeze(-1).reshape(Hq, Tq).float()
    lse = torch.where(s.detach().squeeze(-1).reshape(Hq, Tq) > 0, lse, torch.full_like(lse, float("inf")))
    return o, lse


def _window(is_causal, left, right):
    left = -1 if left is None else int(left)
    right = -1 if right is None else int(right)
    if is_causal:
        right = 0
    return left, right


def aten_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                 seqused_k=None, alibi_slopes=None, **_):
    """Emulates torch.ops.aten._flash_attention_forward -> (out, lse, rng_state, unused, debug_mask)."""
    assert dropout_p == 0.0 and seqused_k is None and alibi_slopes is None
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    left, right = _window(is_causal, window_size_left, window_size_right)
    empty = query.new_zeros(0)
    if cum_seq_q is None:
        outs, lses = [], []
        for b in range(query.shape[0]):
            o, lse = _attend(query[b], key[b], value[b], scale, left, right)
            outs.append(o)
            lses.append(lse)
        return torch.stack(outs), torch.stack(lses), empty, empty, empty
    cq, ck = cum_seq_q.tolist(), cum_seq_k.tolist()
    assert max(b - a for a, b in zip(cq, cq[1:])) <= max_q and max(b - a for a, b in zip(ck, ck[1:])) <= max_k
    outs, lses = [], []
    for s in range(len(cq) - 1):
        o, lse = _attend(query[cq[s]:cq[s + 1]], key[ck[s]:ck[s + 1]], value[ck[s]:ck[s + 1]], scale, left, right)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1), empty, empty, empty


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    return_attn_probs=False, **_):
    """Emulates flash_attn.flash_attn_func (q [B, T, H, D]); LSE [B, H, T]."""
    out, lse, *_ = aten_flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, causal,
                                                False, scale=softmax_scale, window_size_left=window_size[0],
                                                window_size_right=window_size[1])
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), return_attn_probs=False, **_):
    """Emulates flash_attn.flash_attn_varlen_func (q [total, H, D]); LSE [H, total_q]."""
    out, lse, *_ = aten_flash_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                dropout_p, causal, False, scale=softmax_scale,
                                                window_size_left=window_size[0], window_size_right=window_size[1])
    return (out, lse, None) if return_attn_probs else out


class FakeFlashAttnModule:
    """Stands in for the flash_attn module in CPU tests."""

    __version__ = "emulated"
    flash_attn_func = staticmethod(flash_attn_func)
    flash_attn_varlen_func = staticmethod(flash_attn_varlen_func)


def aten_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask,
                         *, scale=None):
    """Emulates torch.ops.aten._scaled_dot_product_cudnn_attention: q [B, H, Sq, D], k/v [B, Hkv, Sk, D]
    (GQA), causal aligned to the TOP-LEFT corner (row i sees keys j <= i), LSE [B, H, Sq, 1] natural log."""
    assert attn_bias is None and dropout_p == 0.0 and compute_log_sumexp
    Sq, Sk = query.shape[2], key.shape[2]
    logits, kx, vx = _cudnn_logits(query, key, value, is_causal, scale)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    out = torch.softmax(logits, -1) @ vx
    return out, lse.detach().float(), None, None, Sq, Sk, None, None, None


def _cudnn_logits(query, key, value, is_causal, scale):
    B, H, Sq, D = query.shape
    Hkv, Sk = key.shape[1], key.shape[2]
    scale = D ** -0.5 if scale is None else scale
    kx = key.repeat_interleave(H // Hkv, 1)
    vx = value.repeat_interleave(H // Hkv, 1)
    logits = (query @ kx.transpose(-1, -2)) * scale
    if is_causal:
        i = torch.arange(Sq, device=query.device)[:, None]
        j = torch.arange(Sk, device=query.device)[None, :]
        logits = logits.masked_fill(j > i, float("-inf"))
    return logits, kx, vx


def aten_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                                  cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    """Emulates torch.ops.aten._scaled_dot_product_cudnn_attention_backward: the gradients from the GIVEN output
    and log-sum-exp (P = exp(S - lse), dS = P (dO V^T - rowsum(dO * O))), K/V gradients summed over GQA groups."""
    assert attn_bias is None and dropout_p == 0.0
    H, Hkv = query.shape[1], key.shape[1]
    scale_ = query.shape[-1] ** -0.5 if scale is None else scale
    logits, kx, vx = _cudnn_logits(query, key, value, is_causal, scale)
    p = torch.exp(logits - logsumexp.to(logits.dtype).reshape(*logits.shape[:3], 1))
    ds = p * (grad_out @ vx.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
    dq = ds @ kx * scale_
    dk = (ds.transpose(-1, -2) @ query * scale_).unflatten(1, (Hkv, H // Hkv)).sum(2)
    dv = (p.transpose(-1, -2) @ grad_out).unflatten(1, (Hkv, H // Hkv)).sum(2)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)

