"""The providers planning chooses between, registered in one place: for each, whether it can run here
(availability: the library imports, a CUDA device, or Triton's interpreter when forced on CPU) and the
first guard a call fails (guard -> a Failure with its reason code; the rules are in nsa.plan.rules).

    PROVIDERS   compressed and sliding branches: flash_attn, torch_flash (FA-2 kernels), sdpa
    ORDER       the order backend="auto" tries them in
    CUDNN       torch_cudnn, tried first for the dense compressed branch where it applies
    TRITON      NSA's Triton kernels: sel, topn, combine (prefill) and decode

Test hooks (documented fields of the provider objects): `capability` (pretend a sm), `allow_cpu` (skip the
CUDA requirement); FA-2 providers also `kernel_dtypes` and `available_override`. Swapping a whole provider
goes through nsa.hooks.HOOKS (`providers`, `cudnn`).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ..compiling import compiling, trace_constant
from ..hooks import HOOKS
from ..kernels.device import Failure, device_capability
from ..kernels.fa2.base import Fa2Provider
from ..kernels.fa2.flash_attn import FlashAttnProvider
from ..kernels.fa2.torch_cudnn import TorchCudnnProvider
from ..kernels.fa2.torch_flash import TorchFlashProvider
from ..toggles import Toggles, triton_interpret
from . import rules


class SdpaProvider:
    """torch.nn.functional.scaled_dot_product_attention (nsa.branches.*.sdpa): any float dtype, any head
    dim, dense or packed; used by "auto" on CUDA only (on CPU the torch path serves the same math),
    backend="sdpa" forces it anywhere. Test hook: `available_override`."""

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
        return None


def available(prov, device, forced: bool) -> tuple[bool, str]:
    """(ok, why not) of prov.availability(device, forced): whether the provider can run here at all. Under
    torch.compile the probe runs once, when the caller is traced, on the provider found by its name: Dynamo
    passes only constants into such a call (torch 2.11 refuses a provider object there)."""
    if compiling():
        return _available_by_name(prov.name, device, forced)
    return prov.availability(device, forced)


@trace_constant  # probes imports and the device: under torch.compile, once when the caller is traced
def _available_by_name(name: str, device, forced: bool) -> tuple[bool, str]:
    for prov in (*providers().values(), cudnn(), *TRITON.values()):
        if prov.name == name:
            return prov.availability(device, forced)
    raise KeyError(f"no provider named {name!r}")


def guard(prov, branch: str, ctx, toggles: Toggles, forced: bool) -> Failure | None:
    """The first failed guard of a cmp / win provider (PROVIDERS, CUDNN) for this call, or None."""
    if isinstance(prov, Fa2Provider):
        return rules.fa2_guard(prov, branch, ctx, toggles, forced)
    return prov.guard(branch, ctx, toggles, forced)


_TRITON_MODULES = {"sel": "selection", "topn": "selection", "combine": "selection", "decode": "decode"}
_TRITON_NAMES = {"sel": "triton_sel", "topn": "triton_topn", "combine": "triton_combine", "decode": "triton_decode"}


class TritonProvider:
    """One of NSA's Triton kernels: "sel", "topn", "combine" or "decode". Availability: triton imports and
    the tensors are on CUDA (or, forced, on CPU under TRITON_INTERPRET=1, Triton's interpreter)."""

    def __init__(self, kind: str):
        if kind not in _TRITON_NAMES:
            raise ValueError(f"unknown Triton kernel kind {kind!r}")
        self.kind = kind
        self.name = _TRITON_NAMES[kind]
        self.capability: tuple[int, int] | None = None
        self.allow_cpu = False

    def _imports(self) -> tuple[bool, str]:
        mod = _TRITON_MODULES[self.kind]
        try:
            importlib.import_module(f"..kernels.triton.{mod}", __package__)
        except Exception as e:  # noqa: BLE001 - any import failure means "not available", with the reason
            return False, f"nsa.kernels.triton.{mod} does not import: {type(e).__name__}: {e}"
        return True, "ok"

    def availability(self, device, forced: bool) -> tuple[bool, str]:
        ok, why = self._imports()
        if not ok:
            return False, why
        if device.type == "cuda" or self.allow_cpu:
            return True, "ok"
        if forced and triton_interpret():
            return True, "Triton interpreter on CPU (TRITON_INTERPRET=1)"
        what = "decode kernels run" if self.kind == "decode" else f"{self.kind} kernel runs"
        return False, f"the Triton {what} on CUDA tensors, got {device}" + (
            " (forcing " + ("them" if self.kind == "decode" else "it") + " on CPU needs TRITON_INTERPRET=1)"
            if forced else "")

    def cap(self, device):
        """The pretended capability (tests), else the device's (None off CUDA)."""
        if self.capability is not None:
            return self.capability
        return device_capability(device) if device.type == "cuda" else None

    def guard(self, ctx, tg, forced: bool, cfg=None) -> Failure | None:
        return rules.triton_guard(self.kind, self.cap(ctx.device), ctx, tg, forced, cfg=cfg)

    def decode_guard(self, q, cache, needs_grad: bool) -> Failure | None:
        return rules.decode_guard(self.cap(q.device), q, cache, needs_grad)


ORDER = ("flash_attn", "torch_flash", "sdpa")
PROVIDERS = {"flash_attn": FlashAttnProvider(), "torch_flash": TorchFlashProvider(), "sdpa": SdpaProvider()}
CUDNN = TorchCudnnProvider()  # tried first where it applies (dense compressed branch on sm90), auto only
TRITON = {kind: TritonProvider(kind) for kind in ("sel", "topn", "combine", "decode")}


def providers() -> dict:
    """The compressed / sliding branch providers in use: PROVIDERS, or the test hook's."""
    return HOOKS.providers if HOOKS.providers is not None else PROVIDERS


def cudnn():
    """The torch_cudnn provider in use: CUDNN, or the test hook's."""
    return HOOKS.cudnn if HOOKS.cudnn is not None else CUDNN


__all__ = ["CUDNN", "available", "ORDER", "PROVIDERS", "SdpaProvider", "TRITON", "TritonProvider", "cudnn", "guard",
           "providers"]
