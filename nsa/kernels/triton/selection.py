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

Backward: nsa.kernels.triton.selection_bwd (dq per token like the forward; dk/dv per selected block
through a reverse index of the indices; no atomics, bitwise reproducible).

Dk != Dv: BLOCK_DK / BLOCK_DV are next powers of two with masks. Offsets are int64 wherever a product
of a stride and an index can pass 2**31. fp32 inputs use IEEE fp32 dots (no TF32).
"""

from __future__ import annotations

import math

import torch

from ..indices import dedupe_blocks
from . import selection_bwd  # imports triton: nsa.kernels.triton.available() relies on it
from .common import next_pow2 as _np2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_BLOCK_G = 64
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_BLOCK_N = 64  # a selection block longer than this is processed in sub-tiles of this many tokens


def block_g(G: int) -> int:
    return min(max(16, _np2(G)), MAX_BLOCK_G)


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


def _check_offset(q, k, q_offset: int):
    if q_offset < 0 or k.shape[1] < q_offset + q.shape[1]:
        raise ValueError(f"q_offset must be >= 0 with k, v holding the first q_offset + T = {q_offset + q.shape[1]} "
                         f"stream positions, got q_offset={q_offset} and {k.shape[1]} K/V rows")


def sel_forward(q, k, v, indices, seq_start, block_sel: int, scale: float, combine=None, q_offset: int = 0):
    """Raw forward: (o [B, T, Hq, Dv] in q's dtype, lse [B, T, Hq] fp32 natural log, -inf = empty row).
    combine = (gates, o_cmp Segments, o_win): (out, o, lse) with the gate combine done by the kernel
    (nsa.kernels.triton.selection_fwd). q_offset: q's rows are the stream positions [q_offset, q_offset + T)
    of K/V's rows (seq_start in stream positions)."""
    from .selection_fwd import sel_forward as forward

    _check(q, k, v, indices, seq_start, block_sel)
    if q_offset:
        _check_offset(q, k, q_offset)
    return forward(q, k, v, indices, seq_start, block_sel, scale, max_block_g=MAX_BLOCK_G, max_block_n=MAX_BLOCK_N,
                   combine=combine, q_offset=q_offset)


def sel_backward(do, q, k, v, o, lse, indices, seq_start, block_sel: int, scale: float, dq_into=None,
                 dq_more=None, q_offset: int = 0, kv_seq_start=None):
    """Raw backward: (dq, dk, dv) in the dtypes of q, k, v (nsa.kernels.triton.selection_bwd: no atomics).
    dq_into / dq_more: other gradients of q, to which this branch's dq is added (see selection_bwd).
    q_offset / kv_seq_start: as in selection_bwd.backward_launches (queries at a stream offset)."""
    if q_offset:
        _check_offset(q, k, q_offset)
    return selection_bwd.sel_backward(do, q, k, v, o, lse, indices, seq_start, block_sel, scale, dq_into=dq_into,
                                      dq_more=dq_more, q_offset=q_offset, kv_seq_start=kv_seq_start)


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
    idx = dedupe_blocks(indices.to(device=device, dtype=torch.int32))
    if seq_start is None:
        ss = torch.zeros(B, T, dtype=torch.int32, device=device)
    else:
        ss = seq_start.to(device=device, dtype=torch.int32)
        if ss.dim() == 1:
            ss = ss[None].expand(B, T)
    return idx, ss


def selected_attention_triton(q, k, v, indices, seq_start, cfg, scale=None, return_lse=False):
    """Selected-branch attention over the whole T (no query chunking), differentiable in q, k, v.

    q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv]; indices [B, T, Hkv, n] local block ids
    (ascending not required, -1 = none, a repeated block counts once: deduplicated on the device);
    seq_start [B, T] (or [T], or None for dense input).
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
