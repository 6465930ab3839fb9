"""The compressed-branch kernels (nsa.kernels.triton.cmp_attn) on the GPU: o, LSE and gradients against an
fp64 oracle in bf16 and fp16 over edge shapes (rows that see no block, T not a multiple of a tile, Dk=192 /
Dv=128), and the dense core running them (telemetry) against the fp64 reference."""

from __future__ import annotations

import pytest
import torch
from triton_sel_helpers import MARKS

from nsa import NSAConfig, nsa_attention, telemetry

pytestmark = MARKS


def _needs_tma():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the compressed-branch kernels run with TMA copies (sm 9.0+); FA-2 / cuDNN serve it here")


def oracle(q, kc, vc, l, d, scale):
    """fp64 (o [B, T, Hq, Dv], lse [B, T, Hq]): each query over the blocks ending at or before it."""
    B, T, Hq, _ = q.shape
    G = Hq // kc.shape[2]
    kk, vv = kc.double().repeat_interleave(G, 2), vc.double().repeat_interleave(G, 2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), kk) * scale
    ends = torch.arange(kc.shape[1], device=q.device) * d + l - 1
    seen = ends[None, :] <= torch.arange(T, device=q.device)[:, None]
    any_ = seen.any(1)[:, None]
    p = torch.where(any_, torch.softmax(s.masked_fill(~seen, float("-inf")).masked_fill(~any_, 0.0), -1), 0.0)
    lse = torch.logsumexp(s.masked_fill(~seen, float("-inf")), -1)
    return torch.einsum("bhts,bshd->bthd", p, vv), lse.transpose(1, 2)


def _inputs(gen, B, T, Hkv, G, Dk, Dv, l, d, dtype):
    N = (T - l) // d + 1 if T >= l else 0
    q = torch.randn(B, T, Hkv * G, Dk, generator=gen).to("cuda", dtype)
    kc = torch.randn(B, N, Hkv, Dk, generator=gen).to("cuda", dtype)
    vc = torch.randn(B, N, Hkv, Dv, generator=gen).to("cuda", dtype)
    return q, kc, vc


# (T, G, Dk, Dv): no block at all, one tile, the staircase across tiles, 16 x 4k-like, wide heads
CASES = [(20, 16, 128, 128), (64, 16, 128, 128), (1000, 16, 128, 128), (4096, 16, 128, 128), (777, 4, 64, 64),
         (2000, 16, 192, 128), (1500, 2, 256, 256)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,G,Dk,Dv", CASES)
def test_cmp_forward_backward_vs_fp64(gen, T, G, Dk, Dv, dtype):
    _needs_tma()
    from nsa.kernels.triton.cmp_attn import cmp_backward, cmp_forward

    l, d, scale = 32, 16, Dk ** -0.5
    q, kc, vc = _inputs(gen, 2, T, 2, G, Dk, Dv, l, d, dtype)
    do = torch.randn(2, T, 2 * G, Dv, generator=gen).to("cuda", dtype)
    o, lse = cmp_forward(q, kc, vc, l, d, scale)
    leaves = [x.double().requires_grad_() for x in (q, kc, vc)]
    want_o, want_lse = oracle(*leaves, l, d, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert torch.isfinite(o).all() and (o.double() - want_o).abs().max() < tol
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty)
    if (~empty).any():
        assert (lse.double() - want_lse)[~empty].abs().max() < 1e-3
    got = cmp_backward(do, q, kc, vc, o, lse, l, d, scale)
    if kc.shape[1] == 0:
        assert all((g == 0).all() for g in got)
        return
    want = torch.autograd.grad(want_o, leaves, do.double())
    for name, a, b in zip(("q", "k_cmp", "v_cmp"), got, want):
        assert torch.isfinite(a).all(), name
        assert ((a.double() - b).abs().max() / b.abs().max().clamp(min=1.0)) < 3e-2, name


def _err(got, want):
    """max |got - want| / max(1, max |want|)."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


@pytest.mark.parametrize("T,Dk,Dv,dtype", [(3000, 128, 128, torch.bfloat16), (1111, 192, 128, torch.bfloat16),
                                           (2048, 128, 128, torch.float16)])
def test_dense_core_runs_the_cmp_kernels(gen, monkeypatch, T, Dk, Dv, dtype):
    """With NSA_TRITON_CMP_MAX_LEN >= T the dense core's compressed branch runs these kernels (their event, no
    fallback); output and gradients match fp64 with the core's blocks."""
    _needs_tma()
    monkeypatch.setenv("NSA_TRITON_CMP_MAX_LEN", str(T))
    cfg = NSAConfig()
    shapes = [(1, T, 16, Dk), (1, T, 2, Dk), (1, T, 2, Dv), (1, T, 16, 3)]
    xs = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    xs[3] = xs[3].sigmoid()
    xs = [x.to("cuda", dtype).requires_grad_() for x in xs]
    telemetry.reset()
    out, idx = nsa_attention(*xs, cfg, return_indices=True)
    events = {e["event"]: e["calls"] for e in telemetry.snapshot()["events"]}
    assert events.get("cmp_forward") == 1 and events.get("dense_core") == 1, events
    assert telemetry.served("cmp") == {"triton_cmp": 1} and telemetry.snapshot()["fallbacks"] == 0
    hi = [x.detach().double().requires_grad_() for x in xs]
    want = nsa_attention(*hi, cfg, block_indices=idx, backend="torch")
    assert torch.isfinite(out).all() and _err(out, want) < (3e-2 if dtype == torch.bfloat16 else 5e-3)
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to("cuda")
    got = torch.autograd.grad(out, xs, go.to(dtype))
    ref = torch.autograd.grad(want, hi, go)
    for name, a, b in zip(("q", "k", "v", "gates"), got, ref):
        assert torch.isfinite(a).all() and _err(a, b) < (5e-2 if dtype == torch.bfloat16 else 1e-2), (name, _err(a, b))
