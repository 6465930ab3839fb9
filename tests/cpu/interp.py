"""NSA's Triton kernel modules loaded for Triton's CPU interpreter: the shared start of the *_interp tests.

Triton picks interpreter or compiler when a kernel is decorated, so TRITON_INTERPRET=1 has to be set
before a kernel module first loads in the process. A test module calls `kernel_modules` at import time;
it skips that whole module, saying why, when triton is not installed, a kernel module does not import, or
the modules were already loaded compiled (imported earlier in the process without the interpreter).

On a machine with a CUDA GPU it never switches the interpreter on by itself: the switch is process-wide, so a
GPU test collected in the same run (`pytest -k ...` from the root) would then run its kernels interpreted on
CUDA tensors and fail. There these modules run only when TRITON_INTERPRET=1 is set for the whole run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import pytest


def kernel_modules(*names: str, probe: str):
    """The modules nsa.kernels.triton.<name> for each name, in order. probe: a kernel that must run in the
    interpreter, as a dotted path from the first module's package ("topn._topn_kernel")."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the CPU lock pins triton 3.7.1)", allow_module_level=True)
    if not all(f"nsa.kernels.triton.{n}" in sys.modules for n in names) and os.environ.get("TRITON_INTERPRET") != "1":
        if _cuda_host():
            pytest.skip("a CUDA GPU is present, so the kernels compile for it in this run; the interpreter tests "
                        "run with TRITON_INTERPRET=1 set for the whole run (nox -s tests sets it)",
                        allow_module_level=True)
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = tuple(importlib.import_module(f"nsa.kernels.triton.{n}") for n in names)
    except Exception as e:  # noqa: BLE001 - any import failure skips the module with its reason
        pytest.skip(f"the Triton kernels do not import: {e}", allow_module_level=True)
    first, *attrs = probe.split(".")
    kernel = functools.reduce(getattr, attrs, importlib.import_module(f"nsa.kernels.triton.{first}"))
    if "Interpreted" not in type(kernel).__name__:
        pytest.skip("the kernel modules were loaded without TRITON_INTERPRET=1 in this process",
                    allow_module_level=True)
    return mods


def _cuda_host() -> bool:
    """Whether torch sees a CUDA GPU (without initialising CUDA in this process)."""
    import torch

    return torch.cuda.is_available()


__all__ = ["kernel_modules"]
