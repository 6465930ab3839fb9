"""Triton selection kernel (forward) on a GPU: vs fp64 references, bf16/fp16/fp32, paper shapes, varlen,
int64 offsets, and nsa_attention(backend="auto") served by ("sel", "triton", ...).

Run: python3 -m pytest -m gpu tests/gpu/test_triton_sel_parity_gpu.py (skipped without CUDA / triton).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_sel_helpers import MARKS, PAPER, SMALL, err, topn_indices

pytestmark = MARKS

from nsa import NSAConfig, nsa_attention, nsa_reference, telemetry  # noqa: E402
from nsa.branches.selected.naive import selected_chunk  # noqa: E402
from nsa.hooks import HOOKS  # noqa: E402

# max |got - want| / max(1, max |want|)
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}


def rand(gen, *shape, dtype, device="cuda"):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)


def seq_start_of(lengths, device="cuda"):
    cu = [0, *itertools.accumulate(lengths)]
    ss = torch.zeros(1, cu[-1], dtype=torch.long)
    for a, b in zip(cu, cu[1:]):
        ss[0, a:b] = a
    return ss.to(device), torch.tensor(cu, dtype=torch.int32, device=device)


def sel_ref(q, k, v, idx, seq_start, cfg, chunk=256):
    """fp64 torch selected branch (the torch backend's function) on the GPU."""
    from triton_sel_helpers import selected_attention_torch

    return selected_attention_torch(q.double(), k.double(), v.double(), idx, seq_start, cfg, chunk=chunk)


def sel_triton(q, k, v, idx, seq_start, cfg):
    from nsa.kernels.triton.selection import selected_attention_triton

    return selected_attention_triton(q, k, v, idx, seq_start, cfg)


@pytest.mark.big_gpu_memory
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("Hq,Hkv,Dk,Dv", [(64, 4, 128, 128), (64, 4, 192, 128)])
def test_kernel_paper_shapes(gen, dtype, Hq, Hkv, Dk, Dv):
    B, T = 1, 2048
    q, k, v = rand(gen, B, T, Hq, Dk, dtype=dtype), rand(gen, B, T, Hkv, Dk, dtype=dtype), rand(gen, B, T, Hkv, Dv,
                                                                                                   dtype=dtype)
    ss = torch.zeros(B, T, dtype=torch.long, device="cuda")
    idx = topn_indices(gen, ss, Hkv, PAPER)
    got = sel_triton(q, k, v, idx, ss, PAPER)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert err(got, sel_ref(q, k, v, idx, ss, PAPER)) < TOL[dtype]


@pytest.mark.parametrize("G", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("Dk,Dv", [(64, 64), (128, 64), (256, 256)])
def test_kernel_group_sizes_and_head_dims(gen, G, Dk, Dv):
    B, T, Hkv, dtype = 2, 333, 2, torch.bfloat16
    q, k, v = rand(gen, B, T, Hkv * G, Dk, dtype=dtype), rand(gen, B, T, Hkv, Dk, dtype=dtype), rand(
        gen, B, T, Hkv, Dv, dtype=dtype)
    ss = torch.zeros(B, T, dtype=torch.long, device="cuda")
    idx = topn_indices(gen, ss, Hkv, SMALL)
    idx[0, 7] = -1  # empty rows give 0
    got = sel_triton(q, k, v, idx, ss, SMALL)
    assert (got[0, 7] == 0).all()
    assert err(got, sel_ref(q, k, v, idx, ss, SMALL)) < TOL[dtype]


@pytest.mark.parametrize("block_sel", [16, 48, 128])
def test_kernel_block_sizes(gen, block_sel):
    cfg = NSAConfig(block_cmp=16, stride_cmp=16, block_sel=block_sel, n_sel=5, n_init=1, n_local=2, window=64)
    B, T, Hkv, G, dtype = 1, 700, 2, 4, torch.float16
    q, k, v = rand(gen, B, T, Hkv * G, 128, dtype=dtype), rand(gen, B, T, Hkv, 128, dtype=dtype), rand(
        gen, B, T, Hkv, 128, dtype=dtype)
    ss = torch.zeros(B, T, dtype=torch.long, device="cuda")
    idx = topn_indices(gen, ss, Hkv, cfg)
    assert err(sel_triton(q, k, v, idx, ss, cfg), sel_ref(q, k, v, idx, ss, cfg)) < TOL[dtype]


def test_kernel_varlen_with_empty_sequences(gen):
    lengths = [0, 1, 63, 64, 65, 0, 500, 7]
    ss, _ = seq_start_of(lengths)
    T, Hkv, G, dtype = ss.shape[1], 4, 16, torch.bfloat16
    q, k, v = rand(gen, 1, T, Hkv * G, 192, dtype=dtype), rand(gen, 1, T, Hkv, 192, dtype=dtype), rand(
        gen, 1, T, Hkv, 128, dtype=dtype)
    idx = topn_indices(gen, ss, Hkv, SMALL)
    assert err(sel_triton(q, k, v, idx, ss, SMALL), sel_ref(q, k, v, idx, ss, SMALL)) < TOL[dtype]


@pytest.mark.big_gpu_memory
@pytest.mark.parametrize("Dk,Dv", [(128, 128), (192, 128)])
def test_tma_copies_match_pointer_loads(gen, monkeypatch, Dk, Dv):
    """On Hopper the forward and dq kernels read K/V tiles by TMA: same outputs and gradients as pointer
    loads (packed, -1 padded lists, sequences shorter than a block), and the descriptors were made."""
    from nsa.kernels.triton import tma

    if torch.cuda.get_device_capability()[0] < 9 or not tma.triton_has_descriptors():
        pytest.skip("TMA copies need sm 9.0+ and a triton with host-side tensor descriptors")
    ss, _ = seq_start_of([1000, 3, 0, 40, 1005])
    T, Hq, Hkv, dtype = ss.shape[1], 64, 4, torch.bfloat16
    q, k, v = rand(gen, 1, T, Hq, Dk, dtype=dtype), rand(gen, 1, T, Hkv, Dk, dtype=dtype), rand(gen, 1, T, Hkv, Dv,
                                                                                                   dtype=dtype)
    idx = topn_indices(gen, ss, Hkv, PAPER)
    go = rand(gen, 1, T, Hq, Dv, dtype=dtype)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(HOOKS, "tma", on)
        tma.USED.clear()
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out = sel_triton(qq, kk, vv, idx, ss, PAPER)
        runs[on] = (out, *torch.autograd.grad(out, (qq, kk, vv), go))
        assert (tma.USED["sel_fwd"] > 0 and tma.USED["sel_dq"] > 0) == on, dict(tma.USED)
    for name, a, b in zip(("out", "dq", "dk", "dv"), runs[True], runs[False]):
        assert torch.isfinite(a).all(), name
        assert err(a, b) < 1e-2, name
    assert err(runs[True][0], sel_ref(q, k, v, idx, ss, PAPER)) < TOL[dtype]


@pytest.mark.big_gpu_memory
def test_kernel_offsets_past_2_pow_31(gen):
    """q/o hold more than 2**31 elements: the last rows must be right (int64 offsets)."""
    Hq, Hkv, D, dtype = 64, 4, 128, torch.bfloat16
    T = 2**31 // (Hq * D) + 256
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs ~12 GiB of GPU memory")
    q = torch.empty(1, T, Hq, D, device="cuda", dtype=dtype).normal_()
    k = torch.empty(1, T, Hkv, D, device="cuda", dtype=dtype).normal_()
    v = torch.empty(1, T, Hkv, D, device="cuda", dtype=dtype).normal_()
    ls = PAPER.block_sel
    t = torch.arange(T, device="cuda")
    idx = torch.full((1, T, Hkv, 4), -1, dtype=torch.int32, device="cuda")
    idx[..., 0] = 0
    idx[..., 1] = torch.clamp(t // ls - 1000, min=-1).to(torch.int32)[None, :, None]
    idx[..., 2] = torch.where(t >= ls, t // ls, -1).to(torch.int32)[None, :, None]
    idx[..., 1] = torch.where(idx[..., 1] > 0, idx[..., 1], -1)
    ss = torch.zeros(1, T, dtype=torch.long, device="cuda")
    got = sel_triton(q, k, v, idx, ss, PAPER)
    tail = slice(T - 256, T)
    pos = t[tail]
    qc = q[:, tail].double().unflatten(2, (Hkv, Hq // Hkv))
    want = selected_chunk(qc, k.double(), v.double(), idx[:, tail].long(), pos[None], ss[:, tail], PAPER,
                          PAPER.softmax_scale(D)).flatten(2, 3)
    assert err(got[:, tail], want) < TOL[dtype]
    assert err(got[:, :256], sel_ref(q[:, :256], k[:, :256], v[:, :256], idx[:, :256], ss[:, :256], PAPER)) < TOL[dtype]


# --- through nsa_attention: auto routes sel to the kernel, against nsa.reference (fp64) ------------------


def one_hot(B, T, Hq, dtype, which=1):
    g = torch.zeros(B, T, Hq, 3, dtype=dtype, device="cuda")
    g[..., which] = 1
    return g


def assert_sel_on_triton(reason="ok"):
    counts = {(r["branch"], r["backend"], r["reason"]): r["calls"] for r in telemetry.snapshot()["counts"]}
    assert telemetry.served("sel") == {"triton": counts.get(("sel", "triton", reason), -1)}, counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,Hq,Hkv,Dk,Dv", [(300, 16, 2, 128, 128), (257, 16, 1, 192, 128), (64, 4, 4, 64, 64)])
def test_auto_sel_branch_vs_reference(gen, dtype, T, Hq, Hkv, Dk, Dv):
    q, k, v = rand(gen, 2, T, Hq, Dk, dtype=dtype), rand(gen, 2, T, Hkv, Dk, dtype=dtype), rand(gen, 2, T, Hkv, Dv,
                                                                                                   dtype=dtype)
    g = one_hot(2, T, Hq, dtype)
    ref = nsa_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), g.cpu().double(), SMALL)
    telemetry.reset()
    got = nsa_attention(q, k, v, g, SMALL, block_indices=ref.indices.cuda())
    assert_sel_on_triton()
    assert err(got, ref.o_sel) < TOL[dtype]


def test_auto_full_output_varlen_vs_reference(gen):
    lengths = [100, 0, 1, 333, 64]
    _, cu = seq_start_of(lengths)
    T, Hq, Hkv, dtype = cu[-1].item(), 16, 2, torch.bfloat16
    q, k, v = rand(gen, 1, T, Hq, 128, dtype=dtype), rand(gen, 1, T, Hkv, 128, dtype=dtype), rand(gen, 1, T, Hkv,
                                                                                                    128, dtype=dtype)
    g = torch.rand(1, T, Hq, 3, generator=gen).to("cuda", dtype)
    ref = nsa_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), g.cpu().double(), SMALL,
                        cu_seqlens=cu.cpu())
    telemetry.reset()
    got = nsa_attention(q, k, v, g, SMALL, cu_seqlens=cu, block_indices=ref.indices.cuda())
    assert_sel_on_triton()
    assert err(got, ref.out) < TOL[dtype]


def test_auto_index_agreement_and_output(gen):
    """Without fixed indices: report index agreement (near ties may differ) and check the output."""
    T, Hq, Hkv, dtype = 1024, 16, 2, torch.bfloat16
    q, k, v = rand(gen, 1, T, Hq, 128, dtype=dtype), rand(gen, 1, T, Hkv, 128, dtype=dtype), rand(gen, 1, T, Hkv,
                                                                                                    128, dtype=dtype)
    g = one_hot(1, T, Hq, dtype)
    ref = nsa_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), g.cpu().double(), SMALL)
    telemetry.reset()
    got, idx = nsa_attention(q, k, v, g, SMALL, return_indices=True)
    assert_sel_on_triton()
    agree = (idx.cpu().sort(-1).values == ref.indices.sort(-1).values).float().mean().item()
    print(f"index agreement {agree:.4f}")
    assert agree > 0.97, agree
    same = (idx.cpu().sort(-1).values == ref.indices.sort(-1).values).all(-1).all(-1)[0]  # [T]
    assert err(got[0, same], ref.out[0, same]) < TOL[dtype]


def test_backend_torch_and_toggle_off_keep_torch(gen, sel_env):
    T, Hq, Hkv, dtype = 128, 8, 2, torch.bfloat16
    q, k, v = rand(gen, 1, T, Hq, 64, dtype=dtype), rand(gen, 1, T, Hkv, 64, dtype=dtype), rand(gen, 1, T, Hkv, 64,
                                                                                                  dtype=dtype)
    g = one_hot(1, T, Hq, dtype)
    nsa_attention(q, k, v, g, SMALL, backend="torch")
    assert telemetry.served("sel") == {"torch": 1}
    telemetry.reset()
    sel_env.setenv("NSA_USE_TRITON_SEL", "0")
    nsa_attention(q, k, v, g, SMALL)
    counts = {(r["branch"], r["backend"], r["reason"]) for r in telemetry.snapshot()["counts"]}
    assert ("sel", "torch", "disabled") in counts
    telemetry.reset()
    sel_env.delenv("NSA_USE_TRITON_SEL")
    sel_env.setenv("NSA_SEL_TRITON_MIN_L", "100000")
    nsa_attention(q, k, v, g, SMALL)
    counts = {(r["branch"], r["backend"], r["reason"]) for r in telemetry.snapshot()["counts"]}
    assert ("sel", "torch", "below_min_len") in counts
    telemetry.reset()
    sel_env.setenv("NSA_SEL_BACKEND", "triton_sel")
    nsa_attention(q, k, v, g, SMALL)
    assert_sel_on_triton("forced")
