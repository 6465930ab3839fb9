"""The fused GPU pipeline (nsa_attention, backend="auto" on CUDA) against the fp64 oracle, and its top-n.

Every test asserts from telemetry that the fused executor ran: cmp on cuDNN attention where it applies
(dense, sm 9.0+, head dims <= 128 or 256 by cuDNN release, >= 2 compressed blocks) else on FA-2, win on
FA-2 (or, in the dense core on Hopper, triton_window), topn, sel and combine on the Triton kernels, zero
fallbacks. Outputs and gradients (q, k, v, gates) are compared with the fp64 reference run with the same
block indices (top-n is discontinuous; the index agreement is measured separately). Small T uses
nsa.reference on the CPU; long T the fp64 torch backend on the GPU (itself checked against the reference
in the CPU suite).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from triton_sel_helpers import MARKS

from nsa import NSAConfig, nsa_attention, nsa_reference, plan, telemetry

pytestmark = MARKS

PAPER = NSAConfig()
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRAD_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2}


def err(got, want):
    """max |got - want| / max(1, max |want|)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item() if want.numel() else 0.0


def leaves(gen, shapes, dtype):
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_() for s in shapes]


def make(gen, B, T, Hq, Hkv, Dk, Dv, dtype):
    q, k, v = leaves(gen, [(B, T, Hq, Dk), (B, T, Hkv, Dk), (B, T, Hkv, Dv)], dtype)
    g = torch.rand(B, T, Hq, 3, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_()
    return q, k, v, g


FA2 = {"flash_attn", "torch_flash"}


def cmp_providers(q, v, cu, cfg) -> set:
    """Who must serve the compressed branch: cuDNN attention for dense input on sm 9.0+ with head dims <= 128
    (256 from cuDNN 9.19) and >= 2 compressed blocks (unless NSA_USE_CUDNN=0), else a FlashAttention-2
    provider."""
    cudnn = (cu is None and torch.cuda.get_device_capability() >= (9, 0)
             and max(q.shape[-1], v.shape[-1]) <= plan.CUDNN.max_head_dim()
             and cfg.n_cmp_blocks(q.shape[1]) >= 2 and os.environ.get("NSA_USE_CUDNN", "1") != "0")
    return {"torch_cudnn"} if cudnn else FA2


def assert_fused(cmp=FA2):
    snap = telemetry.snapshot()
    served = {s: telemetry.served(s) for s in ("cmp", "topn", "sel", "win", "combine")}
    assert set(served["cmp"]) <= cmp and served["cmp"], snap["counts"]
    # win: FA-2, or in the dense core on Hopper NSA's Triton window kernels; SDPA only where the split-KV guard
    # refused torch's FA-2 (head dim 192, few query tiles: nsa.plan.rules.check_splitkv), with that reason
    refused = {r["backend"] for r in snap["counts"] if r["branch"] == "win" and r["reason"] == "splitkv_lse"}
    assert refused <= {"sdpa"}, snap["counts"]
    win_ok = {"flash_attn", "torch_flash", "triton_window"} | refused
    assert set(served["win"]) <= win_ok and served["win"], snap["counts"]
    for s in ("sel", "combine"):
        assert set(served[s]) == {"triton"}, snap["counts"]
    assert set(served["topn"]) <= {"triton", "given"}, snap["counts"]
    # the guard's hand-off is a counted fallback; nothing else falls back
    guarded = sum(r["calls"] for r in snap["counts"] if r["branch"] == "win" and r["reason"] == "splitkv_lse")
    assert snap["fallbacks"] == guarded, snap["counts"]


def oracle(q, k, v, g, cfg, cu=None, on_gpu=False):
    """fp64 (out, indices): nsa.reference on the CPU, or (long T) the fp64 torch backend on the GPU."""
    xs = [x.detach().double() for x in (q, k, v, g)]
    if on_gpu:
        out, idx = nsa_attention(*xs, cfg, cu_seqlens=cu, backend="torch", return_indices=True)
        return out, idx
    res = nsa_reference(*[x.cpu() for x in xs], cfg, cu_seqlens=None if cu is None else cu.cpu())
    return res.out, res.indices.to("cuda")


def check(gen, q, k, v, g, cfg, cu=None, on_gpu=False):
    """Fused vs fp64: outputs with the oracle's blocks, gradients through the fp64 torch backend with the same
    blocks. Returns the fraction of (token, KV head) index sets the fused top-n shares with the oracle."""
    dtype = q.dtype
    want, ref_idx = oracle(q, k, v, g, cfg, cu=cu, on_gpu=on_gpu)
    cmp = cmp_providers(q, v, cu, cfg)
    telemetry.reset()
    _, idx = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, return_indices=True)
    assert_fused(cmp)
    same_sets = (idx == ref_idx).all(-1).float().mean().item() if idx.numel() else 1.0
    telemetry.reset()
    out = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, block_indices=ref_idx)
    assert_fused(cmp)
    assert torch.isfinite(out).all()
    assert err(out, want) < TOL[dtype]
    if q.shape[1] > 0:
        go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to("cuda")
        got = torch.autograd.grad(out, (q, k, v, g), go.to(dtype))
        xs = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
        ref = nsa_attention(*xs, cfg, cu_seqlens=cu, block_indices=ref_idx, backend="torch")
        for name, a, b in zip(("q", "k", "v", "gates"), got, torch.autograd.grad(ref, xs, go)):
            assert torch.isfinite(a).all(), name
            assert err(a, b) < GRAD_TOL[dtype], (name, err(a, b))
    return same_sets


@pytest.fixture(autouse=True)
def fused_env(sel_env):
    sel_env.setenv("NSA_FA2_MIN_LEN_WIN", "1")
    sel_env.setenv("NSA_FA2_MIN_LEN_CMP", "1")
    yield sel_env


GROUPS = [1, 2, 4, 8, 16, 32]
HEADS = [(64, 64), (128, 128), (192, 128), (256, 256)]


@pytest.mark.parametrize("T", [1, 31, 32, 65, 1000])
@pytest.mark.parametrize("Dk,Dv", HEADS)
@pytest.mark.parametrize("G", GROUPS)
def test_fused_vs_reference(gen, G, Dk, Dv, T):
    q, k, v, g = make(gen, 1, T, G, 1, Dk, Dv, torch.bfloat16)
    check(gen, q, k, v, g, PAPER)


@pytest.mark.parametrize("Dk,Dv", HEADS)
@pytest.mark.parametrize("G", GROUPS)
def test_fused_T4097(gen, G, Dk, Dv):
    q, k, v, g = make(gen, 1, 4097, 2 * G, 2, Dk, Dv, torch.bfloat16)
    agree = check(gen, q, k, v, g, PAPER, on_gpu=True)
    assert agree > 0.95, agree


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[0, 1, 31, 32, 0, 700, 65, 1], [4097, 0, 3]])
def test_fused_packed(gen, dtype, lengths):
    T = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v, g = make(gen, 1, T, 16, 2, 128, 128, dtype)
    check(gen, q, k, v, g, PAPER, cu=cu, on_gpu=T > 2000)


@pytest.mark.parametrize("T", [32, 48, 1500])  # 1, 2 and 92 compressed blocks
@pytest.mark.parametrize("use_cudnn", ["1", "0"])
def test_fused_compressed_on_cudnn_and_on_fa2(gen, fused_env, use_cudnn, T):
    """The dense D=128 case both ways: cuDNN attention (sm 9.0+, from 2 blocks) and, with NSA_USE_CUDNN=0,
    FA-2."""
    fused_env.setenv("NSA_USE_CUDNN", use_cudnn)
    q, k, v, g = make(gen, 2, T, 16, 2, 128, 128, torch.bfloat16)
    want = {"torch_cudnn"} if use_cudnn == "1" and T > 32 and torch.cuda.get_device_capability() >= (9, 0) else FA2
    assert cmp_providers(q, v, None, PAPER) == want
    check(gen, q, k, v, g, PAPER)  # asserts from telemetry that `want` served every fused call


def test_fused_batch_and_other_config(gen):
    cfg = NSAConfig(block_cmp=64, stride_cmp=16, block_sel=32, n_sel=8, n_init=2, n_local=1, window=100)
    q, k, v, g = make(gen, 3, 500, 8, 2, 64, 32, torch.bfloat16)
    check(gen, q, k, v, g, cfg)


def test_no_host_sync_dense(gen):
    """Forward and backward of the fused pipeline never wait on the host for dense input."""
    q, k, v, g = make(gen, 1, 4096, 16, 2, 128, 128, torch.bfloat16)
    nsa_attention(q, k, v, g, PAPER).sum().backward()  # compile and cache everything first
    torch.cuda.synchronize()
    telemetry.reset()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = nsa_attention(q, k, v, g, PAPER)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert_fused(cmp_providers(q, v, None, PAPER))


# --- the top-n kernel alone: index sets against the fp64 top-n, mismatches only at near-ties ----------


def _scores64(q, k_cmp, lse, layout, cfg, scale, rows):
    """fp64 selection scores [len(rows), Hkv, J] of the given (b, t) rows (the naive path's own sum)."""
    from nsa.branches.compressed.naive import visible
    from nsa.branches.selected.naive import cmp_probs, selection_scores

    Hq, Hkv = q.shape[2], k_cmp.shape[2]
    out = []
    for b, t in rows:
        qc = q[b:b + 1, t:t + 1].double().unflatten(2, (Hkv, Hq // Hkv))
        tg = torch.tensor([t], device=q.device)
        ss = layout.seq_start[b:b + 1, t:t + 1]
        mask = visible(layout.cmp_start[b:b + 1], layout.cmp_valid[b:b + 1], tg, ss, cfg)
        p = cmp_probs(qc, k_cmp[b:b + 1].double(), lse[b:b + 1, t:t + 1].unflatten(2, (Hkv, Hq // Hkv)), mask, scale)
        out.append(selection_scores(p, layout.cmp_local[b:b + 1], layout.cmp_valid[b:b + 1], layout.n_sel_blocks,
                                    cfg)[0, 0])
    return out


def test_topn_fp32_index_agreement_and_near_ties(gen):
    from nsa.branches.compressed.naive import compressed_attention
    from nsa.branches.selected.naive import top_n
    from nsa.compress import compress_kv
    from nsa.kernels.triton.topn import topn_triton
    from nsa.layout import dense_layout

    B, T, Hq, Hkv, D = 1, 8192, 16, 2, 128
    q = torch.randn(B, T, Hq, D, generator=gen, dtype=torch.float64).to("cuda")
    k = torch.randn(B, T, Hkv, D, generator=gen, dtype=torch.float64).to("cuda")
    layout = dense_layout(B, T, PAPER, q.device)
    scale = D ** -0.5
    kc, vc = compress_kv(k, k, layout, PAPER)
    _, lse = compressed_attention(q, kc, vc, layout, PAPER, scale, chunk=512)  # fp64
    want = top_n(q, kc, lse, layout, PAPER, scale, chunk=128)
    got = topn_triton(q.float(), kc.float(), lse.float(), layout.seq_start, layout.cmp_slot0, PAPER, scale)
    same = (got == want).all(-1)  # [B, T, Hkv]
    rate = same.float().mean().item()
    print(f"top-n fp32 kernel vs fp64: {rate:.5f} of (token, KV head) index sets equal")
    assert rate >= 0.999, rate
    bad = (~same).nonzero().tolist()
    scores = _scores64(q, kc, lse, layout, PAPER, scale, [(b, t) for b, t, _ in bad])
    for (b, t, h), s in zip(bad, scores):
        s = s[h]
        a, w = set(got[b, t, h].tolist()) - {-1}, set(want[b, t, h].tolist()) - {-1}
        lo = min(s[j].item() for j in w - a)  # chosen by fp64, dropped by the kernel
        hi = max(s[j].item() for j in a - w)
        assert abs(lo - hi) <= 1e-5 * max(abs(lo), 1e-30), (t, h, lo, hi)


def test_topn_bf16_agreement_reported(gen):
    """bf16 end to end: the fraction of index sets equal to the fp64 reference's on the same rounded inputs."""
    q, k, v, g = make(gen, 1, 2048, 16, 2, 128, 128, torch.bfloat16)
    _, ref_idx = oracle(q, k, v, g, PAPER)
    _, idx = nsa_attention(q.detach(), k.detach(), v.detach(), g.detach(), PAPER, return_indices=True)
    rate = (idx == ref_idx).all(-1).float().mean().item()
    print(f"bf16 pipeline vs fp64 reference: {rate:.5f} of (token, KV head) index sets equal")
    assert rate > 0.9, rate


def test_topn_ties_go_to_lower_index(gen):
    """Equal keys (repeated blocks) and q = 0: the kernel picks exactly what the fp64 reference picks."""
    cfg = PAPER
    T, Hq, Hkv, D = 2048, 4, 1, 64
    q = torch.randn(1, T, Hq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, Hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, T, Hkv, D, generator=gen, dtype=torch.float64)
    k[:, 256:] = k[:, :256].repeat(1, T // 256 - 1, 1, 1)  # period of 4 selection blocks
    q[:, 1024:1100] = 0
    g = torch.rand(1, T, Hq, 3, generator=gen, dtype=torch.float64)
    ref = nsa_reference(q, k, v, g, cfg)
    for dtype in (torch.bfloat16, torch.float16):
        xs = [x.to("cuda", dtype) for x in (q, k, v, g)]
        telemetry.reset()
        _, idx = nsa_attention(*xs, cfg, return_indices=True)
        assert_fused(cmp_providers(xs[0], xs[2], None, cfg))
        ref_lp = nsa_reference(*[x.double().cpu() for x in xs], cfg)
        rate = (idx.cpu() == ref_lp.indices).all(-1).float().mean().item()
        assert rate > 0.99, (dtype, rate)
        assert torch.equal(idx[0, 1024:1100].cpu(), ref_lp.indices[0, 1024:1100]), dtype  # q = 0: exact ties
    assert ref.indices.shape == (1, T, Hkv, cfg.n_sel)


def test_plan_cache_on_cuda(gen, monkeypatch):
    """Dense CUDA calls reuse their plan (every call still counted in telemetry); a toggle or the TMA switch
    gives a new one."""
    from nsa.hooks import HOOKS

    q, k, v, g = make(gen, 1, 300, 8, 2, 64, 64, torch.bfloat16)
    plan.clear_cache()
    telemetry.reset()
    first = plan.make_plan("auto", q, k, v, PAPER)
    assert plan.make_plan("auto", q, k, v, PAPER) is first
    assert sum(telemetry.served("sel").values()) == 2
    monkeypatch.setattr(HOOKS, "tma", not HOOKS.tma)
    assert plan.make_plan("auto", q, k, v, PAPER) is not first
    monkeypatch.setenv("NSA_USE_TRITON_TOPN", "0")
    assert plan.make_plan("auto", q, k, v, PAPER).topn.provider == "torch"
