"""The sliding-window kernels (nsa.kernels.triton.window) on the GPU: o, LSE and gradients against an fp64
oracle in bf16 and fp16 over edge shapes, and the dense core running them (telemetry) with outputs equal
with and without autograd."""

from __future__ import annotations

import pytest
import torch
from triton_sel_helpers import MARKS

from nsa import NSAConfig, nsa_attention, telemetry

pytestmark = MARKS


def _needs_tma():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the window kernel runs with TMA copies (sm 9.0+); FA-2 serves the window here")


def oracle(q, k, v, w, scale):
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    kk, vv = k.double().repeat_interleave(G, 2), v.double().repeat_interleave(G, 2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), kk) * scale
    back = torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)[None, :]
    s = s.masked_fill(~((back >= 0) & (back < w)), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), vv), torch.logsumexp(s, -1)


CASES = [(1, 512, 16, 128), (63, 512, 16, 128), (64, 16, 1, 128), (65, 1, 2, 64), (1000, 512, 8, 64),
         (1000, 100, 4, 256), (4097, 512, 16, 128), (300, 4000, 32, 128), (777, 64, 2, 256)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,w,G,D", CASES)
def test_window_forward_vs_fp64(gen, T, w, G, D, dtype):
    _needs_tma()
    from nsa.kernels.triton.window import window_forward

    Hkv, B = 2, 2
    q = torch.randn(B, T, Hkv * G, D, generator=gen).to("cuda", dtype)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen).to("cuda", dtype) for _ in range(2))
    o, lse = window_forward(q, k, v, w, D ** -0.5)
    want_o, want_lse = oracle(q, k, v, w, D ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert torch.isfinite(o).all() and (o.double() - want_o).abs().max() < tol
    assert (lse.double() - want_lse).abs().max() < 1e-3


# w = 66 with 64-token tiles: the last query that sees a key tile starts a query tile of its own.
BWD_CASES = [(1, 512, 16, 128), (65, 1, 2, 64), (2000, 512, 16, 128), (1000, 66, 2, 128), (333, 1000, 4, 128),
             (777, 64, 2, 256), (4097, 512, 8, 64)]


@pytest.mark.parametrize("T,w,G,D", BWD_CASES)
def test_window_backward_vs_fp64(gen, T, w, G, D):
    """dq, dk, dv from the kernel's o and LSE against autograd through the fp64 oracle (bf16)."""
    _needs_tma()
    from nsa.kernels.triton.window import window_backward, window_forward

    Hkv = 2
    q = torch.randn(1, T, Hkv * G, D, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, T, Hkv, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    do = torch.randn(1, T, Hkv * G, D, generator=gen).to("cuda", torch.bfloat16)
    o, lse = window_forward(q, k, v, w, D ** -0.5)
    got = window_backward(do, q, k, v, o, lse, w, D ** -0.5)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(oracle(*leaves, w, D ** -0.5)[0], leaves, do.double())
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), name
        assert ((a.double() - b).abs().max() / b.abs().max().clamp(min=1.0)) < 3e-2, name


def test_dense_core_runs_the_window_kernel(gen):
    """The dense core runs the window kernel (its event, no fallback); the output is the same with and
    without autograd (the selection kernel then writes only the combined output)."""
    _needs_tma()
    cfg = NSAConfig()
    q, k, v = (torch.randn(1, 3000, h, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
               for h in (16, 2, 2))
    g = torch.rand(1, 3000, 16, 3, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    telemetry.reset()
    out = nsa_attention(q, k, v, g, cfg)
    events = {e["event"]: e["calls"] for e in telemetry.snapshot()["events"]}
    assert events.get("window_forward") == 1 and events.get("dense_core") == 1, events
    assert telemetry.served("win") == {"triton_window": 1} and telemetry.served("core") == {"dense_core": 1}
    assert telemetry.snapshot()["fallbacks"] == 0
    with torch.no_grad():
        assert torch.equal(nsa_attention(q, k, v, g, cfg), out.detach())

