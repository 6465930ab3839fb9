"""The chunked executor (the torch backend, CPU, and any call where a step has no fast implementation):
queries are processed `chunk` at a time; per chunk the compressed branch sees at most T/d blocks, the
selected branch gathers n*l' tokens per query and KV head, the sliding branch a band of chunk + w - 1 keys,
so time and memory grow as T * (T/d + n*l' + w), never as a dense [T, T] tensor. With autograd on, each
chunk is recomputed in the backward (activation checkpointing) so the saved state stays at one chunk's
size. Steps that do have a whole-T implementation run once over the whole T instead (cmp and win before
the loop, top-n before it when the kernel serves it, sel after it over every chunk's blocks).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .. import telemetry
from ..branches.attend import compute_dtype
from ..branches.compressed.naive import compressed_chunk
from ..branches.selected.naive import dedupe_indices, selected_chunk, topn_chunk
from ..branches.sliding.naive import sliding_chunk
from ..compress import compress_kv
from ..config import NSAConfig
from .common import branch_kv


def choose_chunk(T: int, Hq: int, Hkv: int, Dk: int, Dv: int, n_cmp: int, cfg: NSAConfig, budget: int) -> int:
    """Queries per chunk: as many as keep the largest per-chunk intermediate within `budget` elements (the
    plan's chunk_budget, nsa.plan.rules.chunk_budget), at least 16, at most T."""
    per_query = Hq * (n_cmp + cfg.n_sel * cfg.block_sel + cfg.window) + Hkv * cfg.n_sel * cfg.block_sel * (Dk + Dv)
    chunk = max(16, budget // max(per_query, 1))
    return min(T, chunk) if T > 0 else 1  # T may be symbolic under torch.compile: no int() here


def _chunk(c0, c1, q, k, v, gates, k_cmp, v_cmp, k_win, v_win, layout, cfg, scale, fixed, o_cmp_full,
           lse_cmp_full, o_win_full, need_indices, sel_deferred=False):
    """One chunk of queries [c0, c1). Returns (out [B, C, Hq, Dv], indices [B, C, Hkv, n] or None).

    sel_deferred: the selected branch is served later over the whole T: return the cmp + win part in the
    compute dtype (no cast) and always the indices.
    """
    Hq, Hkv = q.shape[2], k.shape[2]
    G = Hq // Hkv
    ct = compute_dtype(q.dtype)
    # NSA_DEBUG_TIMING=1: each torch branch's time into telemetry (otherwise the functions themselves)
    cmp_fn, topn_fn, sel_fn, win_fn = (telemetry.timed(f"{name}.torch", fn) for name, fn in (
        ("cmp", compressed_chunk), ("topn", topn_chunk), ("sel", selected_chunk), ("win", sliding_chunk)))
    t_glob = torch.arange(c0, c1, device=q.device)
    seq_start = layout.seq_start[:, c0:c1]
    pos = t_glob[None, :] - seq_start
    qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, G))

    n_vis = layout.cmp_visible_bound(c1, cfg)
    slots = (layout.cmp_start[:, :n_vis], layout.cmp_valid[:, :n_vis])
    if o_cmp_full is None:
        o_cmp, lse = cmp_fn(qc, k_cmp[:, :n_vis], v_cmp[:, :n_vis], *slots, t_glob, seq_start, cfg, scale)
    else:
        o_cmp = o_cmp_full[:, c0:c1].to(ct).unflatten(2, (Hkv, G))
        lse = lse_cmp_full[:, c0:c1].unflatten(2, (Hkv, G))

    if fixed is not None:
        indices = fixed[:, c0:c1]
    else:
        indices = topn_fn(qc, k_cmp[:, :n_vis], lse, slots[0], layout.cmp_local[:, :n_vis], slots[1], t_glob,
                             seq_start, layout.n_sel_blocks, cfg, scale)
    o_sel = None if sel_deferred else sel_fn(qc, k, v, indices, pos, seq_start, cfg, scale)

    if o_win_full is None:
        k0 = max(0, c0 - cfg.window + 1)
        key_pos = torch.arange(k0, c1, device=q.device)
        o_win = win_fn(qc, k_win[:, k0:c1].to(ct), v_win[:, k0:c1].to(ct), key_pos, t_glob, seq_start, cfg,
                              scale)
    else:
        o_win = o_win_full[:, c0:c1].to(ct).unflatten(2, (Hkv, G))

    g = gates[:, c0:c1].to(ct)
    if sel_deferred:
        return g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 2:3] * o_win.flatten(2, 3), indices
    out = (g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 1:2] * o_sel.flatten(2, 3)
           + g[..., 2:3] * o_win.flatten(2, 3))
    return out.to(q.dtype), (indices if need_indices else None)


def run_chunked(plan, q, k, v, gates, cfg, layout, *, kv_cmp=None, kv_win=None, compress_fn=None,
                block_indices=None, need_indices=False, chunk=None, use_checkpoint=None):
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    scale = cfg.softmax_scale(Dk)
    kc_src, vc_src, k_win, v_win = branch_kv(k, v, kv_cmp, kv_win)
    k_cmp, v_cmp = compress_kv(kc_src, vc_src, layout, cfg, compress_fn)
    ct = compute_dtype(q.dtype)
    # Cast once per call, not per chunk. Gathering from compute-dtype copies also makes the backward's
    # scatter-add of K/V gradients accumulate in fp32 rather than in bf16.
    k_cmp_ct, v_cmp_ct = k_cmp.to(ct), v_cmp.to(ct)
    shared_win = k_win is k and v_win is v
    k_sel, v_sel = k, v  # the selected branch's K/V in the storage dtype (a fast sel provider reads these)
    k, v = k.to(ct), v.to(ct)
    k_win, v_win = (k, v) if shared_win else (k_win.to(ct), v_win.to(ct))

    o_cmp_full = lse_cmp_full = o_win_full = None
    if plan.cmp.fn is not None:
        o_cmp_full, lse_cmp_full = plan.cmp.fn(q, k_cmp, v_cmp, layout, cfg, scale)
    if plan.win.fn is not None:
        o_win_full = plan.win.fn(q, k_win, v_win, layout, cfg, scale)

    fixed = dedupe_indices(block_indices) if block_indices is not None else None
    if fixed is None and plan.topn.fn is not None:
        fixed = plan.topn.fn(q, k_cmp, lse_cmp_full, layout, cfg, scale).long()
    chunk = chunk or choose_chunk(T, Hq, Hkv, Dk, Dv, layout.n_cmp, cfg, plan.chunk_budget)
    tensors = (q, k, v, gates, k_cmp_ct, v_cmp_ct, k_win, v_win)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if use_checkpoint is None:
        use_checkpoint = grad and T > chunk
    sel_deferred = plan.sel.fn is not None
    outs, idxs = [], []
    # One chunk when it covers T: then T stays symbolic under torch.compile (a loop over range(T) would fix it).
    bounds = [(0, T)] if T <= chunk else [(c0, min(T, c0 + chunk)) for c0 in range(0, T, chunk)]
    for c0, c1 in bounds:
        args = (c0, c1, q, k, v, gates, k_cmp_ct, v_cmp_ct, k_win, v_win, layout, cfg, scale, fixed,
                o_cmp_full, lse_cmp_full, o_win_full, need_indices, sel_deferred)
        if use_checkpoint and grad:
            o, idx = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            o, idx = _chunk(*args)
        outs.append(o)
        idxs.append(idx)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if sel_deferred:  # one whole-T call with every chunk's indices
        idx_all = (torch.cat(idxs, dim=1) if len(idxs) > 1 else idxs[0]).to(torch.int32)
        o_sel = plan.sel.fn(q, k_sel, v_sel, idx_all, layout, cfg, scale)
        out = (out + gates[..., 1:2].to(ct) * o_sel.to(ct)).to(q.dtype)
        return out, (idx_all if need_indices else None)
    indices = None
    if need_indices:
        indices = torch.cat(idxs, dim=1).to(torch.int32) if len(idxs) > 1 else idxs[0].to(torch.int32)
    return out, indices


__all__ = ["choose_chunk", "run_chunked"]
