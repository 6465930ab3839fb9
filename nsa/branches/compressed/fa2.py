"""Compressed branch on a FlashAttention-2 kernel (flash_attn or torch_flash), by folding queries into
heads (fold.py): one bottom-right-causal call over the compressed K/V (dense: no K/V copy; varlen: K/V
expanded d times by head, 1/G of q's size, so that q's rows need no permuting copy). Signature after
binding the provider: `(q, k_cmp, v_cmp, layout, cfg, scale) -> (o, lse)`."""

from __future__ import annotations

import torch

from ...config import NSAConfig
from ...kernels.fa2.base import Fa2Provider
from ...toggles import Toggles
from ..attend import attend, compute_dtype
from ..context import CallContext
from ..fa2_call import padded_head_dim, prep
from .fold import (
    expand_kv,
    expand_kv_varlen,
    fold_q,
    plan_dense,
    plan_varlen,
    unfold_lse,
    unfold_o,
    unfold_view_lse,
    unfold_view_o,
    view_rows,
)

MIN_VIEW_ROWS = 2  # cuDNN's backward refuses a 1 x 1 attention


def compressed_fa2(prov: Fa2Provider, ctx: CallContext, toggles: Toggles, q, k_cmp, v_cmp, layout,
                   cfg: NSAConfig, scale: float):
    B, T, Hq, _ = q.shape
    Hkv, Dv = k_cmp.shape[2], v_cmp.shape[3]
    G = Hq // Hkv
    varlen = ctx.packed or toggles.force_varlen
    if varlen:
        host = ctx.host_cu if ctx.packed else [b * T for b in range(B + 1)]
        plan = plan_varlen(host, B * T, Hkv, G, cfg, q.device)
        q_in = q.reshape(1, B * T, Hq, q.shape[-1])
        k_in = k_cmp.reshape(1, -1, Hkv, k_cmp.shape[-1])
        v_in = v_cmp.reshape(1, -1, Hkv, Dv)
    else:
        plan = plan_dense(B, T, Hkv, G, cfg)
        q_in, k_in, v_in = q, k_cmp, v_cmp
    if plan.n_cmp == 0 or T == 0:  # no block anywhere: every row is empty
        return q.new_zeros(B, T, Hq, Dv), q.new_full((B, T, Hq), float("-inf"), dtype=torch.float32)
    if varlen:  # K/V expanded d times by head (fold.py: the varlen layout), V padded to Dk in the same copy
        D = padded_head_dim(k_in.shape[-1], Dv)
        k_in, v_in = expand_kv_varlen(k_in, plan, D), expand_kv_varlen(v_in, plan, D)
    qf, kf, vf = prep(prov, (fold_q(q_in, plan), k_in, v_in), ctx, "cmp")
    skip = 0
    if varlen:
        o, lse = prov.attn(qf, kf, vf, causal=True, left=-1, scale=scale,
                           varlen=(plan.cu_q, plan.cu_k, plan.max_q, plan.max_k), need_lse=True)
    else:
        # The first l/d groups see no block: not computed, so the call is square (Ng - l/d == T_cmp), where
        # bottom-right and top-left causal agree (torch_cudnn has only the latter).
        skip = plan.n_groups - plan.n_cmp
        o, lse = prov.attn(qf[:, skip:], kf, vf, causal=True, left=-1, scale=scale, varlen=None, need_lse=True)
    o = unfold_o(o[..., :Dv], plan, skip).to(q.dtype)
    lse = unfold_lse(lse, plan, skip)
    if varlen and not ctx.packed:
        o, lse = o.reshape(B, T, Hq, Dv), lse.reshape(B, T, Hq)
    return o, lse


# --- the dense core's two calls (nsa.run.dense_core: rows folded by view, then the tail tokens) ------------


def rows_attention(prov: Fa2Provider, q_rows, k_rows, v_rows, scale: float):
    """The compressed branch of the rows folded by view (fold.fold_q_view, fold.expand_kv): one bottom-right
    causal call, (o_rows, lse_rows) in the kernel's layout (fold.unfold_view_o / unfold_view_lse read them)."""
    return prov.attn(q_rows, k_rows, v_rows, causal=True, left=-1, scale=scale, varlen=None, need_lse=True)


def tail_attention(prov: Fa2Provider, q, k_cmp, v_cmp, scale: float):
    """The tail tokens (fewer than d after the last whole row) all see every block of k_cmp [B, n+1, Hkv, D]:
    one call with no mask (one kernel, and its backward one more, where attention in torch took about 25
    small operations each way). (o [B, C, Hq, Dv], lse [B, C, Hq])."""
    C = q.shape[1]
    o, lse = prov.attn(q, k_cmp, v_cmp, causal=False, left=-1, scale=scale, varlen=None, need_lse=True)
    return o, lse[..., :C].transpose(1, 2)


def view_fold_applies(ctx: CallContext, q, v_cmp, cfg: NSAConfig) -> bool:
    """Whether the compressed branch of this call can run on rows folded by view: dense input, the kernel in
    q's dtype (no cast), Dk >= Dv (only V is padded), at least MIN_VIEW_ROWS rows. (The dense core also needs
    q's strides to allow the view, nsa.run.dense_core.view_fold; a traced graph reshapes instead.)"""
    return (not ctx.packed and ctx.kernel_dtype == q.dtype and q.shape[-1] >= v_cmp.shape[-1]
            and view_rows(q.shape[1], cfg)[1] >= MIN_VIEW_ROWS)


def compressed_view(prov: Fa2Provider, q, k_cmp, v_cmp, cfg: NSAConfig, scale: float):
    """((o_rows, t0, o_tail), lse [B, T, Hq] fp32) of the compressed branch on rows folded by view, as plain
    operations a graph can trace: the form torch.compile runs where eager mode runs the dense core's ViewCmp
    (where view_fold_applies). o_cmp comes as two token segments, as the combining operators take it
    (nsa.kernels.ops): o_rows [B, n*d, Hq, Dv] for tokens [t0, t0 + n*d), o_tail for the tokens after them;
    tokens before t0 see no block (o = 0, lse = -inf). The rows are a reshape of q: no copy of q, of the output
    or of their gradients, where the copying fold (compressed_fa2) makes four. The tail tokens (fewer than d)
    see every block up to the row after the last and are attended in torch (a [C, n + 1] score matrix)."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k_cmp.shape[2], v_cmp.shape[3]
    d = cfg.stride_cmp
    t0, n = view_rows(T, cfg)
    ta = t0 + n * d
    v_dim = Dv if prov.takes_narrower_v() else Dk
    rows = q[:, t0:ta].reshape(B, n, d * Hq, Dk)  # fold_q_view's rows (a view where q's strides allow it)
    o_rows, lse_rows = rows_attention(prov, rows, expand_kv(k_cmp, n, d), expand_kv(v_cmp, n, d, v_dim), scale)
    o_main = unfold_view_o(o_rows, Hq)[..., :Dv]
    lse_parts = [q.new_full((B, t0, Hq), float("-inf"), dtype=torch.float32), unfold_view_lse(lse_rows, Hq, d)]
    if ta < T:
        ct = compute_dtype(q.dtype)
        qt = q[:, ta:].to(ct).unflatten(2, (Hkv, Hq // Hkv))
        every = torch.ones(B, T - ta, n + 1, dtype=torch.bool, device=q.device)
        o_t, lse_t = attend(qt, k_cmp[:, :n + 1].to(ct), v_cmp[:, :n + 1].to(ct), every, scale, return_lse=True)
        o_tail = o_t.flatten(2, 3).to(o_main.dtype)
        lse_parts.append(lse_t.flatten(2, 3).float())
    else:
        o_tail = o_main[:, :0]
    return (o_main, t0, o_tail), torch.cat(lse_parts, 1)
