"""The oracle: NSA exactly as docs/semantics.md defines it, written to be read, run in float64.

It builds the three masks explicitly ([T, T_cmp] for the compressed branch, [Hkv, T, T] for the
selected one, [T, T] for the sliding window) one sequence at a time. It is O(T^2) in memory and slow on
purpose: every fast path is tested against it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .config import NSAConfig

CompressFn = Callable[[torch.Tensor], torch.Tensor]  # [N, l, H, D] -> [N, H, D]


class NSAOutput(NamedTuple):
    out: torch.Tensor  # [B, T, Hq, Dv]
    o_cmp: torch.Tensor  # per-branch outputs, before gating
    o_sel: torch.Tensor
    o_win: torch.Tensor
    indices: torch.Tensor  # [B, T, Hkv, n_sel] int32, ascending, padded with -1


def exact_logits(q, k):
    """q [H, Tq, D], k [H, Tk, D] -> q.k [H, Tq, Tk] as an elementwise product summed over D: the same
    operations for every (query, key), so equal keys give bitwise-equal logits wherever they sit (a
    batched matmul rounds by tile position). The top-n tie rule relies on it."""
    H, Tq, D = q.shape
    Tk = k.shape[1]
    step = max(1, (1 << 24) // max(1, H * Tq * D))
    return torch.cat([(q[:, :, None, :] * k[:, None, j:j + step, :]).sum(-1) for j in range(0, Tk, step)], dim=-1)


def masked_softmax_attention(q, k, v, mask, scale, exact=False):
    """q [H, Tq, D], k/v [H, Tk, D] (already per query head), mask [H or 1, Tq, Tk] bool.

    Rows with no visible key output exactly 0. Returns (out [H, Tq, Dv], probabilities [H, Tq, Tk]).
    exact: logits by exact_logits (the compressed branch, whose probabilities rank the blocks).
    """
    if k.shape[1] == 0:  # no keys at all (e.g. T < block_cmp): every row is empty
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]), q.new_zeros(q.shape[0], q.shape[1], 0)
    logits = (exact_logits(q, k) if exact else torch.einsum("hqd,hkd->hqk", q, k)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("hqk,hkd->hqd", probs, v), probs


def compress_blocks(x: torch.Tensor, cfg: NSAConfig, phi: CompressFn | None) -> torch.Tensor:
    """x [T, H, D] -> [T_cmp, H, D]: block i covers tokens [i*d, i*d + l)."""
    T, H, D = x.shape
    n = cfg.n_cmp_blocks(T)
    if n == 0:
        return x.new_zeros(0, H, D)
    blocks = torch.stack([x[i * cfg.stride_cmp: i * cfg.stride_cmp + cfg.block_cmp] for i in range(n)])
    return blocks.mean(dim=1) if phi is None else phi(blocks)


def select_blocks(scores: torch.Tensor, t: int, cfg: NSAConfig) -> list[int]:
    """Top-n for one query position and KV group. scores [n_blocks_total]; returns ascending block ids."""
    j_t = t // cfg.block_sel
    candidates = list(range(j_t + 1))
    if len(candidates) <= cfg.n_sel:
        return candidates
    forced = {j for j in candidates if j < cfg.n_init or j > j_t - cfg.n_local}
    others = sorted((j for j in candidates if j not in forced), key=lambda j: (-float(scores[j]), j))
    return sorted(forced | set(others[: cfg.n_sel - len(forced)]))


def _one_sequence(q, k, v, g, cfg, kv_cmp, kv_win, phi, fixed_indices):
    """All inputs float64 for one sequence: q [T, Hq, Dk], k/v [T, Hkv, D], g [T, Hq, 3]."""
    T, Hq, Dk = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = cfg.softmax_scale(Dk)
    l, d, ls = cfg.block_cmp, cfg.stride_cmp, cfg.block_sel
    head_kv = torch.arange(Hq) // G  # query head h reads KV head h // G
    qh = q.permute(1, 0, 2)  # [Hq, T, Dk]
    t_idx = torch.arange(T)

    # 1. Compressed branch: block i is visible to t iff i*d + l - 1 <= t.
    k_c = compress_blocks(kv_cmp[0], cfg, phi[0] if phi else None)
    v_c = compress_blocks(kv_cmp[1], cfg, phi[1] if phi else None)
    n_cmp = k_c.shape[0]
    cmp_end = torch.arange(n_cmp) * d + l - 1
    cmp_mask = (cmp_end[None, :] <= t_idx[:, None])[None]  # [1, T, T_cmp]
    o_cmp, p_cmp = masked_softmax_attention(
        qh, k_c.permute(1, 0, 2)[head_kv], v_c.permute(1, 0, 2)[head_kv], cmp_mask, scale, exact=True
    )

    # 2. Selection scores: sum over the group's heads and over compressed blocks overlapping block j.
    #    Heads first, then the overlapping blocks one at a time in order of position (fixed order: equal
    #    probabilities give bitwise-equal scores). Block i = j*l'/d - c + o, o in [0, l'/d + c), overlaps j.
    n_blocks = cfg.n_sel_blocks(T)
    p_group = p_cmp.reshape(Hkv, G, T, n_cmp).sum(dim=1)  # [Hkv, T, T_cmp]
    r, c = ls // d, l // d - 1
    scores = p_group.new_zeros(Hkv, T, n_blocks)
    for j in range(n_blocks):
        for i in range(j * r - c, j * r + r):
            if 0 <= i < n_cmp:
                scores[:, :, j] += p_group[:, :, i]

    # 3. Top-n (or the given indices) -> 4. selected-branch mask [Hkv, T, T].
    sel_mask = torch.zeros(Hkv, T, T, dtype=torch.bool)
    indices = torch.full((T, Hkv, cfg.n_sel), -1, dtype=torch.int32)
    causal = t_idx[None, :] <= t_idx[:, None]
    token_block = t_idx // ls
    for t in range(T):
        for h in range(Hkv):
            if fixed_indices is None:
                chosen = select_blocks(scores[h, t], t, cfg)
            else:
                chosen = sorted({int(j) for j in fixed_indices[t, h].tolist() if j >= 0})
            indices[t, h, : len(chosen)] = torch.tensor(chosen[: cfg.n_sel], dtype=torch.int32)
            sel_mask[h, t] = torch.isin(token_block, torch.tensor(chosen, dtype=torch.long)) & causal[t]
    o_sel, _ = masked_softmax_attention(qh, k.permute(1, 0, 2)[head_kv], v.permute(1, 0, 2)[head_kv],
                                        sel_mask[head_kv], scale)

    # 5. Sliding window: t attends u in [max(0, t - w + 1), t].
    win_mask = (causal & (t_idx[None, :] > t_idx[:, None] - cfg.window))[None]
    o_win, _ = masked_softmax_attention(qh, kv_win[0].permute(1, 0, 2)[head_kv],
                                        kv_win[1].permute(1, 0, 2)[head_kv], win_mask, scale)

    # 6. Gated sum.
    o_cmp, o_sel, o_win = (o.permute(1, 0, 2) for o in (o_cmp, o_sel, o_win))  # [T, Hq, Dv]
    out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    return out, o_cmp, o_sel, o_win, indices


def nsa_reference(q, k, v, gates, config: NSAConfig, *, cu_seqlens=None, block_indices=None,
                  kv_cmp=None, kv_win=None, compress_fn=None) -> NSAOutput:
    """NSA in float64. Same arguments as nsa.nsa_attention; returns every branch and the block indices.

    kv_cmp / kv_win: optional (k, v) pairs for the compressed and sliding branches (independent
    projections, as in the paper); k, v then serve the selected branch only. compress_fn: optional
    (phi_k, phi_v) callables [N, l, H, D] -> [N, H, D]; default is the mean ("avg").
    """
    from .validation import check_block_indices, check_branch_kv, check_cu_seqlens, check_qkv

    shapes = check_qkv(q, k, v, gates)
    if config.compress == "mlp" and compress_fn is None:
        raise ValueError("config.compress='mlp' needs compress_fn=(phi_k, phi_v)")
    if kv_cmp is not None:
        check_branch_kv("kv_cmp", kv_cmp, k, v)
    if kv_win is not None:
        check_branch_kv("kv_win", kv_win, k, v)
    if block_indices is not None:
        check_block_indices(block_indices, shapes, config.n_sel, q.device)
    bounds = (check_cu_seqlens(cu_seqlens, shapes, q.device) if cu_seqlens is not None
              else None)

    def f64(x):
        return x.detach().to("cpu", torch.float64)

    qd, kd, vd, gd = map(f64, (q, k, v, gates))
    kcd = tuple(map(f64, kv_cmp)) if kv_cmp is not None else (kd, vd)
    kwd = tuple(map(f64, kv_win)) if kv_win is not None else (kd, vd)
    fixed = block_indices.cpu() if block_indices is not None else None

    segments = [(b, 0, shapes.T) for b in range(shapes.B)] if bounds is None else [
        (0, s, e) for s, e in zip(bounds, bounds[1:])]
    results = []
    for b, s, e in segments:
        if e == s:
            continue
        sl = (b, slice(s, e))
        results.append((b, s, e, _one_sequence(
            qd[sl], kd[sl], vd[sl], gd[sl], config, (kcd[0][sl], kcd[1][sl]), (kwd[0][sl], kwd[1][sl]),
            compress_fn, None if fixed is None else fixed[sl])))

    B, T, Hq, Hkv, Dv = shapes.B, shapes.T, shapes.Hq, shapes.Hkv, shapes.Dv
    outs = [torch.zeros(B, T, Hq, Dv, dtype=torch.float64) for _ in range(4)]
    indices = torch.full((B, T, Hkv, config.n_sel), -1, dtype=torch.int32)
    for b, s, e, (out, o_cmp, o_sel, o_win, idx) in results:
        for dst, src in zip(outs, (out, o_cmp, o_sel, o_win)):
            dst[b, s:e] = src
        indices[b, s:e] = idx
    return NSAOutput(*outs, indices)
