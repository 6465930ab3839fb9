"""NSA's Triton kernel modules loaded for Triton's CPU interpreter: the shared start of the *_interp tests.

Triton picks interpreter or compiler when a kernel is decorated, so TRITON_INTERPRET=1 has to be set
before a kernel module first loads in the process. A test module calls `kernel_modules` at import time;
it skips that whole module, saying why, when triton is not installed, a kernel module does not import, or
the modules were already loaded compiled (imported earlier in the process without the interpreter).

It also spares the interpreter a redundant step (`skip_nested_repatching`): Triton 3.7's interpreter patches
the whole `triton.language` namespace again at every call of a jit helper inside a kernel (thousands per
test), although the kernel's own launch has patched it already. Skipping that when the helper sees no
language module that is not patched yet changes nothing the kernels compute; nor does remembering the numpy
dtype of each Triton type. Together they take 42% off the interpreter tests' time (tests/README.md).

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
    skip_nested_repatching()
    return mods


def _lang_modules(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def skip_nested_repatching() -> bool:
    """Make the interpreter patch the language once per kernel launch, not again at every jit helper call
    (module doc). Returns whether it applies: only to the interpreter layout it was written for (a launch's
    GridExecutor.__call__ and a helper's InterpretedFunction.__call__ both calling _patch_lang); anything
    else is left as it is."""
    import inspect

    from triton.runtime import interpreter as itp

    grid, helper = getattr(itp, "GridExecutor", None), getattr(itp, "InterpretedFunction", None)
    if grid is None or helper is None or not hasattr(itp, "_patch_lang"):
        return False
    if getattr(helper.__call__, "_nsa_once", False):
        return True
    try:
        ok = all("_patch_lang(self.fn)" in inspect.getsource(f) for f in (grid.__call__, helper.__call__))
    except (OSError, TypeError):
        ok = False
    if not ok:
        return False
    active: list[frozenset[int]] = []  # the language modules each running launch has patched
    langs = functools.lru_cache(maxsize=None)(_lang_modules)
    launch, call = grid.__call__, helper.__call__

    def launch_once(self, *args, **kwargs):
        active.append(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            active.pop()

    def call_patched(self, *args, **kwargs):
        if not active:
            return call(self, *args, **kwargs)
        if not langs(self.fn) <= active[-1]:  # e.g. tl.sum, whose module sees triton.language.core
            try:
                return call(self, *args, **kwargs)
            finally:  # its patch is never undone (the interpreter's own way): patched for the rest of the launch
                active[-1] |= langs(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter's own call reports a helper's error
            raise itp.InterpreterError(repr(e)) from e

    launch_once._nsa_once = call_patched._nsa_once = True
    grid.__call__, helper.__call__ = launch_once, call_patched
    # the numpy dtype of a Triton type: a dict of 17 types built at each of its calls (tens of thousands a test)
    if callable(getattr(itp, "_get_np_dtype", None)):
        itp._get_np_dtype = _remembered(itp._get_np_dtype)
    return True


def _remembered(np_dtype):
    """np_dtype(triton type) remembered per element type (a block's dtype is its element's)."""
    import triton.language as tl

    known: dict = {}

    def cached(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return known[key]
        except KeyError:
            known[key] = np_dtype(key)
            return known[key]
        except TypeError:  # an unhashable type: as the interpreter would
            return np_dtype(tt_dtype)

    return cached


def _cuda_host() -> bool:
    """Whether torch sees a CUDA GPU (without initialising CUDA in this process)."""
    import torch

    return torch.cuda.is_available()


__all__ = ["kernel_modules"]
