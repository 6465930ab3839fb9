"""What a fast implementation sees of one call (CallContext): shapes, dtype, device, whether gradients
are needed, the packed offsets, and, for an FA-2-family provider, the dtype its kernel runs in. Planning
(nsa.plan) builds it once per call and binds it into the branch functions it picks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import Shapes


@dataclass
class CallContext:
    """The facts of one nsa_attention call that planning and the providers need (host values only)."""

    shapes: Shapes
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool
    cu_seqlens: torch.Tensor | None = None  # packed input: int32 offsets on the device
    host_cu: list[int] | None = None  # and their host copy (read once by validation)
    kernel_dtype: torch.dtype | None = None  # FA-2 family: the dtype the kernel runs in (planning decides)

    def __getattr__(self, name):  # B, T, Hq, Hkv, Dk, Dv, G come from the shapes
        if name in ("B", "T", "Hq", "Hkv", "Dk", "Dv", "G"):
            return getattr(self.shapes, name)
        raise AttributeError(name)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def max_len(self) -> int:
        """Longest sequence: T for dense input, max(cu[i+1] - cu[i]) for packed input."""
        if self.host_cu is None:
            return self.T
        return max((b - a for a, b in zip(self.host_cu, self.host_cu[1:])), default=0)


__all__ = ["CallContext"]
