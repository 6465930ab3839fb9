"""What a provider sees of one call (CallContext) and the FlashAttention-2 provider interface shared by
`flash_attn` and `torch_flash`: availability, guards, dtype policy, head-dim padding, one kernel call.
Subclasses implement `availability` and `attn`. How the compressed and sliding branches map onto the
call lives with those branches (nsa.branches.compressed.fa2, nsa.branches.sliding.fa2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import telemetry
from ...toggles import Toggles
from ...validation import Shapes
from . import guards
from .guards import Failure


@dataclass
class CallContext:
    """The facts of one nsa_attention call that planning and the providers need (host values only)."""

    shapes: Shapes
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool
    cu_seqlens: torch.Tensor | None = None  # packed input: int32 offsets on the device
    host_cu: list[int] | None = None  # and their host copy (read once by validation)

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


def last_dim_contiguous(x: torch.Tensor, branch: str, backend: str) -> torch.Tensor:
    """FA-2 kernels need stride 1 in the last dim (any other strides are fine). Copies are counted."""
    if x.stride(-1) == 1:
        return x
    telemetry.event(branch, backend, "contiguous_copy")
    return x.contiguous()


def pad_last(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


class Fa2Provider:
    """Shared FA-2 provider. Test hooks: `capability` (pretend sm), `allow_cpu` (skip the CUDA check),
    `kernel_dtypes` (dtypes passed to the kernel unchanged; fp64 in CPU tests with an emulated kernel),
    `available_override` ((ok, why) instead of probing)."""

    name = "fa2"

    def __init__(self):
        self.capability: tuple[int, int] | None = None
        self.allow_cpu = False
        self.kernel_dtypes = guards.FA2_DTYPES
        self.available_override: tuple[bool, str] | None = None

    def availability(self, device: torch.device, forced: bool) -> tuple[bool, str]:
        raise NotImplementedError

    def _settled(self, device: torch.device, injected, what: str) -> tuple[bool, str] | None:
        """(ok, why) when it is known without probing the library: a test's override, an injected `what`
        (kernel or module), or a device that is not CUDA. None: probe."""
        if self.available_override is not None:
            return self.available_override
        if injected is not None:
            return True, f"injected {what}"
        if device.type != "cuda":
            return False, f"{self.name} runs on CUDA tensors, got {device}"
        return None

    def _cap(self, device):
        """The pretended capability (tests), else the device's (None off CUDA)."""
        return self.capability or guards.device_capability(device)

    def kernel_dtype(self, dtype: torch.dtype, toggles: Toggles):
        if dtype in self.kernel_dtypes:
            return dtype, None
        return guards.kernel_dtype(dtype, toggles)

    def guard(self, branch: str, ctx: CallContext, toggles: Toggles, forced: bool) -> Failure | None:
        if not toggles.fa2_enabled(branch):
            var = "NSA_USE_FA2" if not toggles.use_fa2 else f"NSA_USE_FA2_{branch.upper()}"
            return Failure("disabled", f"{var}=0")
        cap = self._cap(ctx.device)
        if not self.allow_cpu:
            fail = guards.check_device(ctx.device, toggles, cap)
            if fail:
                return fail
        elif cap is not None and tuple(cap) == guards.ADA and not toggles.force:
            return Failure("ada_policy", "Ada (sm 8.9): FA-2 is off by default for NSA; NSA_FA2_FORCE=1 overrides")
        _, fail = self.kernel_dtype(ctx.dtype, toggles)
        if fail:
            return fail
        fail = guards.check_head_dim(ctx.Dk, ctx.Dv, cap, ctx.needs_grad, toggles)
        if fail:
            return fail
        if ctx.packed:
            fail = guards.check_cu_seqlens(ctx.cu_seqlens, ctx.host_cu, ctx.T, ctx.device)
            if fail:
                return fail
            if toggles.force_dense:
                return Failure("force_dense_packed", "NSA_FA2_FORCE_DENSE=1 but the input is packed (cu_seqlens)")
        if not forced:
            return guards.check_min_len(branch, ctx.max_len, guards.padded_head_dim(ctx.Dk, ctx.Dv), cap, toggles)
        return None

    def attn(self, q, k, v, *, causal: bool, left: int, scale: float, varlen, need_lse: bool):
        """One FA-2 call. Dense q [B, Tq, H, D] or varlen q [total, H, D] with varlen = (cu_q, cu_k, max_q,
        max_k). causal: bottom-right causal; else left >= 0 is a window (w-1, 0) and left < 0 no mask at all
        (every query sees every key). Returns (out, lse or None)
        with lse dense [B, H, Tq] / varlen [H, total_q]."""
        raise NotImplementedError

    def prep(self, tensors, ctx: CallContext, toggles: Toggles, branch: str):
        """Cast to the kernel dtype, zero-pad the head dims to one size, make the last dim contiguous."""
        kd, fail = self.kernel_dtype(ctx.dtype, toggles)
        if fail:  # guard() ran first; reaching this is a planning bug
            raise RuntimeError(f"{self.name}: {fail}")
        D = guards.padded_head_dim(ctx.Dk, ctx.Dv)
        return [last_dim_contiguous(pad_last(x.to(kd), D), branch, self.name) for x in tensors]


__all__ = ["CallContext", "Fa2Provider", "last_dim_contiguous", "pad_last"]
