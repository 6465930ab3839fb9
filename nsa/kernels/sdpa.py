"""`sdpa`: torch.nn.functional.scaled_dot_product_attention as the compressed and sliding branches call it
(nsa.branches.compressed.sdpa, nsa.branches.sliding.sdpa): the query chunking and the GQA folding both
branches share. When it serves is planning's (nsa.plan.providers.SdpaProvider).

GQA without copying K/V: the G query heads of a KV head are folded into the query length, q
[B, Hkv, C*G, D] against k/v [B, Hkv, N, D] (equal head counts, so no enable_gqa and no backend that
repeats K/V internally), with a boolean mask [B, 1, C*G, N] built per chunk from token positions. Memory
per chunk is C*G*N mask bytes: never a dense [T, T] mask at long T. With a mask the flash backend is not
eligible; SDPA picks memory-efficient, cuDNN or math. Used by `auto` on CUDA only (on CPU the torch path
serves the same math); backend="sdpa" forces it anywhere.
"""

from __future__ import annotations

import torch

MASK_BUDGET = 1 << 25  # bool mask elements per chunk


def chunk_len(T: int, G: int, keys: int, override: int | None = None) -> int:
    """Queries per chunk: `override` when given, else the largest power of two <= 1024 within the mask budget."""
    if override:
        return override
    c = 1024
    while c > 64 and c * G * max(keys, 1) > MASK_BUDGET:
        c //= 2
    return max(1, min(c, T))


def fold(qc: torch.Tensor, Hkv: int) -> torch.Tensor:
    """[B, C, Hq, D] -> [B, Hkv, C*G, D] (row c*G + g)."""
    B, C, Hq, D = qc.shape
    return qc.view(B, C, Hkv, Hq // Hkv, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, C * (Hq // Hkv), D)


def unfold(o: torch.Tensor, C: int) -> torch.Tensor:
    B, Hkv, CG, Dv = o.shape
    G = CG // C
    return o.view(B, Hkv, C, G, Dv).permute(0, 2, 1, 3, 4).reshape(B, C, Hkv * G, Dv)


def rows(mask: torch.Tensor, G: int) -> torch.Tensor:
    """[B, C, N] -> [B, 1, C*G, N] (row c*G + g)."""
    B, C, N = mask.shape
    return mask[:, :, None, :].expand(B, C, G, N).reshape(B, 1, C * G, N)


__all__ = ["MASK_BUDGET", "chunk_len", "fold", "rows", "unfold"]
