"""Selected branch in plain PyTorch: top-n (scores from the compressed branch's probabilities) and
attention over the selected blocks. Per-chunk functions for the chunked pipeline and decode, and the
whole-T naive twins with the branch signatures:

    indices = top_n(q, k_cmp, lse, layout, cfg, scale)       int32 [B, T, Hkv, n_sel]
    o_sel = selected_attention(q, k, v, indices, layout, cfg, scale)

Exact ties (docs/semantics.md): mathematically equal scores must come out bitwise equal, so that the
rule "ties to the lower block index" picks the same blocks in every path. A batched matmul rounds the
same dot product differently depending on where its row sits in the tile, so the logits of the scores
are computed elementwise (score_logits), the heads are summed in a fixed order, and each selection
block adds its overlapping compressed blocks one at a time in the same order.
"""

from __future__ import annotations

import torch

from ...config import NSAConfig
from ...kernels.indices import dedupe_blocks
from ...layout import SeqLayout
from ..attend import attend, chunks, compute_dtype
from ..compressed.naive import visible

# Elements of the elementwise product q*k held at once by score_logits.
SCORE_LOGITS_BUDGET = 1 << 24


def score_logits(qc, k_cmp, scale, budget: int = SCORE_LOGITS_BUDGET):
    """scale * q.k for q [B, C, Hkv, G, D] and k [B, N, Hkv, D] -> [B, C, Hkv, G, N], each entry by the
    same product and sum over D, so equal keys give bitwise-equal logits wherever they sit."""
    B, C, H, G, D = qc.shape
    N = k_cmp.shape[1]
    step = max(1, budget // max(1, B * C * H * G * D))
    kt = k_cmp.permute(0, 2, 1, 3)[:, None, :, None]  # [B, 1, H, 1, N, D]
    if N <= step:  # one piece: no loop over range(N), so N stays symbolic under torch.compile
        return (qc[..., None, :] * kt).sum(-1) * scale
    out = qc.new_empty(B, C, H, G, N)
    for n0 in range(0, N, step):
        out[..., n0:n0 + step] = (qc[..., None, :] * kt[..., n0:n0 + step, :]).sum(-1)
    return out * scale


def cmp_probs(qc, k_cmp, lse, mask, scale):
    """Compressed-branch probabilities exp(s*q.k - lse) [B, C, Hkv, G, N] (0 where invisible or the row
    is empty). lse [B, C, Hkv, G] comes from whichever provider ran the compressed branch."""
    logits = score_logits(qc, k_cmp, scale)
    lse = lse.to(logits.dtype)[..., None]
    keep = mask[:, :, None, None, :] & torch.isfinite(lse)
    return torch.where(keep, torch.exp(logits - lse), torch.zeros_like(logits))


def selection_scores(p, cmp_local, cmp_valid, n_blocks: int, cfg: NSAConfig):
    """Block scores [B, C, Hkv, n_blocks] from probabilities p [B, C, Hkv, G, N] (slot metadata [B, N]).

    S[j] sums over the group's heads, then over the compressed blocks overlapping selection block j in
    the order of o (one term per pass: other sequences' slots hold exact zeros for this query, so every
    pass adds exactly one value and the sum is the same whatever the device's scatter order).
    """
    ps = p.sum(dim=3)  # [B, C, H, N]
    B, C, H, N = ps.shape
    scores = ps.new_zeros(B, C, H, n_blocks)
    if N == 0 or n_blocks == 0:
        return scores
    r, c = cfg.sel_overlap()
    i_local = torch.div(cmp_local, cfg.stride_cmp, rounding_mode="floor")  # [B, N]
    for o in range(r + c):
        num = i_local + c - o  # = j * r for the block j this pass adds slot n to
        j = torch.div(num, r, rounding_mode="floor")
        ok = cmp_valid & (num >= 0) & (num % r == 0) & (j < n_blocks)
        idx = torch.where(ok, j, torch.zeros_like(j))[:, None, None, :].expand(B, C, H, N)
        scores.scatter_add_(-1, idx, torch.where(ok[:, None, None, :], ps, torch.zeros_like(ps)))
    return scores


def top_n_blocks(scores, pos, cfg: NSAConfig):
    """Pick blocks: scores [B, C, Hkv, J], pos [B, C] (position within the sequence).

    Candidates j <= pos // l'. Forced: j < n_init and the n_local blocks ending at pos // l'. The rest by
    score, ties to the lower index (stable sort). Returns int64 [B, C, Hkv, n_sel], ascending, -1 padded.
    """
    B, C, H, J = scores.shape
    j = torch.arange(J, device=scores.device)
    j_t = torch.div(pos, cfg.block_sel, rounding_mode="floor")[:, :, None, None]
    candidate = j <= j_t
    forced = candidate & ((j < cfg.n_init) | (j > j_t - cfg.n_local))
    key = scores.masked_fill(~candidate, float("-inf")).masked_fill(forced, float("inf"))
    take = min(cfg.n_sel, J)
    ranked = torch.sort(key, dim=-1, descending=True, stable=True)
    chosen = ranked.indices[..., :take]
    ok = ranked.values[..., :take] > float("-inf")
    chosen = torch.where(ok, chosen, torch.full_like(chosen, J)).sort(dim=-1).values
    chosen = torch.where(chosen < J, chosen, torch.full_like(chosen, -1))
    if take < cfg.n_sel:
        chosen = torch.cat([chosen, chosen.new_full((B, C, H, cfg.n_sel - take), -1)], dim=-1)
    return chosen


def topn_chunk(qc, k_cmp, lse, cmp_start, cmp_local, cmp_valid, t_glob, seq_start, n_blocks, cfg, scale):
    """Top-n for one chunk of queries (no grad): q [B,C,Hkv,G,Dk], lse [B,C,Hkv,G] -> int64 [B,C,Hkv,n]."""
    with torch.no_grad():
        mask = visible(cmp_start, cmp_valid, t_glob, seq_start, cfg)
        p = cmp_probs(qc.detach(), k_cmp.detach(), lse, mask, scale)
        scores = selection_scores(p, cmp_local, cmp_valid, n_blocks, cfg)
        return top_n_blocks(scores, t_glob[None, :] - seq_start, cfg)


def top_n(q, k_cmp, lse, layout: SeqLayout, cfg: NSAConfig, scale, chunk=None):
    """Whole-T naive twin of the fused top-n kernel: int32 [B, T, Hkv, n_sel]."""
    B, T, Hq, _ = q.shape
    Hkv = k_cmp.shape[2]
    ct = compute_dtype(q.dtype)
    out = []
    for c0, c1 in chunks(T, chunk or 256):
        n = layout.cmp_visible_bound(c1, cfg)
        t_glob = torch.arange(c0, c1, device=q.device)
        qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, Hq // Hkv))
        lc = lse[:, c0:c1].unflatten(2, (Hkv, Hq // Hkv))
        out.append(topn_chunk(qc, k_cmp[:, :n].to(ct), lc, layout.cmp_start[:, :n], layout.cmp_local[:, :n],
                              layout.cmp_valid[:, :n], t_glob, layout.seq_start[:, c0:c1],
                              layout.n_sel_blocks, cfg, scale))
    if not out:
        return torch.zeros(B, 0, Hkv, cfg.n_sel, dtype=torch.int32, device=q.device)
    return torch.cat(out, 1).to(torch.int32)


def dedupe_indices(indices):
    """User-given indices: drop repeats (a block counts once), keep ascending order, -1 padded (int64)."""
    return dedupe_blocks(indices.long())


def selected_chunk(q, k, v, indices, pos, seq_start, cfg: NSAConfig, scale, *, block_table=None, page_size=None):
    """q [B,C,Hkv,G,Dk]; k/v [B,S,Hkv,D] indexed by global position; indices [B,C,Hkv,n] local block ids.

    Query at position pos attends the tokens u <= pos of its selected blocks (-1 entries are ignored).
    Paged K/V (nsa.paged_cache): k/v are page pools [pages, page_size, Hkv, D] and position u of sequence
    b lives in page block_table[b, u // page_size] at row u % page_size.
    """
    B, C, H, n = indices.shape
    ls = cfg.block_sel
    r = torch.arange(ls, device=q.device)
    local = indices[..., None] * ls + r  # [B, C, H, n, ls]
    keep = (indices[..., None] >= 0) & (local <= pos[:, :, None, None, None])
    tok = torch.where(keep, seq_start[:, :, None, None, None] + local, torch.zeros_like(local))
    tok = tok.reshape(B, C, H, n * ls)
    batch = torch.arange(B, device=q.device)[:, None, None, None]
    head = torch.arange(H, device=q.device)[None, None, :, None]
    # Gather in the storage dtype, then cast: only the selected tokens are converted.
    if block_table is not None:  # masked tokens read position 0, whose page every non-empty sequence has
        batch, tok = block_table.long()[batch, tok // page_size], tok % page_size
    kg, vg = k[batch, tok, head].to(q.dtype), v[batch, tok, head].to(q.dtype)
    return attend(q, kg, vg, keep.reshape(B, C, H, n * ls), scale)


def selected_attention(q, k, v, indices, layout: SeqLayout, cfg: NSAConfig, scale, chunk=None):
    """Whole-T naive twin of the selected attention kernel: o [B, T, Hq, Dv] in q's dtype.
    Memory per chunk: C*Hkv*n*l'*(Dk+Dv) gathered elements."""
    B, T, Hq, _ = q.shape
    Hkv = k.shape[2]
    ct = compute_dtype(q.dtype)
    idx = dedupe_indices(indices)
    outs = []
    for c0, c1 in chunks(T, chunk or 256):
        ss = layout.seq_start[:, c0:c1]
        pos = torch.arange(c0, c1, device=q.device)[None] - ss
        qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, Hq // Hkv))
        outs.append(selected_chunk(qc, k, v, idx[:, c0:c1], pos, ss, cfg, scale).flatten(2, 3))
    if not outs:
        return q.new_zeros(B, 0, Hq, v.shape[-1])
    return torch.cat(outs, 1).to(q.dtype)
