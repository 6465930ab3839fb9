"""Triton selection kernel backward on a GPU: dq/dk/dv vs fp64 autograd of the torch selected branch,
bf16/fp16/fp32, paper shapes, varlen; and nsa_attention(backend="auto") gradients with sel on the kernel
vs the fp64 torch backend with the same (reference) indices.

Run: python3 -m pytest -m gpu tests/gpu/test_triton_sel_backward_gpu.py (skipped without CUDA / triton).
"""

from __future__ import annotations

import pytest
import torch
from triton_sel_helpers import MARKS, PAPER, SMALL, err, topn_indices

pytestmark = MARKS

from nsa import nsa_attention, nsa_reference, telemetry  # noqa: E402

# max |got - want| / max(1, max |want|); gradients of bf16 sums over many selecting queries are looser
TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}


def leaf(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_()


def grads_kernel_vs_fp64(gen, q, k, v, idx, ss, cfg, chunk=256):
    from triton_sel_helpers import selected_attention_torch

    from nsa.kernels.triton.selection import selected_attention_triton

    out = selected_attention_triton(q, k, v, idx, ss, cfg)
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to("cuda")
    got = torch.autograd.grad(out, (q, k, v), go.to(out.dtype))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = selected_attention_torch(qd, kd, vd, idx, ss, cfg, chunk=chunk)
    want = torch.autograd.grad(ref, (qd, kd, vd), go)
    return got, want


@pytest.mark.big_gpu_memory
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("Hq,Hkv,Dk,Dv", [(64, 4, 128, 128), (64, 4, 192, 128)])
def test_kernel_grads_paper_shapes(gen, dtype, Hq, Hkv, Dk, Dv):
    B, T = 1, 1024
    q, k, v = leaf(gen, B, T, Hq, Dk, dtype=dtype), leaf(gen, B, T, Hkv, Dk, dtype=dtype), leaf(gen, B, T, Hkv, Dv,
                                                                                                  dtype=dtype)
    ss = torch.zeros(B, T, dtype=torch.long, device="cuda")
    got, want = grads_kernel_vs_fp64(gen, q, k, v, topn_indices(gen, ss, Hkv, PAPER), ss, PAPER)
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert err(a, b) < TOL[dtype], (name, err(a, b))


@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_kernel_grads_group_sizes_varlen(gen, G):
    import itertools

    lengths = [0, 65, 1, 300, 0, 129]
    cu = [0, *itertools.accumulate(lengths)]
    T, Hkv, dtype = cu[-1], 2, torch.bfloat16
    ss = torch.zeros(1, T, dtype=torch.long)
    for a, b in zip(cu, cu[1:]):
        ss[0, a:b] = a
    ss = ss.cuda()
    q, k, v = leaf(gen, 1, T, Hkv * G, 128, dtype=dtype), leaf(gen, 1, T, Hkv, 128, dtype=dtype), leaf(
        gen, 1, T, Hkv, 64, dtype=dtype)
    idx = topn_indices(gen, ss, Hkv, SMALL)
    idx[0, 3] = -1
    got, want = grads_kernel_vs_fp64(gen, q, k, v, idx, ss, SMALL)
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), name
        assert err(a, b) < TOL[dtype], (name, err(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_auto_grads_vs_torch_fp64(gen, dtype, packed):
    """nsa_attention (auto, sel on the kernel) vs the torch backend in fp64, same reference indices."""
    Hq, Hkv, D = 16, 2, 128
    if packed:
        cu = torch.tensor([0, 200, 200, 457], dtype=torch.int32, device="cuda")
        B, T = 1, 457
    else:
        cu, B, T = None, 2, 300
    q, k, v = leaf(gen, B, T, Hq, D, dtype=dtype), leaf(gen, B, T, Hkv, D, dtype=dtype), leaf(gen, B, T, Hkv, D,
                                                                                                dtype=dtype)
    g = torch.rand(B, T, Hq, 3, generator=gen).to("cuda", dtype).requires_grad_()
    idx = nsa_reference(*(x.detach().cpu().double() for x in (q, k, v, g)), SMALL,
                        cu_seqlens=None if cu is None else cu.cpu()).indices.cuda()
    telemetry.reset()
    out = nsa_attention(q, k, v, g, SMALL, cu_seqlens=cu, block_indices=idx)
    assert set(telemetry.served("sel")) == {"triton"}, telemetry.snapshot()["counts"]
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to("cuda")
    got = torch.autograd.grad(out, (q, k, v, g), go.to(dtype))
    xd = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
    ref = nsa_attention(*xd, SMALL, cu_seqlens=cu, block_indices=idx, backend="torch")
    want = torch.autograd.grad(ref, xd, go)
    for name, a, b in zip(("q", "k", "v", "gates"), got, want):
        assert torch.isfinite(a).all(), name
        assert err(a, b) < TOL[dtype], (name, err(a, b))


def test_grad_toggle_keeps_torch(gen, sel_env):
    sel_env.setenv("NSA_SEL_TRITON_ALLOW_GRAD", "0")
    q, k, v = leaf(gen, 1, 128, 8, 64, dtype=torch.bfloat16), leaf(gen, 1, 128, 2, 64, dtype=torch.bfloat16), leaf(
        gen, 1, 128, 2, 64, dtype=torch.bfloat16)
    g = torch.rand(1, 128, 8, 3, generator=gen).to("cuda", torch.bfloat16)
    nsa_attention(q, k, v, g, SMALL)
    counts = {(r["branch"], r["backend"], r["reason"]) for r in telemetry.snapshot()["counts"]}
    assert ("sel", "torch", "grad") in counts
    telemetry.reset()
    with torch.no_grad():
        nsa_attention(q, k, v, g, SMALL)
    assert set(telemetry.served("sel")) == {"triton"}
