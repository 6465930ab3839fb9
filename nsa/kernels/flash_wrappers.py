"""Probes for the FlashAttention-2 implementations NSA can call, and why one cannot run here.

    is_flash_available()               a FlashAttention-2 dense kernel can serve here: flash-attn's
                                       flash_attn_func, else PyTorch's built-in FA-2 (the torch_flash backend)
    is_flash_varlen_available()        the same for the varlen (packed) kernels
    flash_provider(varlen=False)       which one serves: "flash_attn", "torch_flash" or None
    flash_status(varlen=False)         (ok, reason): the kernel that serves, or why neither can
    is_torch_flash_varlen_available()  PyTorch's built-in FA-2 varlen (torch.nn.attention.varlen.varlen_attn)

is_flash_available()/is_flash_varlen_available() answer "can an FA-2 kernel run the compressed and sliding
branches here", whichever package provides it (flash-attn is preferred when both can): torch's built-in
kernel serves both branches on a GPU host without flash-attn. flash_attn_status() asks about the flash-attn
package alone. The probes do not read the NSA_USE_FA2* toggles: they say what could run, not what will.

"Can run here" means: the package imports, exposes the entry point, torch sees a CUDA GPU, and the GPU
is sm >= 8.0 (FlashAttention-2 has no kernels for older GPUs). Each probe has a *_status() twin that
returns (ok, reason) for reports (`python -m nsa_env`). The import attempt is made once and cached:
a failing flash_attn import (e.g. "undefined symbol" from a wheel built for another torch) is recorded
with its message, never raised. reset_probes() forgets the cache (tests).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

FA2_MIN_SM = (8, 0)


@cache
def _import(name: str) -> tuple[Any, str]:
    """(module, "") or (None, why). Import errors of compiled extensions are ImportError or OSError."""
    try:
        return importlib.import_module(name), ""
    except ModuleNotFoundError as e:
        if e.name == name.split(".")[0]:
            return None, f"{e.name} is not installed"
        return None, f"import {name} failed: {e}"
    except (ImportError, OSError, RuntimeError) as e:
        return None, f"import {name} failed: {e}"


@cache
def cuda_device_status() -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU of sm >= 8.0 (device 0), and why not."""
    torch, why = _import("torch")
    if torch is None:
        return False, why
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a CPU build"
        return False, "torch sees no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < FA2_MIN_SM:
        name = torch.cuda.get_device_name(0)
        return False, f"{name} is sm {major}.{minor}; FlashAttention-2 needs sm >= 8.0"
    return True, ""


def flash_attn_status(varlen: bool = False) -> tuple[bool, str]:
    """flash-attn's dense (or varlen) kernel: (can run here, reason)."""
    mod, why = _import("flash_attn")
    if mod is None:
        return False, why
    entry = "flash_attn_varlen_func" if varlen else "flash_attn_func"
    if not hasattr(mod, entry):
        version = getattr(mod, "__version__", "?")
        return False, f"flash_attn {version} has no {entry}"
    ok, why = cuda_device_status()
    if not ok:
        return False, why
    return True, f"flash_attn {getattr(mod, '__version__', '?')} {entry}"


def _torch_flash_kernels_status(torch, entry: str) -> tuple[bool, str]:
    """A CUDA GPU is usable and this torch was built with its FlashAttention kernels."""
    version = getattr(torch, "__version__", "?")
    ok, why = cuda_device_status()
    if not ok:
        return False, why
    built = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if built is not None and not built():
        return False, f"torch {version} was built without its FlashAttention kernels"
    return True, f"torch {version} {entry}"


def torch_flash_varlen_status() -> tuple[bool, str]:
    """PyTorch's built-in FA-2 varlen kernel (torch >= 2.10): (can run here, reason)."""
    mod, why = _import("torch.nn.attention.varlen")
    torch, _ = _import("torch")
    if mod is None or not hasattr(mod, "varlen_attn"):
        return False, f"torch {getattr(torch, '__version__', '?')} has no torch.nn.attention.varlen.varlen_attn"
    return _torch_flash_kernels_status(torch, "varlen_attn")


def torch_flash_status() -> tuple[bool, str]:
    """The entry point the `torch_flash` backend calls, aten._flash_attention_forward: (can run here, reason)."""
    torch, why = _import("torch")
    if torch is None:
        return False, why
    try:
        torch.ops.aten._flash_attention_forward  # noqa: B018 - resolving the op is the probe
    except (AttributeError, RuntimeError) as e:
        return False, f"torch {torch.__version__} has no aten._flash_attention_forward ({e})"
    return _torch_flash_kernels_status(torch, "aten._flash_attention_forward")


FLASH_PROVIDERS = ("flash_attn", "torch_flash")


def _flash_choice(varlen: bool) -> tuple[str | None, str]:
    """(provider, reason): flash-attn first, then torch's built-in kernel.

    torch's aten._flash_attention_forward takes dense and varlen input alike, so it answers both questions.
    """
    fa_ok, fa_why = flash_attn_status(varlen=varlen)
    if fa_ok:
        return "flash_attn", fa_why
    tf_ok, tf_why = torch_flash_status()
    if tf_ok:
        return "torch_flash", tf_why
    return None, f"flash_attn: {fa_why}; torch_flash: {tf_why}"


def flash_status(varlen: bool = False) -> tuple[bool, str]:
    """An FA-2 kernel (flash-attn's or torch's built-in) can serve here: (ok, the kernel or why neither)."""
    provider, why = _flash_choice(varlen)
    return provider is not None, why


def flash_provider(varlen: bool = False) -> str | None:
    """Which FA-2 implementation serves here: "flash_attn", "torch_flash" or None."""
    return _flash_choice(varlen)[0]


def is_flash_available() -> bool:
    """A FlashAttention-2 dense kernel (flash-attn's or torch's built-in) can run here."""
    return flash_status(varlen=False)[0]


def is_flash_varlen_available() -> bool:
    """A FlashAttention-2 varlen kernel (flash-attn's or torch's built-in) can run here."""
    return flash_status(varlen=True)[0]


def is_torch_flash_varlen_available() -> bool:
    return torch_flash_varlen_status()[0]


def reset_probes() -> None:
    _import.cache_clear()
    cuda_device_status.cache_clear()
