"""Masked softmax attention in plain PyTorch, shared by the naive branches and the torch decode step."""

from __future__ import annotations

import torch


def attend(q, k, v, mask, scale, return_lse=False):
    """Masked softmax attention with safe empty rows.

    q [B, C, Hkv, G, Dk]. Shared keys: k [B, N, Hkv, Dk], v [B, N, Hkv, Dv], mask [B, C, N].
    Per-query keys: k [B, C, Hkv, M, Dk], v [B, C, Hkv, M, Dv], mask [B, C, Hkv, M].
    A row with no visible key gives exactly 0 and a zero (never NaN) gradient.
    return_lse: also the log-sum-exp [B, C, Hkv, G] of the scaled logits (-inf for empty rows, no grad).
    """
    if k.shape[-3 if k.dim() == 4 else -2] == 0:  # no keys at all: every row is empty
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        return (out, q.new_full(q.shape[:-1], float("-inf"))) if return_lse else out
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
    if not return_lse:
        return out
    with torch.no_grad():
        lse = (row_max + torch.log(denom)).squeeze(-1)
        lse = torch.where(denom.squeeze(-1) > 0, lse, torch.full_like(lse, float("-inf")))
    return out, lse


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch branches compute in: fp64 for fp64 input, else fp32 (never bf16/fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunks(T: int, chunk: int | None):
    """[c0, c1) query ranges of at most `chunk` (all of T when None)."""
    step = max(1, chunk or T)
    return [(c0, min(T, c0 + step)) for c0 in range(0, T, step)]
