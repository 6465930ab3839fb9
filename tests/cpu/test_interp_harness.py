"""The interpreter tests' harness (tests/cpu/interp.py): the language is patched once per kernel launch, not
again at every jit helper call, and kernels with helpers still compute what they should."""

from __future__ import annotations

import pytest
import torch

from .interp import kernel_modules, skip_nested_repatching

kernel_modules("rope", probe="rope._rope_kernel")  # the interpreter on (or the module skipped, saying why)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as itp  # noqa: E402


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helpers_kernel(X, OUT, N: tl.constexpr, ROUNDS: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(X + r)
    for _ in tl.static_range(ROUNDS):
        x = _twice(x) - tl.max(x, 0)  # a helper of ours and one of triton's (tl.max) each round
    tl.store(OUT + r, x)
    tl.store(OUT + N, tl.sum(x, 0))


def test_helpers_run_without_repatching_the_language(monkeypatch):
    if not skip_nested_repatching():
        pytest.skip("this triton's interpreter is laid out differently: its own patching runs unchanged")
    calls = []
    real = itp._patch_lang
    monkeypatch.setattr(itp, "_patch_lang", lambda fn: calls.append(fn.__name__) or real(fn))
    x = torch.randn(16, generator=torch.Generator().manual_seed(0))
    out = torch.full((17,), float("nan"))
    rounds = 6
    _helpers_kernel[(1,)](x, out, N=16, ROUNDS=rounds)
    want = x.double()
    for _ in range(rounds):
        want = want * 2 - want.max()
    torch.testing.assert_close(out[:16].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[16].double(), want.sum(), rtol=1e-5, atol=1e-4)
    # the launch, then at most once each for the helpers that see a module the launch did not patch (tl.max's
    # and tl.sum's triton.language.core), not once per call (2 * rounds + 1 helper calls)
    assert calls[0] == "_helpers_kernel" and len(calls) <= 3, calls
