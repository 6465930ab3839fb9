"""NSAConfig: the typed, validated configuration of one NSA attention layer.

The fields and their rules follow docs/semantics.md (paper defaults). Environment toggles never live
here: they are read at call time by nsa.toggles and mapped onto the plan of each call (nsa.plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

COMPRESS_KINDS = ("avg", "mlp")


@dataclass(frozen=True)
class NSAConfig:
    """NSA hyper-parameters.

    block_cmp (l): tokens per compressed block. stride_cmp (d): distance between compressed blocks.
    block_sel (l'): tokens per selection block. n_sel (n): selected blocks per query, forced ones included.
    n_init / n_local: blocks always selected at the start / ending at the query's own block.
    window (w): sliding-window length (the query itself included).
    compress: "avg" (mean of the block, parameter free) or "mlp" (learnable phi, see NSAAttention).
    scale: softmax scale; None means 1/sqrt(Dk).
    """

    block_cmp: int = 32
    stride_cmp: int = 16
    block_sel: int = 64
    n_sel: int = 16
    n_init: int = 1
    n_local: int = 2
    window: int = 512
    compress: str = "avg"
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("block_cmp", "stride_cmp", "block_sel", "n_sel", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NSAConfig.{name} must be a positive int, got {value!r}")
        for name in ("n_init", "n_local"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"NSAConfig.{name} must be a non-negative int, got {value!r}")
        if self.block_cmp % self.stride_cmp:
            raise ValueError(
                f"NSAConfig.stride_cmp ({self.stride_cmp}) must divide block_cmp ({self.block_cmp})"
            )
        if self.block_sel % self.stride_cmp:
            raise ValueError(
                f"NSAConfig.stride_cmp ({self.stride_cmp}) must divide block_sel ({self.block_sel})"
            )
        if self.n_sel < self.n_init + self.n_local:
            raise ValueError(
                f"NSAConfig.n_sel ({self.n_sel}) must be >= n_init + n_local "
                f"({self.n_init} + {self.n_local}): forced blocks count toward n_sel"
            )
        if self.compress not in COMPRESS_KINDS:
            raise ValueError(f"NSAConfig.compress must be one of {COMPRESS_KINDS}, got {self.compress!r}")
        if self.scale is not None and (not isinstance(self.scale, (int, float)) or not self.scale > 0
                                       or not math.isfinite(self.scale)):
            raise ValueError(f"NSAConfig.scale must be a positive finite float or None, got {self.scale!r}")

    def softmax_scale(self, head_dim: int) -> float:
        return float(self.scale) if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def n_cmp_blocks(self, seqlen: int) -> int:
        """Compressed blocks of a sequence of `seqlen` tokens: floor((T - l) / d) + 1, or 0 when T < l."""
        if seqlen < self.block_cmp:
            return 0
        return (seqlen - self.block_cmp) // self.stride_cmp + 1

    def sel_overlap(self) -> tuple[int, int]:
        """(r, c): selection block j gathers compressed blocks i = j*r - c + o for o in [0, r + c), i.e. every
        block [i*d, i*d + l) that overlaps [j*l', (j+1)*l') (r = l'/d, c = l/d - 1)."""
        return self.block_sel // self.stride_cmp, self.block_cmp // self.stride_cmp - 1

    def n_sel_blocks(self, seqlen: int) -> int:
        """Selection blocks (the last one may be partial)."""
        return -(-seqlen // self.block_sel)

    def with_(self, **changes) -> NSAConfig:
        return replace(self, **changes)
