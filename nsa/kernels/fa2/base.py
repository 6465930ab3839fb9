"""The FlashAttention-2 kernel interface shared by `flash_attn`, `torch_flash` and `torch_cudnn`: whether
the kernel exists here (availability), and one kernel call (attn). Which calls a kernel may serve (guards,
dtype policy, thresholds) is planning's (nsa.plan.rules); how the compressed and sliding branches map onto
the call lives with those branches (nsa.branches.compressed.fa2, nsa.branches.sliding.fa2).
"""

from __future__ import annotations

import torch

from ..device import device_capability

FA2_DTYPES = (torch.float16, torch.bfloat16)  # what the kernels take as they are


class Fa2Provider:
    """Shared FA-2 provider. Test hooks (documented fields): `capability` (pretend sm), `allow_cpu` (skip the
    CUDA check), `kernel_dtypes` (dtypes passed to the kernel unchanged; fp64 in CPU tests with an emulated
    kernel), `available_override` ((ok, why) instead of probing)."""

    name = "fa2"

    def __init__(self):
        self.capability: tuple[int, int] | None = None
        self.allow_cpu = False
        self.kernel_dtypes = FA2_DTYPES
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
        return self.capability or device_capability(device)

    def takes_narrower_v(self) -> bool:
        """Whether attn takes v with a narrower head dim than q and k (else the caller zero-pads v to Dk)."""
        return False

    def attn(self, q, k, v, *, causal: bool, left: int, scale: float, varlen, need_lse: bool):
        """One FA-2 call. Dense q [B, Tq, H, D] or varlen q [total, H, D] with varlen = (cu_q, cu_k, max_q,
        max_k). causal: bottom-right causal; else left >= 0 is a window (w-1, 0) and left < 0 no mask at all
        (every query sees every key). Returns (out, lse or None)
        with lse dense [B, H, Tq] / varlen [H, total_q]."""
        raise NotImplementedError


__all__ = ["FA2_DTYPES", "Fa2Provider"]
