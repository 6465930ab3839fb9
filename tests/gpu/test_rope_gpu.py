"""The rotary embedding on CUDA: NSA's Triton kernel (nsa.kernels.triton.rope) against the torch formula,
outputs and gradients in bf16 and fp32, eager and under torch.compile (the nsa::rope operator, no graph break),
with telemetry showing the kernel served.

    pytest tests/gpu/test_rope_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch
from triton_sel_helpers import MARKS

from nsa import telemetry
from nsa.attention import rope, rope_torch

pytestmark = MARKS


def err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp(min=1e-12)).item()


def _freqs(D, theta=10000.0):
    half = D // 2
    return theta ** (-torch.arange(half, device="cuda", dtype=torch.float32) / half)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("B,T,H,D,per_row", [(2, 4099, 16, 128, False), (1, 8192, 4, 192, True), (3, 33, 2, 64, True)])
def test_rope_kernel_matches_torch(B, T, H, D, per_row, dtype, tol):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype).requires_grad_()
    pos = (torch.arange(T, device="cuda")[None] if not per_row else
           torch.stack([torch.arange(T, device="cuda") % (1000 + 7 * b) for b in range(B)]))
    telemetry.reset()
    got = rope(x, pos, 10000.0)
    assert telemetry.snapshot()["events"] == [{"branch": "rope", "backend": "triton", "event": "rotate", "calls": 1}]
    want = rope_torch(x, pos, _freqs(D))
    assert err(got, want) <= tol
    dy = torch.randn(want.shape, device="cuda", generator=g).to(dtype)
    (a,) = torch.autograd.grad(got, x, dy)
    (b,) = torch.autograd.grad(want, x, dy)
    assert err(a, b) <= tol


def test_rope_compiled_is_the_operator():
    import torch._dynamo

    torch._dynamo.reset()
    x = torch.randn(1, 1000, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(1000, device="cuda")[None]
    seen = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    fn = torch.compile(lambda x, p: rope(x, p, 10000.0), fullgraph=True, backend=backend)
    got, want = fn(x, pos), rope(x, pos, 10000.0)
    assert any(t.startswith("nsa.rope") for t in seen), seen
    assert err(got, want) == 0.0
    dy = torch.randn_like(want)
    assert err(torch.autograd.grad(got, x, dy)[0], torch.autograd.grad(want, x, dy)[0]) == 0.0
    torch._dynamo.reset()
