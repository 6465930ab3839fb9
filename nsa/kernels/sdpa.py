"""`sdpa`: torch.nn.functional.scaled_dot_product_attention as a provider of the compressed and sliding
branches (nsa.branches.compressed.sdpa, nsa.branches.sliding.sdpa): availability, guard, and the GQA
folding both branches share.

GQA without copying K/V: the G query heads of a KV head are folded into the query length, q
[B, Hkv, C*G, D] against k/v [B, Hkv, N, D] (equal head counts, so no enable_gqa and no backend that
repeats K/V internally), with a boolean mask [B, 1, C*G, N] built per chunk from token positions. Memory
per chunk is C*G*N mask bytes: never a dense [T, T] mask at long T. With a mask the flash backend is not
eligible; SDPA picks memory-efficient, cuDNN or math. Used by `auto` on CUDA only (on CPU the torch path
serves the same math); backend="sdpa" forces it anywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..toggles import Toggles
from .device import Failure

MASK_BUDGET = 1 << 25  # bool mask elements per chunk


def chunk_len(T: int, G: int, keys: int, toggles: Toggles) -> int:
    """Queries per chunk: NSA_SDPA_CHUNK, else the largest power of two <= 1024 within the mask budget."""
    if toggles.sdpa_chunk:
        return toggles.sdpa_chunk
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


class SdpaProvider:
    name = "sdpa"

    def __init__(self):
        self.available_override: tuple[bool, str] | None = None

    def availability(self, device, forced):
        if self.available_override is not None:
            return self.available_override
        if not hasattr(F, "scaled_dot_product_attention"):
            return False, f"torch {torch.__version__} has no scaled_dot_product_attention"
        if device.type != "cuda" and not forced:
            return False, "auto uses sdpa on CUDA only (on CPU the torch path serves); backend='sdpa' forces it"
        return True, "torch scaled_dot_product_attention"

    def guard(self, branch: str, ctx, toggles: Toggles, forced: bool) -> Failure | None:
        return None  # any float dtype, any head dim, dense or packed
