"""What the compressed and sliding branches do to their tensors before an FA-2-family kernel call: cast to
the kernel dtype planning chose (CallContext.kernel_dtype), zero-pad the head dims to one size, make the
last dim contiguous (each copy counted in nsa.telemetry as a "contiguous_copy" event)."""

from __future__ import annotations

import torch

from .. import telemetry
from .context import CallContext


def last_dim_contiguous(x: torch.Tensor, branch: str, backend: str) -> torch.Tensor:
    """FA-2 kernels need stride 1 in the last dim (any other strides are fine). Copies are counted."""
    if x.stride(-1) == 1:
        return x
    telemetry.event(branch, backend, "contiguous_copy")
    return x.contiguous()


def pad_last(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def padded_head_dim(dk: int, dv: int) -> int:
    """FA-2 needs one head dim for q, k and v: the smaller side is zero-padded to max(dk, dv)."""
    return max(dk, dv)


def prep(prov, tensors, ctx: CallContext, branch: str):
    """Cast to the kernel dtype, zero-pad the head dims to one size, make the last dim contiguous."""
    kd = ctx.kernel_dtype
    if kd is None:  # planning sets it with the provider; reaching this is a planning bug
        raise RuntimeError(f"{prov.name}: no kernel dtype planned for {ctx.dtype}")
    D = padded_head_dim(ctx.Dk, ctx.Dv)
    return [last_dim_contiguous(pad_last(x.to(kd), D), branch, prov.name) for x in tensors]


__all__ = ["last_dim_contiguous", "pad_last", "padded_head_dim", "prep"]
