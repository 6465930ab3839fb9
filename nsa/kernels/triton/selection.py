"""Triton kernels for NSA's selected-attention branch: forward, backward, launcher, autograd Function.

Contract (same function as nsa.branches.selected.naive.selected_attention, whole-T layout):
    q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv] (any strides), indices [B, T, Hkv, n]
    (int, local selection-block ids of the token's sequence, -1 = none), seq_start [B, T] (global index
    of the first token of each token's sequence; zeros for dense input). Query (t, h) attends every token
    u of its KV group's selected blocks with u <= t (positions local to the sequence, u = j*l' + r).
    A row with no visible token outputs exactly 0 and gets zero gradients.

Forward: selection_fwd.py (group-centric: the G query heads of a KV head are the rows of tl.dot, padded to
BLOCK_G = max(16, next_pow2(G)), at most 64 rows per tile; a flat, pipelined loop over the token's
blocks). It writes o [B, T, Hq, Dv] (q's dtype) and the log-sum-exp [B, T, Hq] (fp32, natural log; -inf
for empty rows) for the backward.

Backward: delta = rowsum(dO * O) (torch), then one kernel with the forward's grid recomputes p from the
LSE, writes dq for its rows, and adds its dk/dv contributions to fp32 buffers with tl.atomic_add
(first, simple and correct version; the order of the atomic adds makes dk/dv non-deterministic in the
last bits). A reverse index (which queries selected a block) would remove the atomics; not done yet.

Dk != Dv: BLOCK_DK / BLOCK_DV are next powers of two with masks. Offsets are int64 wherever a product
of a stride and an index can pass 2**31. fp32 inputs use IEEE fp32 dots (no TF32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_BLOCK_G = 64
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_BLOCK_N = 64  # a selection block longer than this is processed in sub-tiles of this many tokens


def _np2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def block_g(G: int) -> int:
    return min(max(16, _np2(G)), MAX_BLOCK_G)


@triton.jit
def _sel_bwd_kernel(
    Q, K, V, IDX, SS, DO, LSE, DELTA, DQ, DK, DV,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sib, sit, sih, sin,
    ssb, sst,
    sdob, sdot, sdoh, sdod,
    slb, slt, slh,
    sdqb, sdqt, sdqh, sdqd,
    sdkb, sdkt, sdkh, sdkd,
    sdvb, sdvt, sdvh, sdvd,
    Hkv, G, Dk, Dv, n_sel, block_sel, qk_scale, sm_scale,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    g0 = tl.program_id(2) * BLOCK_G

    rg = g0 + tl.arange(0, BLOCK_G)
    rn = tl.arange(0, BLOCK_N)
    rdk = tl.arange(0, BLOCK_DK)
    rdv = tl.arange(0, BLOCK_DV)
    g_ok = rg < G
    dk_ok = rdk < Dk
    dv_ok = rdv < Dv
    heads = (h * G + rg).to(tl.int64)

    start = tl.load(SS + b * ssb + t * sst).to(tl.int64)
    pos = t - start

    q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + rdk[None, :] * sqd,
                mask=g_ok[:, None] & dk_ok[None, :], other=0.0)
    do = tl.load(DO + b * sdob + t * sdot + heads[:, None] * sdoh + rdv[None, :] * sdod,
                 mask=g_ok[:, None] & dv_ok[None, :], other=0.0)
    lse = tl.load(LSE + b * slb + t * slt + heads * slh, mask=g_ok, other=float("-inf"))
    delta = tl.load(DELTA + b * slb + t * slt + heads * slh, mask=g_ok, other=0.0)
    row_ok = g_ok & (lse > float("-inf"))
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)

    dq = tl.zeros([BLOCK_G, BLOCK_DK], tl.float32)
    idx_base = IDX + b * sib + t * sit + h * sih
    for i in range(0, n_sel):
        j = tl.load(idx_base + i * sin).to(tl.int64)
        if j >= 0:
            for c in range(0, block_sel, BLOCK_N):
                local = j * block_sel + c + rn
                keep = (c + rn < block_sel) & (local <= pos)
                tok = start + local
                kb = tl.load(K + b * skb + tok[:, None] * skt + h * skh + rdk[None, :] * skd,
                             mask=keep[:, None] & dk_ok[None, :], other=0.0)
                vb = tl.load(V + b * svb + tok[:, None] * svt + h * svh + rdv[None, :] * svd,
                             mask=keep[:, None] & dv_ok[None, :], other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(kb), input_precision="ieee")
                    dp = tl.dot(do, tl.trans(vb), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(kb))
                    dp = tl.dot(do, tl.trans(vb))
                valid = row_ok[:, None] & keep[None, :]
                p = tl.where(valid, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
                ds = p * (dp - delta[:, None])
                if IEEE:
                    dq += tl.dot(ds, kb, input_precision="ieee")
                    dv_blk = tl.dot(tl.trans(p), do, input_precision="ieee")
                    dk_blk = tl.dot(tl.trans(ds), q, input_precision="ieee")
                else:
                    dq += tl.dot(ds.to(kb.dtype), kb)
                    dv_blk = tl.dot(tl.trans(p.to(do.dtype)), do)
                    dk_blk = tl.dot(tl.trans(ds.to(q.dtype)), q)
                tl.atomic_add(DV + b * sdvb + tok[:, None] * sdvt + h * sdvh + rdv[None, :] * sdvd, dv_blk,
                              mask=keep[:, None] & dv_ok[None, :], sem="relaxed")
                tl.atomic_add(DK + b * sdkb + tok[:, None] * sdkt + h * sdkh + rdk[None, :] * sdkd,
                              dk_blk * sm_scale, mask=keep[:, None] & dk_ok[None, :], sem="relaxed")

    tl.store(DQ + b * sdqb + t * sdqt + heads[:, None] * sdqh + rdk[None, :] * sdqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=g_ok[:, None] & dk_ok[None, :])


def _check(q, k, v, indices, seq_start, block_sel):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, T, H, D]")
    B, T, Hq, Dk = q.shape
    Hkv = k.shape[2]
    if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[3] != Dk or Hq % max(Hkv, 1):
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if indices.shape[:3] != (B, T, Hkv):
        raise ValueError(f"indices must be [B, T, Hkv, n] = [{B}, {T}, {Hkv}, n], got {tuple(indices.shape)}")
    if seq_start.shape != (B, T):
        raise ValueError(f"seq_start must be [B, T] = [{B}, {T}], got {tuple(seq_start.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k, v must share one dtype of {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if max(Dk, v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM}, got Dk={Dk}, Dv={v.shape[3]}")
    if block_sel < 1:
        raise ValueError(f"block_sel must be >= 1, got {block_sel}")


def _meta(q, k, v, block_sel):
    G = q.shape[2] // k.shape[2]
    BG = block_g(G)
    return dict(
        BLOCK_G=BG,
        BLOCK_N=min(max(16, _np2(block_sel)), MAX_BLOCK_N),
        BLOCK_DK=max(16, _np2(q.shape[3])),
        BLOCK_DV=max(16, _np2(v.shape[3])),
        IEEE=q.dtype == torch.float32,
    ), G, triton.cdiv(G, BG)


def _launch_cfg(meta):
    if not torch.cuda.is_available():
        return {}
    big = meta["BLOCK_DK"] + meta["BLOCK_DV"] > 256
    return {"num_warps": 8 if big else 4, "num_stages": 1 if big else 2}


def sel_forward(q, k, v, indices, seq_start, block_sel: int, scale: float):
    """Raw forward: (o [B, T, Hq, Dv] in q's dtype, lse [B, T, Hq] fp32 natural log, -inf = empty row)."""
    from .selection_fwd import sel_forward as forward

    _check(q, k, v, indices, seq_start, block_sel)
    return forward(q, k, v, indices, seq_start, block_sel, scale, max_block_g=MAX_BLOCK_G, max_block_n=MAX_BLOCK_N)


def sel_backward(do, q, k, v, o, lse, indices, seq_start, block_sel: int, scale: float):
    """Raw backward: (dq, dk, dv) in the dtypes of q, k, v (dk/dv accumulated in fp32 by atomics)."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    delta = (do.float() * o.float()).sum(-1).contiguous()  # [B, T, Hq], strides == lse's
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    if B * T * Hq == 0:
        return dq.zero_(), dk.to(k.dtype), dv.to(v.dtype)
    meta, G, n_gt = _meta(q, k, v, block_sel)
    n = indices.shape[3]
    lse = lse.contiguous()
    grid = (T, B * Hkv, n_gt)
    _sel_bwd_kernel[grid](
        q, k, v, indices, seq_start, do, lse, delta, dq, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *seq_start.stride(), *do.stride(),
        *lse.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
        Hkv, G, Dk, Dv, n, block_sel, scale * LOG2E, scale,
        **meta, **_launch_cfg(meta),
    )
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class SelectedAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, seq_start, block_sel, scale):
        o, lse = sel_forward(q, k, v, indices, seq_start, block_sel, scale)
        ctx.save_for_backward(q, k, v, o, lse, indices, seq_start)
        ctx.block_sel, ctx.scale = block_sel, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, indices, seq_start = ctx.saved_tensors
        dq, dk, dv = sel_backward(do, q, k, v, o, lse, indices, seq_start, ctx.block_sel, ctx.scale)
        return dq, dk, dv, None, None, None, None


def _prep_index(indices, seq_start, B, T, device):
    idx = indices if indices.dtype == torch.int32 else indices.to(torch.int32)
    if seq_start is None:
        ss = torch.zeros(B, T, dtype=torch.int32, device=device)
    else:
        ss = seq_start.to(device=device, dtype=torch.int32)
        if ss.dim() == 1:
            ss = ss[None].expand(B, T)
    return idx.to(device), ss


def selected_attention_triton(q, k, v, indices, seq_start, cfg, scale=None, return_lse=False):
    """Selected-branch attention over the whole T (no query chunking), differentiable in q, k, v.

    q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv]; indices [B, T, Hkv, n] local block ids
    (ascending not required, -1 = none, no repeats); seq_start [B, T] (or [T], or None for dense input).
    cfg: an NSAConfig (block_sel is used) or the block size as an int. Returns o [B, T, Hq, Dv] in q's
    dtype (and the fp32 LSE [B, T, Hq] when return_lse).
    """
    block_sel = int(cfg) if isinstance(cfg, int) else int(cfg.block_sel)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    B, T = q.shape[:2]
    idx, ss = _prep_index(indices, seq_start, B, T, q.device)
    o, lse = SelectedAttentionTriton.apply(q, k, v, idx, ss, block_sel, float(scale))
    return (o, lse) if return_lse else o


__all__ = ["SelectedAttentionTriton", "selected_attention_triton", "sel_forward", "sel_backward", "block_g",
           "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]
