"""Several new tokens per sequence appended to a non-empty cache, with their outputs: chunked prefill and
the verify step of speculative decoding. Each new token attends what the cache held before the call and
the new tokens up to itself (causal), so any split of a sequence into calls gives the outputs of one
prefill of the whole. Plain PyTorch on the prefill branches' per-chunk functions, one sequence at a time
(sizes read from the cache's host-side lengths): a prefill-sized step, not a per-token decode step.
nsa_prefill runs it where nsa.plan.plan_append does not route the append to decode steps on the Triton
decode kernels (rows with different numbers of new tokens, a torch decode step planned, a prefill
provider forced).

    out = extend(q, gates, cache, k, v, kv_cmp, kv_win, compress_fn, cu_seqlens)
"""

from __future__ import annotations

import torch

from ..attend import compute_dtype
from ..compressed.naive import compressed_chunk
from ..selected.naive import selected_chunk, topn_chunk
from ..sliding.naive import sliding_chunk


def extend(q, gates, cache, k, v, kv_cmp=None, kv_win=None, compress_fn=None, cu_seqlens=None):
    """Append (dense [B, T, Hkv, D], or packed [1, total, Hkv, D] with cu_seqlens) and return the new
    tokens' outputs in q's layout. Validation and the room check are cache.write's."""
    cfg = cache.config
    start = cache.host_seqlens()
    # The window ring before the write: positions start - W .. start - 1 (the write moves it past them)
    t_prev = cache.cache_seqlens.long() - 1
    old_pos = cache.window_positions(t_prev)
    old_kw, old_vw = cache.k_win.clone(), cache.v_win.clone()
    cache.write(k, v, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn, cu_seqlens=cu_seqlens)
    kw_new, vw_new = kv_win if kv_win is not None else (k, v)
    if cu_seqlens is None:
        T = q.shape[1]
        spans = [(b, b, 0, T) for b in range(cache.batch)]  # (row, q batch index, first token, end)
    else:
        cu = cu_seqlens.tolist()  # once per call (cache.write read it too)
        spans = [(b, 0, cu[b], cu[b + 1]) for b in range(cache.batch)]
    Hq, Dk = q.shape[2], q.shape[3]
    Hkv = cache.n_kv_heads
    ct = compute_dtype(q.dtype)
    scale = cfg.softmax_scale(Dk)
    out = torch.zeros(*q.shape[:3], cache.d_v, dtype=q.dtype, device=q.device)
    for row, qb, a, e in spans:
        if e == a:
            continue
        s0 = start[row]
        pos = torch.arange(s0, s0 + e - a, device=q.device)
        zero = torch.zeros(1, e - a, dtype=torch.long, device=q.device)
        qc = q[qb:qb + 1, a:e].to(ct).unflatten(2, (Hkv, Hq // Hkv))
        n = cfg.n_cmp_blocks(s0 + e - a)
        kc, vc = cache.compressed_kv(n, row)
        kc = kc.to(ct)
        cmp_start = (torch.arange(n, device=q.device) * cfg.stride_cmp)[None]
        valid = torch.ones(1, n, dtype=torch.bool, device=q.device)
        o_cmp, lse = compressed_chunk(qc, kc, vc.to(ct), cmp_start, valid, pos, zero, cfg, scale)
        idx = topn_chunk(qc, kc, lse, cmp_start, cmp_start, valid, pos, zero, cfg.n_sel_blocks(s0 + e - a), cfg,
                         scale)
        k_sel, v_sel, paging = cache.selected_kv(row)
        o_sel = selected_chunk(qc, k_sel, v_sel, idx, pos[None], zero, cfg, scale, **paging)
        kwin = torch.cat([old_kw[row], kw_new[qb, a:e]]).to(ct)[None]
        vwin = torch.cat([old_vw[row], vw_new[qb, a:e]]).to(ct)[None]
        key_pos = torch.cat([old_pos[row], pos])[None]
        o_win = sliding_chunk(qc, kwin, vwin, key_pos, pos, zero, cfg, scale)
        g = gates[qb:qb + 1, a:e].to(ct)
        o = (g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 1:2] * o_sel.flatten(2, 3)
             + g[..., 2:3] * o_win.flatten(2, 3))
        out[qb, a:e] = o[0].to(q.dtype)
    return out


__all__ = ["extend"]
