"""The selection backward without atomics on a GPU: dq/dk/dv against fp64 autograd of the torch selected
branch with fixed indices, G in {1, 2, 3, 4, 8, 16, 32, 64}, (Dk, Dv) in {(64, 64), (128, 128),
(192, 128), (256, 256)}, bf16/fp16/fp32, packed input with empty sequences, empty and -1 padded index
lists, bitwise equal repeated runs under contention, and q/dq beyond 2**31 elements.

Run: python3 -m pytest -m gpu tests/gpu/test_triton_sel_bwd_gpu.py (skipped without CUDA / triton).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_sel_helpers import MARKS, PAPER, SMALL, err, selected_attention_torch, topn_indices

pytestmark = MARKS

# max |got - want| / max(1, max |want|); gradients of bf16 sums over many selecting queries are looser
TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}
GROUPS = [1, 2, 3, 4, 8, 16, 32, 64]
HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]


def leaf(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_()


def qkv(gen, B, T, Hkv, G, Dk, Dv, dtype):
    return leaf(gen, B, T, Hkv * G, Dk, dtype=dtype), leaf(gen, B, T, Hkv, Dk, dtype=dtype), leaf(
        gen, B, T, Hkv, Dv, dtype=dtype)


def seq_start_of(lengths):
    cu = [0, *itertools.accumulate(lengths)]
    ss = torch.zeros(1, cu[-1], dtype=torch.long)
    for a, b in zip(cu, cu[1:]):
        ss[0, a:b] = a
    return ss.cuda()


def check_vs_fp64(gen, q, k, v, idx, ss, cfg, tol, chunk=256):
    """Kernel forward + backward vs fp64 autograd of the torch selected branch (same indices)."""
    from nsa.kernels.triton.selection import selected_attention_triton

    out = selected_attention_triton(q, k, v, idx, ss, cfg)
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to("cuda")
    got = torch.autograd.grad(out, (q, k, v), go.to(out.dtype))
    xd = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = selected_attention_torch(*xd, idx, ss, cfg, chunk=chunk)
    want = torch.autograd.grad(ref, xd, go)
    assert err(out, ref) < tol, ("o", err(out, ref))
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == q.dtype and torch.isfinite(a).all(), name
        assert err(a, b) < tol, (f"d{name}", err(a, b))
    return out, got


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """dq/dk/dv filled with NaN before the kernels: an element that no kernel writes fails the test."""
    from nsa.kernels.triton import selection_bwd

    monkeypatch.setattr(selection_bwd, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("Dk,Dv", HEAD_DIMS)
@pytest.mark.parametrize("G", GROUPS)
def test_grads_group_sizes_and_head_dims(gen, G, Dk, Dv):
    B, T, Hkv, dtype = 1, 300, 2 if G <= 8 else 1, torch.bfloat16
    q, k, v = qkv(gen, B, T, Hkv, G, Dk, Dv, dtype)
    ss = torch.zeros(B, T, dtype=torch.long, device="cuda")
    idx = topn_indices(gen, ss, Hkv, SMALL)
    idx[0, 5] = -1  # an empty row
    out, (dq, _, _) = check_vs_fp64(gen, q, k, v, idx, ss, SMALL, TOL[dtype])
    assert (out[0, 5] == 0).all() and (dq[0, 5] == 0).all()


@pytest.mark.big_gpu_memory
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("Dk,Dv", [(128, 128), (192, 128)])
def test_grads_dtypes_paper_config(gen, dtype, Dk, Dv):
    """Hq=64, Hkv=4, 16 blocks of 64 (forced first and local blocks): block 0 has many chunks."""
    B, T, Hkv, G = 1, 1500, 4, 16
    q, k, v = qkv(gen, B, T, Hkv, G, Dk, Dv, dtype)
    ss = torch.zeros(B, T, dtype=torch.long, device="cuda")
    check_vs_fp64(gen, q, k, v, topn_indices(gen, ss, Hkv, PAPER), ss, PAPER, TOL[dtype], chunk=128)


@pytest.mark.parametrize("G", [1, 3, 16])
def test_grads_packed_empty_and_padded_lists(gen, G):
    """Packed sequences (empty, length 1, starts not at multiples of l'), -1 padded and empty index rows."""
    ss = seq_start_of([0, 65, 1, 300, 0, 129, 7, 64])
    T, Hkv, dtype = ss.shape[1], 2, torch.bfloat16
    q, k, v = qkv(gen, 1, T, Hkv, G, 128, 64, dtype)
    idx = topn_indices(gen, ss, Hkv, SMALL)
    drop = torch.rand(idx.shape, generator=gen).cuda() < 0.3
    idx = torch.where(drop & (idx > 0), -1, idx)  # duplicate-free lists with -1 holes
    idx[0, 70] = -1
    idx[0, 400:420, 1] = -1
    check_vs_fp64(gen, q, k, v, idx, ss, SMALL, TOL[dtype])


def test_backward_is_bitwise_deterministic(gen):
    """Paper shapes at 8k (every query selects block 0: long lists, several chunks, partials + reduce):
    two backward runs give identical bits."""
    from nsa.kernels.triton import selection_bwd
    from nsa.kernels.triton.selection import selected_attention_triton

    B, T, Hkv, G, D, dtype = 1, 8192, 4, 16, 128, torch.bfloat16
    q, k, v = qkv(gen, B, T, Hkv, G, D, D, dtype)
    ss = torch.zeros(B, T, dtype=torch.long, device="cuda")
    idx = topn_indices(gen, ss, Hkv, PAPER)
    chunk = selection_bwd.bwd_config(G, D, D, PAPER.block_sel, dtype, q.device)["chunk"]
    plan = selection_bwd.plan_backward(idx, ss.to(torch.int32), PAPER.block_sel, chunk)
    assert int(plan.n_reduce) > 0, "no block took the partials path"
    go = torch.randn(B, T, Hkv * G, D, generator=gen).to("cuda", dtype)
    runs = []
    for _ in range(2):
        out = selected_attention_triton(q, k, v, idx, ss, PAPER)
        runs.append(torch.autograd.grad(out, (q, k, v), go))
    for name, a, b in zip("qkv", *runs):
        assert torch.equal(a, b), f"d{name} differs between two runs"


@pytest.mark.big_gpu_memory
def test_backward_offsets_past_2_pow_31(gen):
    """q, o, dq hold more than 2**31 elements. Indices: each token's local block and the one before, and a
    late block jx selected by the last 1100 tokens (several chunks). From block jx on, queries select only
    blocks >= jx, so the slice [jx * l', T) is closed: its gradients are checked against fp64 on the slice."""
    Hq, Hkv, D, dtype = 64, 4, 128, torch.bfloat16
    ls = PAPER.block_sel
    T = 2**31 // (Hq * D) + 3 * ls
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs ~30 GiB of GPU memory")
    from nsa.kernels.triton.selection import selected_attention_triton

    q = torch.empty(1, T, Hq, D, device="cuda", dtype=dtype).normal_().requires_grad_()
    k = torch.empty(1, T, Hkv, D, device="cuda", dtype=dtype).normal_().requires_grad_()
    v = torch.empty(1, T, Hkv, D, device="cuda", dtype=dtype).normal_().requires_grad_()
    t = torch.arange(T, device="cuda")
    jx = (T - 1100) // ls
    s0 = jx * ls
    prev = t // ls - 1
    late = (t >= T - 1100) & (prev > jx)
    cols = [t // ls, torch.where((t >= ls) & ((t < s0) | (prev >= jx)), prev, -1), torch.where(late, jx, -1)]
    idx = torch.stack(cols, -1).int()[None, :, None, :].expand(1, T, Hkv, 3).contiguous()
    ss = torch.zeros(1, T, dtype=torch.long, device="cuda")
    out = selected_attention_triton(q, k, v, idx, ss, PAPER)
    go = torch.empty_like(out).normal_()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    assert q.numel() > 2**31 and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    sl = slice(s0, T)
    xd = [x[:, sl].detach().double().requires_grad_() for x in (q, k, v)]
    idx_sl = torch.where(idx[:, sl] >= 0, idx[:, sl] - jx, -1)
    assert (idx_sl[idx[:, sl] >= 0] >= 0).all(), "the slice is not closed"
    ref = selected_attention_torch(*xd, idx_sl, ss[:, sl], PAPER, chunk=256)
    want = torch.autograd.grad(ref, xd, go[:, sl].double())
    tol = TOL[dtype]
    assert err(out[:, sl], ref) < tol
    for name, a, b in zip("qkv", (dq, dk, dv), want):
        assert err(a[:, sl], b) < tol, (f"d{name}", err(a[:, sl], b))
