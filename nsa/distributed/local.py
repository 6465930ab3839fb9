"""NSA for a segment of queries at a position offset, against the K/V of the stream before them.

This is the per-rank compute of context parallelism: queries [offset, offset + Tq) of the stream see
K/V [0, offset + Tq) (gathered from the other ranks). Two paths (`plan_local` decides, once per call):

- fused: where planning takes the fused dense core for the plain call of the rank's own tensors (dense
  input), the dense core's kernels with a query offset (nsa.run.offset_core);
- torch: every branch is the chunked PyTorch path's own per-chunk function (nsa.branches.*.naive) called
  with global query positions, so the result is the single-process chunked path's, query for query.
  Packed input (cu_seqlens) always takes it.

Only the prefix [0, end) of the stream is touched: compressed blocks are built for it alone (a packed
stream's offsets are clamped to `end`, which keeps exactly the blocks that end before `end`), so the
first rank does not compress what only later ranks see.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..branches.attend import compute_dtype
from ..branches.compressed.naive import compressed_chunk
from ..branches.selected.naive import dedupe_indices, selected_chunk, topn_chunk
from ..branches.sliding.naive import sliding_chunk
from ..compress import compress_kv
from ..config import NSAConfig
from ..layout import dense_layout, packed_layout
from ..plan import chunk_budget, make_plan
from ..run.chunked import choose_chunk
from ..run.offset_core import run_offset


def plan_local(backend: str, q, k, v, cfg: NSAConfig, kv_cmp, kv_win, cu_seqlens, given_indices: bool):
    """(plan or None, path "fused" | "torch", telemetry reason) for this rank's queries: the fused path where
    planning takes the dense core for the plain call of the rank's own tensors (the same planner, devices and
    guards). Reasons of the torch path: "forced" (backend="torch"), "ok" (the plain call too runs chunked
    here: the environment), "packed" (cu_seqlens: the offset kernels take dense input only) and
    "core_<reason>" (the fused steps would not run as one node): those two are counted as fallbacks."""
    if backend == "torch":
        return None, "torch", "forced"
    plan = make_plan("auto", q, k, v, cfg, kv_cmp=kv_cmp, kv_win=kv_win, given_indices=given_indices)
    if plan.executor != "fused":
        return None, "torch", "ok"
    if not plan.dense_core:
        return None, "torch", f"core_{plan.core.reason}"
    if cu_seqlens is not None:
        return None, "torch", "packed"
    return plan, "fused", "ok"


def prefix_layout(B: int, end: int, cfg: NSAConfig, cu_seqlens, device):
    """The layout of the stream's first `end` tokens (dense rows, or the packed offsets clamped to end)."""
    if cu_seqlens is None:
        return dense_layout(B, end, cfg, device)
    return packed_layout(cu_seqlens.clamp(max=end), end, cfg)


def _chunk(c0, c1, offset, q, gates, k, v, k_cmp, v_cmp, kw, vw, w0, layout, cfg, scale, fixed, need_indices):
    """Local queries [c0, c1) (global positions offset + c0 ...): (out [B, C, Hq, Dv], indices or None).
    kw / vw hold the sliding branch's keys from global position w0 on."""
    Hq, Hkv = q.shape[2], k.shape[2]
    ct = compute_dtype(q.dtype)
    g0, g1 = offset + c0, offset + c1
    t_glob = torch.arange(g0, g1, device=q.device)
    seq_start = layout.seq_start[:, g0:g1]
    pos = t_glob[None, :] - seq_start
    qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, Hq // Hkv))

    n_vis = layout.cmp_visible_bound(g1, cfg)
    cs, cv = layout.cmp_start[:, :n_vis], layout.cmp_valid[:, :n_vis]
    o_cmp, lse = compressed_chunk(qc, k_cmp[:, :n_vis], v_cmp[:, :n_vis], cs, cv, t_glob, seq_start, cfg, scale)
    if fixed is not None:
        indices = fixed[:, c0:c1]
    else:
        indices = topn_chunk(qc, k_cmp[:, :n_vis], lse, cs, layout.cmp_local[:, :n_vis], cv, t_glob, seq_start,
                             layout.n_sel_blocks, cfg, scale)
    o_sel = selected_chunk(qc, k, v, indices, pos, seq_start, cfg, scale)
    k0 = max(0, g0 - cfg.window + 1)
    key_pos = torch.arange(k0, g1, device=q.device)
    o_win = sliding_chunk(qc, kw[:, k0 - w0:g1 - w0], vw[:, k0 - w0:g1 - w0], key_pos, t_glob, seq_start, cfg, scale)
    g = gates[:, c0:c1].to(ct)
    out = g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 1:2] * o_sel.flatten(2, 3) + g[..., 2:3] * o_win.flatten(2, 3)
    return out.to(q.dtype), (indices if need_indices else None)


def compress_prefix(kc, vc, cfg: NSAConfig, end: int, B: int, cu_seqlens=None, compress_fn=None):
    """Compressed K/V [B, Nc, Hkv, D] of the stream's first `end` tokens (kc, vc hold at least those)."""
    layout = prefix_layout(B, end, cfg, cu_seqlens, kc.device)
    return compress_kv(kc[:, :end], vc[:, :end], layout, cfg, compress_fn)


def nsa_local(q, gates, k, v, cfg: NSAConfig, offset: int, *, cu_seqlens=None, kv_cmp=None, kv_win=None,
              compress_fn=None, compressed=None, prefix_end=None, block_indices=None, need_indices=False,
              chunk=None, plan=None):
    """NSA of the queries q [B, Tq, Hq, Dk] (gates [B, Tq, Hq, 3]) at stream positions [offset, offset + Tq).

    k, v (and kv_cmp / kv_win) hold at least the stream's first offset + Tq tokens; cu_seqlens (int32,
    on q's device) describes the whole stream. compressed: (k_cmp, v_cmp) already made by compress_prefix
    for the first prefix_end (>= offset + Tq) tokens, else they are made here from kv_cmp (or k, v).
    Differentiable in every tensor argument. Returns (out [B, Tq, Hq, Dv] in q's dtype, int32 indices
    [B, Tq, Hkv, n_sel] or None). plan: a fused plan from plan_local (dense input): the fused path.
    """
    B, Tq, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    if Tq == 0:
        return q.new_zeros(B, 0, Hq, Dv), (q.new_zeros(B, 0, Hkv, cfg.n_sel, dtype=torch.int32)
                                            if need_indices else None)
    end = offset + Tq
    if compressed is None:
        prefix_end = end
        kc, vc = kv_cmp if kv_cmp is not None else (k, v)
        compressed = compress_prefix(kc, vc, cfg, end, B, cu_seqlens, compress_fn)
    elif prefix_end is None or prefix_end < end:
        raise ValueError(f"compressed K/V cover the first {prefix_end} tokens, queries reach {end}")
    if plan is not None:
        if cu_seqlens is not None:
            raise ValueError("the fused path at a query offset takes dense input (cu_seqlens=None)")
        kw, vw = kv_win if kv_win is not None else (k, v)
        given = dedupe_indices(block_indices).to(torch.int32) if block_indices is not None else None
        out, idx = run_offset(plan, q, k, v, gates, cfg, offset, compressed[0], compressed[1], kw, vw, given)
        return out, (idx if need_indices else None)
    scale = cfg.softmax_scale(Dk)
    ct = compute_dtype(q.dtype)
    layout = prefix_layout(B, prefix_end, cfg, cu_seqlens, q.device)
    k_cmp, v_cmp = compressed[0].to(ct), compressed[1].to(ct)
    kw, vw = kv_win if kv_win is not None else (k, v)
    # Cast once per call (not per chunk), and only the band the local queries' windows reach; the selected
    # branch gathers from the storage dtype itself.
    w0 = max(0, offset - cfg.window + 1)
    kw_ct, vw_ct = kw[:, w0:end].to(ct), vw[:, w0:end].to(ct)
    fixed = dedupe_indices(block_indices) if block_indices is not None else None
    # Chunks sized as the chunked executor sizes them (its budget and rule).
    chunk = chunk or choose_chunk(Tq, Hq, Hkv, Dk, Dv, layout.n_cmp, cfg, chunk_budget(q.device))
    tensors = (q, gates, k, v, k_cmp, v_cmp, kw_ct, vw_ct)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    outs, idxs = [], []
    for c0 in range(0, Tq, chunk):
        c1 = min(Tq, c0 + chunk)
        args = (c0, c1, offset, q, gates, k, v, k_cmp, v_cmp, kw_ct, vw_ct, w0, layout, cfg, scale, fixed,
                need_indices)
        o, idx = checkpoint(_chunk, *args, use_reentrant=False) if grad and Tq > chunk else _chunk(*args)
        outs.append(o)
        idxs.append(idx)
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
    indices = None
    if need_indices:
        indices = (torch.cat(idxs, 1) if len(idxs) > 1 else idxs[0]).to(torch.int32)
    return out, indices
