"""Causality: perturbing tokens after t (q, k, v and gates) never changes outputs at positions <= t, nor
the gradients of the inputs at positions <= t of a loss on outputs <= t (and those gradients are exactly
zero at positions > t).
"""

from __future__ import annotations

import pytest
import torch

from nsa import nsa_attention, nsa_reference

from .helpers import PAPER, SMALL, make_inputs

CASES = [
    # (config, T, t, Hq, Hkv): t on and off block boundaries (compressed block completion, selection block end)
    (SMALL["l8d4s8n4"], 60, 0, 4, 2),
    (SMALL["l8d4s8n4"], 60, 7, 4, 2),  # first compressed block completes at t = l - 1
    (SMALL["l8d4s8n4"], 60, 23, 2, 1),
    (SMALL["l8d4s8n4"], 60, 30, 2, 1),
    (SMALL["l8d4s16n4i0"], 70, 47, 4, 1),
    (SMALL["l8d4s8n4i2l0"], 64, 40, 2, 2),
    (SMALL["l16d4s8n5i1l1"], 70, 33, 4, 2),
    (PAPER, 200, 95, 4, 1),
    (PAPER, 200, 127, 2, 2),
]


def _perturb_after(t, *xs, gen):
    """Copies of xs with every position > t replaced by large, unrelated values (gates stay in [0, 1])."""
    out = []
    for x in xs:
        y = x.detach().clone()
        noise = torch.randn(y[:, t + 1:].shape, generator=gen, dtype=torch.float64).to(y.dtype)
        y[:, t + 1:] = noise.sigmoid() if x.shape[-1] == 3 else noise * 50
        out.append(y)
    return out


@pytest.fixture
def deterministic():
    """Bitwise-reproducible kernels for the gradient comparisons.

    With more than one thread, PyTorch's CPU float32 `index_put_(accumulate=True)` (the backward of the
    gathers) adds with parallel atomics: two runs on the SAME inputs may differ in the last bit. Equality
    of the past gradients must then be asked of the deterministic kernels, or the test measures the
    thread count instead of causality (the math is the same either way).
    """
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _ids(case):
    return f"l{case[0].block_cmp}s{case[0].block_sel}-T{case[1]}-t{case[2]}-Hq{case[3]}-Hkv{case[4]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_outputs_do_not_see_the_future(gen, case):
    cfg, T, t, Hq, Hkv = case
    x = make_inputs(gen, 2, T, Hq, Hkv, 8, 4)
    y = _perturb_after(t, *x, gen=gen)
    for chunk in (None, 5):
        o1, i1 = nsa_attention(*x, cfg, backend="torch", return_indices=True, chunk_size=chunk)
        o2, i2 = nsa_attention(*y, cfg, backend="torch", return_indices=True, chunk_size=chunk)
        assert torch.equal(o1[:, : t + 1], o2[:, : t + 1])
        assert torch.equal(i1[:, : t + 1], i2[:, : t + 1])
        assert not torch.equal(o1[:, t + 1:], o2[:, t + 1:])  # the perturbation is visible later on
    r1, r2 = nsa_reference(*x, cfg), nsa_reference(*y, cfg)
    for a, b in zip(r1, r2):
        assert torch.equal(a[:, : t + 1], b[:, : t + 1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES[1:3] + CASES[6:8], ids=_ids)
def test_gradients_do_not_see_the_future(gen, case, dtype, deterministic):
    cfg, T, t, Hq, Hkv = case
    x = make_inputs(gen, 1, T, Hq, Hkv, 8, 4, dtype=dtype)
    y = _perturb_after(t, *x, gen=gen)
    w = torch.randn(1, t + 1, Hq, 4, generator=gen, dtype=torch.float64).to(dtype)

    def grads(inputs, chunk):
        inputs = [z.detach().clone().requires_grad_() for z in inputs]
        out = nsa_attention(*inputs, cfg, backend="torch", chunk_size=chunk)
        (out[:, : t + 1] * w).sum().backward()
        return [z.grad for z in inputs]

    for chunk in (None, 6):
        gx, gy = grads(x, chunk), grads(y, chunk)
        for name, a, b in zip("qkvg", gx, gy):
            assert torch.isfinite(a).all(), name
            assert torch.equal(a[:, : t + 1], b[:, : t + 1]), name
            assert (a[:, t + 1:] == 0).all() and (b[:, t + 1:] == 0).all(), name
        assert (gx[0][:, : t + 1] != 0).any()  # the loss does depend on the past


def test_varlen_sequences_do_not_see_each_other(gen, deterministic):
    """Packed sequences: changing one sequence leaves every other sequence's outputs and gradients alone."""
    cfg = SMALL["l8d4s8n4"]
    cu = torch.tensor([0, 17, 17, 60, 90], dtype=torch.int32)
    x = make_inputs(gen, 1, 90, 4, 2, 8, 4)
    y = [z.clone() for z in x]
    for z in y:
        noise = torch.randn(z[:, 17:60].shape, generator=gen, dtype=torch.float64)
        z[:, 17:60] = noise.sigmoid() if z.shape[-1] == 3 else noise * 50

    def run(inputs):
        inputs = [z.detach().clone().requires_grad_() for z in inputs]
        out = nsa_attention(*inputs, cfg, backend="torch", cu_seqlens=cu, chunk_size=11)
        keep = torch.ones(90, dtype=torch.bool)
        keep[17:60] = False
        out[:, keep].sum().backward()
        return out.detach(), [z.grad for z in inputs]

    (o1, g1), (o2, g2) = run(x), run(y)
    other = torch.cat([torch.arange(17), torch.arange(60, 90)])
    assert torch.equal(o1[:, other], o2[:, other])
    for a, b in zip(g1, g2):
        assert torch.equal(a[:, other], b[:, other])
        assert (a[:, 17:60] == 0).all()
