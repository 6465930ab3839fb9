"""The three NSA branches on one chunk of queries, in plain PyTorch.

Queries come grouped by KV head, q [B, C, Hkv, G, Dk]: the G query heads of a group read one copy of
their K/V (GQA by folding, never by copying K/V per head). Masks are built from positions, so the
same code serves dense, packed (varlen) and decode inputs.
"""

from __future__ import annotations

import torch

from ..config import NSAConfig


def attend(q, k, v, mask, scale, return_probs=False):
    """Masked softmax attention with safe empty rows.

    q [B, C, Hkv, G, Dk]. Shared keys: k [B, N, Hkv, Dk], v [B, N, Hkv, Dv], mask [B, C, N].
    Per-query keys: k [B, C, Hkv, M, Dk], v [B, C, Hkv, M, Dv], mask [B, C, Hkv, M].
    A row with no visible key gives exactly 0 and a zero (never NaN) gradient.
    """
    if k.shape[-3 if k.dim() == 4 else -2] == 0:  # no keys at all: every row is empty
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        return (out, q.new_zeros(*q.shape[:-1], 0)) if return_probs else out
    if k.dim() == 4:
        logits = torch.einsum("bchgd,bnhd->bchgn", q, k)
        mask = mask[:, :, None, None, :]
    else:
        logits = torch.einsum("bchgd,bchmd->bchgm", q, k)
        mask = mask[:, :, :, None, :]
    logits = (logits * scale).masked_fill(~mask, float("-inf"))
    row_max = logits.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    if k.dim() == 4:
        out = torch.einsum("bchgn,bnhd->bchgd", probs, v)
    else:
        out = torch.einsum("bchgm,bchmd->bchgd", probs, v)
    return (out, probs) if return_probs else out


def compressed_branch(q, k_cmp, v_cmp, cmp_start, cmp_valid, t_glob, seq_start, cfg: NSAConfig, scale):
    """q [B,C,Hkv,G,Dk] at global positions t_glob [C]; k_cmp/v_cmp [B,N,Hkv,D] with slot metadata [B,N].

    Block visible iff it belongs to the query's sequence and ends at or before the query.
    Returns (out, probs [B,C,Hkv,G,N]).
    """
    visible = (
        cmp_valid[:, None, :]
        & (cmp_start[:, None, :] >= seq_start[:, :, None])
        & (cmp_start[:, None, :] + (cfg.block_cmp - 1) <= t_glob[None, :, None])
    )
    return attend(q, k_cmp, v_cmp, visible, scale, return_probs=True)


def selection_scores(p_cmp, cmp_local, n_blocks: int, cfg: NSAConfig):
    """Block scores [B, C, Hkv, n_blocks] from compressed probabilities p_cmp [B, C, Hkv, G, N].

    S[j] sums, over the group's heads and the compressed blocks overlapping selection block j, the
    probabilities (overlap weights are 1; a compressed block overlaps at most a few selection blocks,
    so this is a short, fixed loop of scatter-adds, not a loop over blocks).
    """
    p = p_cmp.sum(dim=3)  # [B, C, Hkv, N]
    B, C, H, N = p.shape
    scores = p.new_zeros(B, C, H, n_blocks)
    if N == 0:
        return scores
    first = torch.div(cmp_local, cfg.block_sel, rounding_mode="floor")  # [B, N]
    last = torch.div(cmp_local + cfg.block_cmp - 1, cfg.block_sel, rounding_mode="floor")
    for offset in range((cfg.block_cmp - 1) // cfg.block_sel + 2):
        j = first + offset
        keep = (j <= last) & (j < n_blocks)
        idx = torch.where(keep, j, torch.zeros_like(j))[:, None, None, :].expand(B, C, H, N)
        scores.scatter_add_(-1, idx, p * keep[:, None, None, :].to(p.dtype))
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


def dedupe_indices(indices):
    """User-given indices: drop repeats (a block counts once), keep ascending order, -1 padded."""
    idx = indices.long()
    big = torch.iinfo(torch.int64).max
    s = torch.where(idx >= 0, idx, torch.full_like(idx, big)).sort(dim=-1).values
    repeat = torch.zeros_like(s, dtype=torch.bool)
    repeat[..., 1:] = s[..., 1:] == s[..., :-1]
    s = torch.where(repeat, torch.full_like(s, big), s).sort(dim=-1).values  # repeats go to the end
    return torch.where(s == big, torch.full_like(s, -1), s)


def selected_branch(q, k, v, indices, pos, seq_start, cfg: NSAConfig, scale):
    """q [B,C,Hkv,G,Dk]; k/v [B,S,Hkv,D] indexed by global position; indices [B,C,Hkv,n] local block ids.

    Query at position pos attends the tokens u <= pos of its selected blocks (-1 entries are ignored).
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
    kg, vg = k[batch, tok, head].to(q.dtype), v[batch, tok, head].to(q.dtype)
    return attend(q, kg, vg, keep.reshape(B, C, H, n * ls), scale)


def sliding_branch(q, k, v, key_pos, t_glob, seq_start, cfg: NSAConfig, scale):
    """q [B,C,Hkv,G,Dk]; k/v [B,N,Hkv,D] holding global positions key_pos [N] (or [B, N]; -1 = empty).

    Query t attends u with max(seq_start, t - w + 1) <= u <= t.
    """
    if key_pos.dim() == 1:
        key_pos = key_pos[None]
    kp = key_pos[:, None, :]
    visible = (
        (kp >= 0)
        & (kp <= t_glob[None, :, None])
        & (kp > t_glob[None, :, None] - cfg.window)
        & (kp >= seq_start[:, :, None])
    )
    return attend(q, k, v, visible, scale)
