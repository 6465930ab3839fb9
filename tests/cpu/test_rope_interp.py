"""The rotary-embedding kernel (nsa.kernels.triton.rope) in Triton's CPU interpreter: outputs and gradients
against the torch formula (nsa.attention.rope_torch) in fp64 and fp32, positions shared by the batch or per row
(packed documents restart at 0), a head dim whose half is not a power of two, T not a multiple of the token
tile, strided input; the `nsa::rope` operator's contract (schema, fake tensor, autograd)."""

from __future__ import annotations

import pytest
import torch

from .interp import kernel_modules

(rope_mod,) = kernel_modules("rope", probe="rope._rope_kernel")

from nsa.attention import _Rope, rope_torch  # noqa: E402
from nsa.kernels import ops  # noqa: E402

from .helpers import rel_err  # noqa: E402


def _freqs(D, theta=10000.0):
    half = D // 2
    return theta ** (-torch.arange(half, dtype=torch.float32) / half)


def _positions(B, T, per_row):
    if not per_row:
        return torch.arange(T)[None]
    return torch.stack([torch.arange(T) - (b * 7) % T for b in range(B)]).clamp(min=0)  # rows restart apart


@pytest.mark.parametrize("B,T,H,D,per_row", [(2, 37, 3, 8, False), (2, 37, 3, 8, True), (1, 16, 2, 96, False),
                                             (3, 5, 1, 64, True), (1, 0, 2, 16, False)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rope_kernel_matches_torch(gen, B, T, H, D, per_row, dtype):
    wide = torch.randn(B, T, H + 2, D, generator=gen, dtype=dtype)
    x = wide[:, :, 1:H + 1].requires_grad_()  # strided heads: the kernel reads x's strides
    pos, freqs = _positions(B, T, per_row), _freqs(D)
    want = rope_torch(x, pos, freqs)
    got = _Rope.apply(x, pos, freqs)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, want) <= 1e-6
    if T == 0:
        return
    dy = torch.randn(want.shape, generator=gen, dtype=dtype)
    (g_want,) = torch.autograd.grad(want, x, dy)
    (g_got,) = torch.autograd.grad(got, x, dy)
    assert rel_err(g_got, g_want) <= 1e-6


def test_rope_kernel_takes_a_strided_head_dim(gen):
    """A gradient may come with its head dim not contiguous: the launcher copies it first."""
    x = torch.randn(2, 9, 16, 3, generator=gen, dtype=torch.float64).transpose(2, 3)  # [2, 9, 3, 16], stride 3
    pos, freqs = _positions(2, 9, True), _freqs(16)
    assert x.stride(-1) != 1
    assert rel_err(rope_mod.rope_apply(x, pos, freqs), rope_torch(x, pos, freqs)) <= 1e-6


def test_rope_inverse_undoes_rope(gen):
    x = torch.randn(2, 20, 4, 32, generator=gen, dtype=torch.float64)
    pos, freqs = _positions(2, 20, True), _freqs(32)
    back = rope_mod.rope_apply(rope_mod.rope_apply(x, pos, freqs), pos, freqs, inverse=True)
    assert rel_err(back, x) <= 1e-6


@pytest.mark.sample
def test_rope_operator_contract(gen):
    x = torch.randn(2, 20, 3, 16, generator=gen, requires_grad=True)
    torch.library.opcheck(ops.rope, (x, _positions(2, 20, True), _freqs(16), False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
