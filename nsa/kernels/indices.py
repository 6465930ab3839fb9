"""Rows of selected-block ids in the form the selection kernels take (torch only; no triton)."""

from __future__ import annotations

import torch


def dedupe_blocks(indices: torch.Tensor) -> torch.Tensor:
    """Each row's block ids ascending, a block named twice counted once, -1 (none) after them; same dtype.

    The reference counts a repeated block once. The kernels take -1 anywhere in a row, but end a token's walk
    early only where its visible blocks come first (nsa.kernels.triton.common.selected_tiles), as here and
    in the top-n step's rows. Two sorts on the device, no host sync."""
    big = torch.iinfo(indices.dtype).max
    s = torch.where(indices >= 0, indices, torch.full_like(indices, big)).sort(dim=-1).values
    repeat = torch.zeros_like(s, dtype=torch.bool)
    repeat[..., 1:] = s[..., 1:] == s[..., :-1]
    s = torch.where(repeat, torch.full_like(s, big), s).sort(dim=-1).values  # repeats go to the end
    return torch.where(s == big, torch.full_like(s, -1), s)


__all__ = ["dedupe_blocks"]
