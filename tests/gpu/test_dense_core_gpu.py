"""The fused pipeline's one-autograd-node form (nsa.run.dense_core) on the GPU for the inputs it takes
beyond dense D=128: packed input (cu_seqlens) with empty and length-1 sequences, Dk != Dv (192/128,
128/64), fp16, and packed sequences of one length (the dense batch they are, bit for bit).

Every test asserts from telemetry that the core ran (its "dense_core" event), which form its compressed
branch took ("fold_view": rows by view; "fold_copy": the provider's own call) and that nothing fell back.
Outputs are compared with the fp64 reference run with the core's own blocks (top-n is discontinuous),
gradients of q, k, v and gates with the fp64 torch backend on the same blocks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_sel_helpers import MARKS

from nsa import NSAConfig, nsa_attention, nsa_reference, telemetry

pytestmark = MARKS

PAPER = NSAConfig()
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRAD_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def core_env(sel_env):
    sel_env.setenv("NSA_FA2_MIN_LEN_WIN", "1")
    sel_env.setenv("NSA_FA2_MIN_LEN_CMP", "1")
    for var in ("NSA_DENSE_CORE", "NSA_FA2_FORCE_VARLEN", "NSA_FA2_PREF_FP16"):
        sel_env.delenv(var, raising=False)
    yield sel_env


def err(got, want):
    """max |got - want| / max(1, max |want|)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item() if want.numel() else 0.0


def make(gen, B, T, Hq, Hkv, Dk, Dv, dtype):
    shapes = [(B, T, Hq, Dk), (B, T, Hkv, Dk), (B, T, Hkv, Dv)]
    xs = [torch.randn(*s, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_() for s in shapes]
    g = torch.rand(B, T, Hq, 3, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_()
    return [*xs, g]


def offsets(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def core_ran(fold: str):
    """The core served the call, its compressed branch in form `fold`, the rest fused, no fallback."""
    snap = telemetry.snapshot()
    events = {(e["branch"], e["event"]): e["calls"] for e in snap["events"]}
    assert events.get(("pipeline", "dense_core")) == 1, snap["events"]
    folds = {ev: n for (b, ev), n in events.items() if b == "cmp" and ev.startswith("fold_")}
    assert folds == {fold: 1}, snap["events"]
    for s in ("sel", "combine"):
        assert set(telemetry.served(s)) == {"triton"}, snap["counts"]
    assert snap["fallbacks"] == 0, snap["counts"]


def check(gen, xs, cfg, cu, fold, oracle_on_gpu=False):
    """The core's output and gradients against fp64 with the core's blocks; returns the blocks."""
    dtype = xs[0].dtype
    telemetry.reset()
    out, idx = nsa_attention(*xs, cfg, cu_seqlens=cu, return_indices=True)
    core_ran(fold)
    hi = [x.detach().double().requires_grad_() for x in xs]
    if oracle_on_gpu:
        want = nsa_attention(*hi, cfg, cu_seqlens=cu, block_indices=idx, backend="torch")
    else:
        want = nsa_reference(*[x.detach().cpu() for x in hi], cfg, cu_seqlens=None if cu is None else cu.cpu(),
                             block_indices=idx.cpu()).out
    assert torch.isfinite(out).all() and err(out, want) < TOL[dtype]
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to("cuda")
    got = torch.autograd.grad(out, xs, go.to(dtype))
    ref = torch.autograd.grad(nsa_attention(*hi, cfg, cu_seqlens=cu, block_indices=idx, backend="torch"), hi, go)
    for name, a, b in zip(("q", "k", "v", "gates"), got, ref):
        assert torch.isfinite(a).all(), name
        assert err(a, b) < GRAD_TOL[dtype], (name, err(a, b))
    return idx


PACKED = [[0, 1, 31, 32, 0, 700, 65, 1], [1000, 0, 47, 3000]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", PACKED, ids=["short", "long"])
@pytest.mark.parametrize("Dk,Dv", [(128, 128), (192, 128)])
def test_core_packed_vs_fp64(gen, lengths, Dk, Dv, dtype):
    xs = make(gen, 1, sum(lengths), 16, 2, Dk, Dv, dtype)
    check(gen, xs, PAPER, offsets(lengths), "fold_copy", oracle_on_gpu=sum(lengths) > 2000)


@pytest.mark.parametrize("Dk,Dv,dtype", [(192, 128, torch.bfloat16), (128, 64, torch.float16),
                                         (128, 128, torch.float16), (64, 128, torch.bfloat16)])
@pytest.mark.parametrize("T", [4097, 4111])  # rows of 16 tokens from token 31: a tail of 2, and none
def test_core_head_dims_and_fp16_vs_fp64(gen, T, Dk, Dv, dtype):
    """Dk >= Dv folds by view (V zero-padded in its expanded copy); Dk < Dv runs the provider's call."""
    xs = make(gen, 1, T, 16, 2, Dk, Dv, dtype)
    check(gen, xs, PAPER, None, "fold_view" if Dk >= Dv else "fold_copy", oracle_on_gpu=True)


@pytest.mark.parametrize("lengths", [[8192], [0, 8192, 0], [4096, 0, 4096]], ids=["one", "one-among-empty", "two"])
def test_packed_of_one_length_is_the_dense_batch(gen, lengths):
    """Packed sequences of one length run exactly the dense call on [n, L]: the same bits, outputs and
    gradients, the compressed branch folded by view."""
    T, n = sum(lengths), sum(1 for x in lengths if x)
    xs = make(gen, 1, T, 16, 2, 128, 128, torch.bfloat16)
    go = torch.randn(1, T, 16, 128, generator=gen).to("cuda", torch.bfloat16)
    dense = nsa_attention(*(x.view(n, T // n, *x.shape[2:]) for x in xs), PAPER)
    want = torch.autograd.grad(dense, xs, go.view(dense.shape))
    telemetry.reset()
    got = nsa_attention(*xs, PAPER, cu_seqlens=offsets(lengths))
    core_ran("fold_view")
    assert any(e["event"] == "as_batch" for e in telemetry.snapshot()["events"])
    assert torch.equal(got, dense.view(got.shape))
    for name, a, b in zip(("q", "k", "v", "gates"), torch.autograd.grad(got, xs, go), want):
        assert torch.equal(a, b), name


def test_no_host_sync_packed(gen, core_env):
    """Forward and backward of the core on packed input never wait on the host: the one synchronisation of a
    packed call is validation's host copy of the offsets, made here before the check starts."""
    import nsa.functional as functional
    from nsa.validation import Shapes, check_cu_seqlens

    lengths = [1000, 0, 1, 2047, 1048]
    cu = offsets(lengths)
    xs = make(gen, 1, sum(lengths), 16, 2, 128, 128, torch.bfloat16)
    nsa_attention(*xs, PAPER, cu_seqlens=cu).sum().backward()  # compile and cache everything first
    host = check_cu_seqlens(cu, Shapes(1, sum(lengths), 16, 2, 128, 128), cu.device)
    core_env.setattr(functional, "check_cu_seqlens", lambda *a: host)
    torch.cuda.synchronize()
    telemetry.reset()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = nsa_attention(*xs, PAPER, cu_seqlens=cu)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    core_ran("fold_copy")
