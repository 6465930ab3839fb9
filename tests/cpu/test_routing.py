"""Per-branch routing (torch_cudnn where it applies, flash_attn -> torch_flash -> sdpa -> torch), its telemetry,
forcing, and the providers' math (compressed-branch group folding, window, varlen, head-dim padding) against
the torch path through emulated kernels (tests/cpu/fa2_emulation.py), exactly in fp64."""

from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, NSAInputError, nsa_attention, plan, telemetry
from nsa.branches.compressed.fold import fold_q, plan_dense, plan_varlen, unfold_lse, unfold_o
from nsa.hooks import HOOKS
from nsa.kernels.fa2.flash_attn import varlen_lse_2d

from . import backend_fakes
from .helpers import SMALL, make_inputs

clean_env = backend_fakes.clean_env
counts = backend_fakes.counts
emulated = backend_fakes.emulated
fakes = backend_fakes.fakes

CFG = SMALL["l8d4s8n4"]
CFGS = {"l8d4": CFG, "l8d8": SMALL["l8d8s8n3i0l0"], "l16d4": SMALL["l16d4s8n5i1l1"]}


def _packed(gen, lengths, Hq, Hkv, Dk, Dv, dtype=torch.float64, requires_grad=False):
    T = sum(lengths)
    q, k, v, g = make_inputs(gen, 1, T, Hq, Hkv, Dk, Dv, dtype, requires_grad)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    return q, k, v, g, cu


# --- routing order and reasons --------------------------------------------------------------------


def test_cpu_default_routes_everything_to_torch(clean_env, gen):
    q, k, v, g = make_inputs(gen, 1, 40, 4, 2, 16, 16)
    nsa_attention(q, k, v, g, CFG)
    assert counts() == {("cmp", "torch", "ok"): 1, ("topn", "torch", "ok"): 1, ("sel", "torch", "ok"): 1,
                        ("win", "torch", "ok"): 1}
    assert telemetry.snapshot()["fallbacks"] == 0


def test_order_prefers_flash_attn_then_torch_flash_then_sdpa(fakes, gen):
    q, k, v, g = make_inputs(gen, 1, 40, 4, 2, 16, 16)
    nsa_attention(q, k, v, g, CFG)
    assert counts() == {("cmp", "flash_attn", "ok"): 1, ("win", "flash_attn", "ok"): 1, ("sel", "torch", "ok"): 1,
                        ("topn", "torch", "ok"): 1}
    telemetry.reset()
    fakes["flash_attn"].available_override = (False, "not installed")
    nsa_attention(q, k, v, g, CFG)
    assert counts() == {("cmp", "torch_flash", "ok"): 1, ("win", "torch_flash", "ok"): 1, ("sel", "torch", "ok"): 1,
                        ("topn", "torch", "ok"): 1}
    telemetry.reset()
    fakes["torch_flash"].available_override = (False, "no GPU")
    nsa_attention(q, k, v, g, CFG)
    assert counts() == {("cmp", "sdpa", "ok"): 1, ("win", "sdpa", "ok"): 1, ("sel", "torch", "ok"): 1,
                        ("topn", "torch", "ok"): 1}
    telemetry.reset()
    fakes["sdpa"].available_override = (False, "no sdpa")
    nsa_attention(q, k, v, g, CFG)
    assert counts() == {("cmp", "torch", "ok"): 1, ("win", "torch", "ok"): 1, ("sel", "torch", "ok"): 1,
                        ("topn", "torch", "ok"): 1}
    assert telemetry.snapshot()["fallbacks"] == 0  # unavailability is the environment, not a fallback


@pytest.mark.parametrize("var,branch", [("NSA_USE_FA2", None), ("NSA_USE_FA2_WIN", "win"), ("NSA_USE_FA2_CMP", "cmp")])
def test_disable_toggles_fall_back_with_reason(fakes, gen, var, branch):
    q, k, v, g = make_inputs(gen, 1, 40, 4, 2, 16, 16)
    fakes.__class__  # noqa: B018
    import os

    os.environ[var] = "0"
    try:
        nsa_attention(q, k, v, g, CFG)
    finally:
        del os.environ[var]
    c = counts()
    for b in ("cmp", "win"):
        if branch in (None, b):
            assert c[(b, "sdpa", "disabled")] == 1
        else:
            assert c[(b, "flash_attn", "ok")] == 1
    assert telemetry.snapshot()["fallbacks"] == (2 if branch is None else 1)


def test_below_min_len_falls_back(fakes, gen, clean_env):
    clean_env.setenv("NSA_FA2_MIN_LEN_WIN", "64")
    q, k, v, g = make_inputs(gen, 1, 40, 4, 2, 16, 16)
    nsa_attention(q, k, v, g, CFG)
    c = counts()
    assert c[("win", "sdpa", "below_min_len")] == 1 and c[("cmp", "flash_attn", "ok")] == 1


def test_guard_failure_of_every_fast_provider_lands_on_torch(fakes, gen):
    fakes["sdpa"].available_override = (False, "x")
    for p in ("flash_attn", "torch_flash"):
        fakes[p].kernel_dtypes = (torch.float16,)  # fp64 input: dtype guard fails
    q, k, v, g = make_inputs(gen, 1, 40, 4, 2, 16, 16)
    nsa_attention(q, k, v, g, CFG)
    assert counts()[("cmp", "torch", "dtype")] == 1 and counts()[("win", "torch", "dtype")] == 1


def test_forcing_unavailable_backend_raises(clean_env, gen):
    q, k, v, g = make_inputs(gen, 1, 20, 2, 1, 8, 8)
    for name in ("flash_attn", "torch_flash"):
        with pytest.raises(NSAInputError, match=f"backend='{name}' is not available here"):
            nsa_attention(q, k, v, g, CFG, backend=name)
    with pytest.raises(NSAInputError, match="backend must be one of"):
        nsa_attention(q, k, v, g, CFG, backend="flash")


def test_forcing_with_failed_guard_raises_reason(fakes, gen, clean_env):
    q, k, v, g = make_inputs(gen, 1, 20, 2, 1, 12, 12)  # head dim 12: not a multiple of 8
    with pytest.raises(NSAInputError, match="head_dim"):
        nsa_attention(q, k, v, g, CFG, backend="torch_flash")
    q, k, v, g = make_inputs(gen, 1, 20, 2, 1, 16, 16)
    clean_env.setenv("NSA_USE_FA2", "0")
    with pytest.raises(NSAInputError, match="disabled"):
        nsa_attention(q, k, v, g, CFG, backend="flash_attn")
    clean_env.delenv("NSA_USE_FA2")
    clean_env.setenv("NSA_FA2_MIN_LEN_CMP", "100000")  # forcing skips only the speed threshold
    nsa_attention(q, k, v, g, CFG, backend="torch_flash")
    assert counts()[("cmp", "torch_flash", "forced")] == 1


def test_toggle_set_after_module_construction_takes_effect(fakes, gen, clean_env):
    torch.manual_seed(0)
    mod = NSAAttention(32, 4, 2, 16, 16, CFG).double()
    x = torch.randn(1, 24, 32, dtype=torch.float64)
    mod(x)
    assert counts()[("win", "flash_attn", "ok")] == 1
    clean_env.setenv("NSA_USE_FA2_WIN", "0")  # after construction: read at call time
    mod(x)
    assert counts()[("win", "sdpa", "disabled")] == 1


def test_debug_timing_buckets(fakes, gen, clean_env):
    clean_env.setenv("NSA_DEBUG_TIMING", "1")
    q, k, v, g = make_inputs(gen, 1, 24, 2, 1, 16, 16)
    nsa_attention(q, k, v, g, CFG)
    t = telemetry.snapshot()["timings"]
    assert t["cmp.flash_attn"]["calls"] == 1 and t["win.flash_attn"]["calls"] == 1


# --- torch_cudnn: the dense compressed branch on sm 9.0, through an emulation of cuDNN's top-left mask ---


@pytest.fixture
def cudnn(fakes, clean_env):
    prov = backend_fakes.emulated_cudnn()
    clean_env.setattr(HOOKS, "cudnn", prov)
    return prov


@pytest.mark.parametrize("cfg_name", sorted(CFGS))
@pytest.mark.parametrize("T", [1, 8, 9, 37, 64])
def test_cudnn_serves_the_dense_compressed_branch_exactly(cudnn, gen, cfg_name, T):
    """The compressed branch's bottom-right causal attention from cuDNN's top-left one (the last T_cmp query
    groups; the first l/d see nothing): outputs, blocks and gradients equal the torch path's in fp64."""
    cfg = CFGS[cfg_name]
    q, k, v, g = make_inputs(gen, 2, T, 4, 2, 16, 8, requires_grad=True)  # Dk != Dv: v padded to 16
    w = torch.randn(q.shape[:3] + (8,), generator=gen, dtype=torch.float64)
    want, want_idx = nsa_attention(q, k, v, g, cfg, backend="torch", return_indices=True)
    telemetry.reset()
    got, idx = nsa_attention(q, k, v, g, cfg, return_indices=True)
    serves = "torch_cudnn" if cfg.n_cmp_blocks(T) >= 2 else "flash_attn"  # cuDNN refuses a 1 x 1 attention
    assert counts()[("cmp", serves, "ok")] == 1 and counts()[("win", "flash_attn", "ok")] == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(idx, want_idx)
    grads = [torch.autograd.grad((o * w).sum(), (q, k, v, g)) for o in (
        nsa_attention(q, k, v, g, cfg, backend="torch", block_indices=idx),
        nsa_attention(q, k, v, g, cfg, block_indices=idx))]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["packed", "sm80", "head_dim_192", "NSA_USE_CUDNN=0", "force_varlen", "forced",
                                  "one_block"])
def test_cudnn_is_not_a_candidate_outside_its_domain(cudnn, gen, clean_env, case):
    """Outside dense input on sm 9.0 with head dims <= 128 and >= 2 compressed blocks the FA-2 order decides,
    and no fallback is counted."""
    Dk = 192 if case == "head_dim_192" else 16
    T = 11 if case == "one_block" else 40  # l=8, d=4: 1 block at T=11, 9 at T=40
    assert CFG.n_cmp_blocks(T) == (1 if case == "one_block" else 9)
    q, k, v, g = make_inputs(gen, 1, T, 4, 2, Dk, 16)
    kw = {}
    if case == "packed":
        q, k, v, g, kw["cu_seqlens"] = _packed(gen, [17, 23], 4, 2, 16, 16)
    elif case == "sm80":
        cudnn.capability = (8, 0)
    elif case == "NSA_USE_CUDNN=0":
        clean_env.setenv("NSA_USE_CUDNN", "0")
    elif case == "force_varlen":
        clean_env.setenv("NSA_FA2_FORCE_VARLEN", "1")
    elif case == "forced":
        kw["backend"] = "torch_flash"
    nsa_attention(q, k, v, g, CFG, **kw)
    want = "torch_flash" if case == "forced" else "flash_attn"
    assert counts()[("cmp", want, "forced" if case == "forced" else "ok")] == 1
    assert not any(b == "torch_cudnn" for _, b, _ in counts()) and telemetry.snapshot()["fallbacks"] == 0


@pytest.mark.parametrize("version,Dk,Dv", [(91900, 192, 16), (91900, 256, 256), (91900, 264, 16)])
def test_cudnn_wide_heads_from_the_release_measured_with_them(cudnn, gen, version, Dk, Dv):
    """From cuDNN 9.19 head dims up to 256 go to cuDNN too (exactly the torch path's result, fp64 emulation)."""
    cudnn.cudnn_version = version
    q, k, v, g = make_inputs(gen, 1, 40, 4, 2, Dk, Dv)
    want = nsa_attention(q, k, v, g, CFG, backend="torch")
    telemetry.reset()
    got = nsa_attention(q, k, v, g, CFG)
    wide = max(Dk, Dv) <= 256  # 264: past cuDNN's (and FA-2's) limit, sdpa serves it
    assert (counts().get(("cmp", "torch_cudnn", "ok")) == 1) is wide
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_cudnn_provider_bottom_right_causal_matches_fa2_contract(gen):
    """Called directly with seqlen_q > seqlen_k, torch_cudnn keeps FA-2's contract (bottom-right causal, empty
    rows: output 0, LSE +inf), from a top-left kernel."""
    q = torch.randn(2, 7, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    got = backend_fakes.emulated_cudnn().attn(q, k, v, causal=True, left=-1, scale=0.3, varlen=None, need_lse=True)
    want = emulated("torch_flash").attn(q, k, v, causal=True, left=-1, scale=0.3, varlen=None, need_lse=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1].float(), rtol=1e-6, atol=1e-6)
    assert torch.isinf(got[1][:, :, :3]).all() and (got[0][:, :3] == 0).all()


def test_cudnn_provider_refuses_what_it_cannot_compute():
    prov = backend_fakes.emulated_cudnn()
    q, k = torch.zeros(1, 5, 2, 8), torch.zeros(1, 3, 1, 8)
    with pytest.raises(ValueError, match="bottom-right causal attention only"):
        prov.attn(q, k, k, causal=True, left=4, scale=1.0, varlen=None, need_lse=True)
    with pytest.raises(ValueError, match="seqlen_q >= seqlen_k"):
        prov.attn(k, q, q, causal=True, left=-1, scale=1.0, varlen=None, need_lse=True)


# --- the FA-2 providers' math through the emulated kernels, exact in fp64 ----------------------------


@pytest.mark.parametrize("prov", ["torch_flash", "flash_attn"])
@pytest.mark.parametrize("cfg_name", sorted(CFGS))
@pytest.mark.parametrize("T", [1, 5, 8, 9, 16, 37, 64])
@pytest.mark.parametrize("mode", ["dense", "force_varlen"])
def test_fa2_providers_match_torch_path_dense(fakes, gen, clean_env, prov, cfg_name, T, mode):
    cfg = CFGS[cfg_name]
    if mode == "force_varlen":
        clean_env.setenv("NSA_FA2_FORCE_VARLEN", "1")
    q, k, v, g = make_inputs(gen, 2, T, 4, 2, 16, 8)  # Dk != Dv: v padded to 16
    want, want_idx = nsa_attention(q, k, v, g, cfg, backend="torch", return_indices=True)
    got, idx = nsa_attention(q, k, v, g, cfg, backend=prov, return_indices=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(idx, want_idx)


@pytest.mark.parametrize("prov", ["torch_flash", "flash_attn"])
@pytest.mark.parametrize("G,Dk,Dv", [(1, 8, 16), (2, 16, 16), (4, 16, 8)])
@pytest.mark.parametrize("lengths", [[0, 5, 0, 37, 8, 1], [64], [3, 0], [17, 40, 0]])
def test_fa2_providers_match_torch_path_packed(fakes, gen, prov, G, Dk, Dv, lengths):
    q, k, v, g, cu = _packed(gen, lengths, 2 * G, 2, Dk, Dv)
    for cfg in CFGS.values():
        want, want_idx = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, backend="torch", return_indices=True)
        got, idx = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, backend=prov, return_indices=True)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(idx, want_idx)


@pytest.mark.parametrize("window", [1, 3, 100])
def test_window_larger_and_smaller_than_T(fakes, gen, window):
    cfg = CFG.with_(window=window)
    q, k, v, g = make_inputs(gen, 1, 30, 4, 1, 16, 16)
    torch.testing.assert_close(nsa_attention(q, k, v, g, cfg, backend="torch_flash"),
                               nsa_attention(q, k, v, g, cfg, backend="torch"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prov", ["torch_flash", "sdpa"])
@pytest.mark.parametrize("packed", [False, True])
def test_gradients_match_torch_path(fakes, gen, prov, packed):
    if packed:
        q, k, v, g, cu = _packed(gen, [9, 0, 23], 4, 2, 16, 8, requires_grad=True)
    else:
        (q, k, v, g), cu = make_inputs(gen, 2, 29, 4, 2, 16, 8, requires_grad=True), None
    w = torch.randn(q.shape[:3] + (8,), generator=gen, dtype=torch.float64)
    idx = nsa_attention(q, k, v, g, CFG, cu_seqlens=cu, backend="torch", return_indices=True)[1]
    grads = []
    for be in ("torch", prov):
        out = nsa_attention(q, k, v, g, CFG, cu_seqlens=cu, backend=be, block_indices=idx)
        grads.append(torch.autograd.grad((out * w).sum(), (q, k, v, g)))
    for a, b in zip(*grads):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_fp32_cast_policy_pref_fp16(fakes, gen, clean_env):
    fakes["torch_flash"].kernel_dtypes = (torch.float16, torch.bfloat16)
    q, k, v, g = make_inputs(gen, 1, 24, 2, 1, 16, 16, dtype=torch.float32)
    with pytest.raises(NSAInputError, match="dtype"):
        nsa_attention(q, k, v, g, CFG, backend="torch_flash")
    want = nsa_attention(q, k, v, g, CFG, backend="torch")
    for pref in ("1", "0"):
        clean_env.setenv("NSA_FA2_PREF_FP16", pref)
        idx = nsa_attention(q, k, v, g, CFG, backend="torch", return_indices=True)[1]
        got = nsa_attention(q, k, v, g, CFG, backend="torch_flash", block_indices=idx)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=5e-2)


# --- the folding itself -------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 4, 7, 16, 33])
def test_fold_unfold_roundtrip_dense(gen, T):
    cfg = CFG
    q = torch.randn(2, T, 4, 8, generator=gen, dtype=torch.float64)
    p = plan_dense(2, T, 2, 2, cfg)
    f = fold_q(q, p)
    assert f.shape == (2, T // 4 + 1, 2 * 4 * 2, 8) and f.is_contiguous()
    assert torch.equal(unfold_o(f, p), q)
    # group m = (t + 1) // d holds token t; pad row (position 0) and tail rows are zero
    assert (f[:, 0].view(2, 2, 4, 2, 8)[:, :, 0] == 0).all()
    lse = torch.randn(2, p.heads, p.n_groups)
    lse[:, :, 0] = float("inf")
    u = unfold_lse(lse, p)
    assert u.shape == (2, T, 4) and torch.isneginf(u[:, :3]).all()


def test_fold_varlen_rows_and_offsets():
    cfg = CFG  # l = 8, d = 4
    host = [0, 0, 5, 13]
    p = plan_varlen(host, 13, 1, 1, cfg, "cpu")
    assert p.cu_q.tolist() == [0, 1, 3, 6] and p.cu_k.tolist() == [0, 0, 0, 1]
    assert p.rows.tolist() == [4 + 1 + t for t in range(5)] + [12 + 1 + t for t in range(8)]
    q = torch.arange(13, dtype=torch.float64).view(1, 13, 1, 1) + 1
    assert torch.equal(unfold_o(fold_q(q, p), p), q)


def test_varlen_lse_old_layout():
    lse3 = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # [n_seq, H, max_q]
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    out = varlen_lse_2d(lse3, cu, 6)
    assert out.shape == (3, 6)
    assert out[:, 4].tolist() == lse3[1, :, 0].tolist() and out[:, 3].tolist() == lse3[0, :, 3].tolist()


# --- the sdpa provider against the torch path (CPU, fp64 / fp32) --------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("chunk", [None, "7"])
def test_sdpa_matches_torch_path(clean_env, gen, dtype, tol, chunk):
    if chunk:
        clean_env.setenv("NSA_SDPA_CHUNK", chunk)
    for cfg in CFGS.values():
        q, k, v, g = make_inputs(gen, 2, 45, 4, 2, 16, 8, dtype=dtype)
        want, wi = nsa_attention(q, k, v, g, cfg, backend="torch", return_indices=True)
        got = nsa_attention(q, k, v, g, cfg, backend="sdpa", block_indices=wi)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        q, k, v, g, cu = _packed(gen, [0, 13, 2, 30], 4, 1, 8, 8, dtype=dtype)
        want, wi = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, backend="torch", return_indices=True)
        got = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, backend="sdpa", block_indices=wi)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert counts()[("cmp", "sdpa", "forced")] == 6


def test_provider_registry_is_complete():
    assert set(plan.ORDER) == set(plan.PROVIDERS)
    assert emulated("torch_flash").name == "torch_flash"


@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_drives_the_same_selection_as_the_torch_path(clean_env, gen, packed):
    """Without given blocks: the sdpa provider's LSE (its scale, only visible blocks) decides the top-n, so
    the blocks and outputs must equal the torch path's, and the LSE the naive compressed branch's."""
    from nsa import toggles
    from nsa.branches.compressed.naive import compressed_attention
    from nsa.branches.compressed.sdpa import compressed_sdpa
    from nsa.compress import compress_kv
    from nsa.layout import dense_layout, packed_layout

    if packed:
        q, k, v, g, cu = _packed(gen, [0, 21, 3, 44], 8, 2, 16, 8)
    else:
        (q, k, v, g), cu = make_inputs(gen, 2, 50, 8, 2, 16, 8), None
    for cfg in CFGS.values():
        want, wi = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, backend="torch", return_indices=True)
        got, gi = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, backend="sdpa", return_indices=True)
        assert torch.equal(gi, wi)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        T = q.shape[1]
        layout = packed_layout(cu, T, cfg) if packed else dense_layout(q.shape[0], T, cfg, q.device)
        kc, vc = compress_kv(k, v, layout, cfg)
        scale = cfg.softmax_scale(q.shape[-1])
        _, lse = compressed_sdpa(toggles.read(), q, kc, vc, layout, cfg, scale)
        _, lse_ref = compressed_attention(q, kc, vc, layout, cfg, scale)
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
        fin = torch.isfinite(lse_ref)
        torch.testing.assert_close(lse[fin].double(), lse_ref[fin].double(), rtol=1e-6, atol=1e-6)


def test_plan_cache_reuses_decisions_and_records_every_call(fakes, gen, clean_env, monkeypatch):
    """A cached plan (dense CUDA calls; here CPU calls too, through the test hook) is
    returned as is and its decisions are counted again for each call; a toggle, a shape, grad mode or a
    provider object change the key; packed input is never cached."""
    monkeypatch.setattr(HOOKS, "cache_cpu_plans", True)
    plan.clear_cache()
    q, k, v, _ = make_inputs(gen, 1, 40, 4, 2, 16, 16, torch.float32)
    cfg = SMALL["l8d4s8n4"]
    telemetry.reset()
    first = plan.make_plan("auto", q, k, v, cfg)
    assert plan.make_plan("auto", q, k, v, cfg) is first
    assert telemetry.served("win") == {first.win.provider: 2} and telemetry.snapshot()["calls"] > 0
    clean_env.setenv("NSA_USE_FA2_WIN", "0")
    off = plan.make_plan("auto", q, k, v, cfg)
    assert off is not first and off.win.provider != first.win.provider
    assert plan.make_plan("auto", q[:, :20], k[:, :20], v[:, :20], cfg) is not off
    with torch.no_grad():
        assert plan.make_plan("auto", q, k, v, cfg) is not off
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    packed = [plan.make_plan("auto", q, k, v, cfg, cu_seqlens=cu) for _ in range(2)]
    assert packed[0] is not packed[1]
    plan.clear_cache()


def test_plan_cache_key_only_for_cuda(gen):
    q, k, v, _ = make_inputs(gen, 1, 40, 4, 2, 16, 16, torch.float32)
    assert plan._cache_key("auto", q, k, v, SMALL["l8d4s8n4"], None, None, False, None, None) is None
