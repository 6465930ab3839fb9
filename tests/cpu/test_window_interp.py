"""The sliding-window kernels (nsa.kernels.triton.window) in Triton's CPU interpreter: o, LSE and the
gradients against an fp64 oracle on every kind of key block (window edge, full, diagonal, past T), and
inside the dense core against the torch path. fp32 (the interpreter's bf16 dot is not faithful; the GPU
suite covers bf16)."""

from __future__ import annotations

import pytest
import torch

from .interp import kernel_modules

tma, window = kernel_modules("tma", "window", probe="window._window_fwd_kernel")

from nsa import NSAConfig, nsa_attention, plan, telemetry  # noqa: E402
from nsa.hooks import HOOKS  # noqa: E402

from . import backend_fakes  # noqa: E402
from .helpers import make_inputs, rel_err, slow  # noqa: E402


def window_oracle(q, k, v, w, scale):
    """fp64 (o [B, T, Hq, D], lse [B, Hq, T]) of causal attention over the last w keys."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    kk, vv = k.double().repeat_interleave(G, 2), v.double().repeat_interleave(G, 2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), kk) * scale
    back = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    s = s.masked_fill(~((back >= 0) & (back < w)), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), vv), torch.logsumexp(s, -1)


@pytest.fixture
def descriptors(monkeypatch):
    monkeypatch.setattr(HOOKS, "tma_force", True)  # the interpreter runs TMA descriptors on CPU tensors


# (T, window, G, D, tiles): tiles of 16 rows / keys make every block kind appear at small T; T not a
# multiple of the tile; a window of 1, one inside a tile, one wider than T; the default tiles (64 rows)
# with a T shorter than one tile.
CASES = [(100, 40, 2, 16, (16, 16)), (77, 16, 1, 16, (16, 16)), (50, 1, 4, 16, (16, 16)), (70, 9, 2, 32, (32, 16)),
         (45, 200, 2, 16, (16, 16)), (40, 24, 2, 64, None), (130, 70, 1, 32, (32, 32))]


@pytest.mark.sample
@pytest.mark.parametrize("T,w,G,D,tiles", CASES)
def test_window_forward_matches_oracle(gen, descriptors, T, w, G, D, tiles):
    B, Hkv = 2, 2
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen) for _ in range(2))
    cfg = None if tiles is None else {"BM": tiles[0], "BN": tiles[1], "STAGES": 2}
    o, lse = window.window_forward(q, k, v, w, 0.3, config=cfg)
    want_o, want_lse = window_oracle(q, k, v, w, 0.3)
    assert o.shape == (B, T, Hkv * G, D) and lse.shape == (B, Hkv * G, T)
    assert (o.double() - want_o).abs().max() <= 2e-5
    assert (lse.double() - want_lse).abs().max() <= 2e-5


# w = 34 with 16-token tiles: the last query that sees a key tile starts a query tile of its own.
BWD_CASES = [(100, 40, 2, 16, (16, 16)), (90, 34, 2, 16, (16, 16)), (77, 16, 1, 16, (32, 16)), (50, 1, 2, 16, (16, 16)),
             (45, 200, 2, 16, (16, 32)), (130, 70, 1, 32, (32, 32)), (40, 24, 2, 64, None)]


@pytest.mark.parametrize("T,w,G,D,tiles", BWD_CASES)
def test_window_backward_matches_oracle(gen, descriptors, T, w, G, D, tiles):
    """dq, dk, dv from the kernel's o and LSE against autograd through the fp64 oracle: query tiles longer
    and shorter than key tiles, a window of 1, one wider than T, the default tiles."""
    B, Hkv = 2, 2
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen) for _ in range(2))
    do = torch.randn(B, T, Hkv * G, D, generator=gen)
    o, lse = window.window_forward(q, k, v, w, 0.3, config={"BM": 16, "BN": 16, "STAGES": 2})
    cfg = None if tiles is None else {"BM": tiles[0], "BN": tiles[1], "STAGES": 2}
    got = window.window_backward(do, q, k, v, o, lse, w, 0.3, config=cfg)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(window_oracle(*leaves, w, 0.3)[0], leaves, do.double())
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and (a.double() - b).abs().max() <= 2e-5, name


@pytest.mark.parametrize("bm,bm_kv", [(32, 16), (16, 32)])
def test_window_backward_with_its_own_dkdv_query_tiles(gen, descriptors, bm, bm_kv):
    """The dK/dV kernel on query tiles of another length than the dQ kernel's (the default at D <= 128: 64 for
    dQ, 32 for dK/dV), against the fp64 oracle; the defaults name both."""
    assert window.backward_config(128) == {"BM": 64, "BN": 64, "STAGES": 3, "num_warps": 4, "BM_KV": 32,
                                           "STAGES_KV": 2}
    B, T, Hkv, G, D, w = 2, 83, 2, 2, 16, 37
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen) for _ in range(2))
    do = torch.randn(B, T, Hkv * G, D, generator=gen)
    o, lse = window.window_forward(q, k, v, w, 0.3, config={"BM": 16, "BN": 16, "STAGES": 2})
    cfg = {"BM": bm, "BN": 16, "STAGES": 2, "BM_KV": bm_kv, "STAGES_KV": 3}
    made = tma.USED["window_bwd"]
    got = window.window_backward(do, q, k, v, o, lse, w, 0.3, config=cfg)
    assert tma.USED["window_bwd"] - made == 6  # q and dO twice (one tile length each kernel), K and V
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(window_oracle(*leaves, w, 0.3)[0], leaves, do.double())
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and (a.double() - b).abs().max() <= 2e-5, name


@pytest.mark.parametrize("Dk,Dv,tiles", [(48, 32, (16, 16)), (48, 16, (32, 16)), (96, 64, None)])
def test_window_two_column_tiles_and_narrower_v(gen, descriptors, Dk, Dv, tiles):
    """Dk as two column tiles (48 = 32 + 16, 96 = 64 + 32; the paper's 192 runs as 128 + 64) with Dv < Dk:
    o, LSE and dq, dk, dv against the fp64 oracle."""
    B, T, Hkv, G, w = 2, 70, 2, 2, 23
    q = torch.randn(B, T, Hkv * G, Dk, generator=gen)
    k = torch.randn(B, T, Hkv, Dk, generator=gen)
    v = torch.randn(B, T, Hkv, Dv, generator=gen)
    do = torch.randn(B, T, Hkv * G, Dv, generator=gen)
    cfg = None if tiles is None else {"BM": tiles[0], "BN": tiles[1], "STAGES": 2}
    o, lse = window.window_forward(q, k, v, w, 0.3, config=cfg)
    got = window.window_backward(do, q, k, v, o, lse, w, 0.3, config=cfg)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want_o, want_lse = window_oracle(*leaves, w, 0.3)
    assert o.shape == (B, T, Hkv * G, Dv)
    assert (o.double() - want_o).abs().max() <= 2e-5 and (lse.double() - want_lse).abs().max() <= 2e-5
    for name, a, b in zip("qkv", got, torch.autograd.grad(want_o, leaves, do.double())):
        assert a.shape == b.shape and (a.double() - b).abs().max() <= 2e-5, name


@pytest.mark.parametrize("d,tiles", [(16, (16, 0)), (24, (32, 0)), (40, (32, 16)), (48, (32, 16)), (80, (128, 0)),
                                     (96, (64, 32)), (128, (128, 0)), (144, (256, 0)), (160, (256, 0)),
                                     (192, (128, 64)), (256, (256, 0))])
def test_split_dim_takes_tails_of_at_least_half_the_main_tile(d, tiles):
    """Two column tiles only where the tail is at least half the main tile (narrower tails spilled in the
    backward kernels); one padded tile elsewhere."""
    from nsa.kernels.triton.common import split_dim

    assert split_dim(d) == tiles


def test_window_forward_wide_head_config(gen, descriptors):
    """D > 128 takes its own tiles (32-key blocks, 2 stages)."""
    assert window.launch_config(256) == {"BM": 64, "BN": 32, "STAGES": 2, "num_warps": 4}
    q = torch.randn(1, 70, 2, 256, generator=gen)
    k, v = (torch.randn(1, 70, 1, 256, generator=gen) for _ in range(2))
    o, lse = window.window_forward(q, k, v, 37, 0.1)
    want_o, want_lse = window_oracle(q, k, v, 37, 0.1)
    assert (o.double() - want_o).abs().max() <= 2e-5 and (lse.double() - want_lse).abs().max() <= 2e-5


def test_supported_and_bad_window(gen, descriptors):
    q = torch.randn(1, 8, 2, 64)
    assert window.supported(q, q[:, :, :1], q[:, :, :1])[0]
    ok, why = window.supported(torch.randn(1, 8, 2, 48), torch.randn(1, 8, 1, 48), torch.randn(1, 8, 1, 48))
    assert not ok and "head dims" in why
    assert window.supported(*(torch.randn(1, 8, h, 192) for h in (2, 1)), torch.randn(1, 8, 1, 128))[0]
    ok, why = window.supported(*(torch.randn(1, 8, h, 128) for h in (2, 1)), torch.randn(1, 8, 1, 96))
    assert not ok and "head dims" in why  # Dv as one power-of-two tile only
    with pytest.raises(ValueError, match="window must be >= 1"):
        window.window_forward(q, q, q, 0, 1.0)
    with pytest.raises(ValueError, match="multiple of the key tile"):
        window.window_forward(q, q, q, 4, 1.0, config={"BM": 16, "BN": 32})


# --- inside the dense core -----------------------------------------------------------------------------------


clean_env = backend_fakes.clean_env


@pytest.fixture
def torch_flash_core(clean_env):
    """torch_flash (emulated) for cmp and win, the Triton kernels on CPU, TMA descriptors on: auto takes the
    dense core with the Triton window."""
    env = clean_env
    absent = backend_fakes.emulated("flash_attn")
    absent.available_override = (False, "flash-attn is not installed")
    env.setattr(HOOKS, "providers", {"flash_attn": absent, "torch_flash": backend_fakes.emulated("torch_flash"),
                                     "sdpa": plan.PROVIDERS["sdpa"]})
    env.setenv("NSA_FA2_MIN_LEN_WIN", "1")
    env.setenv("NSA_FA2_MIN_LEN_CMP", "1")
    for prov in plan.TRITON.values():
        env.setattr(prov, "allow_cpu", True)
    env.setattr(HOOKS, "tma_force", True)
    return env


def _window_events():
    return sum(e["calls"] for e in telemetry.snapshot()["events"] if e["event"] == "window_forward")


CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=1, window=12)


# One batch row (the kernels' batch strides: the oracle tests above; the core's: tests/cpu/test_pipeline_interp.py)
# Dk=96 / Dv=64: Dk as two column tiles (64 + 32) with a narrower V, as the paper's 192 / 128 runs.
@pytest.mark.parametrize("T,w,Dk,Dv", [slow(33, 12, 64, 64), slow(24, 64, 64, 64),
                                      (33, 12, 96, 64)])
def test_dense_core_with_triton_window_matches_torch_path(gen, torch_flash_core, T, w, Dk, Dv):
    """Output and every gradient equal the torch path's; the Triton window ran (its event) and the planner
    says so; NSA_TRITON_WINDOW=0 keeps the window on FA-2 with the same result."""
    cfg = NSAConfig(**{**CFG.__dict__, "window": w})
    q, k, v, g = make_inputs(gen, 1, T, 4, 2, Dk, Dv, torch.float32, True)
    want = nsa_attention(q, k, v, g, cfg, backend="torch")
    go = torch.randn(want.shape, generator=gen)
    want_grads = torch.autograd.grad(want, (q, k, v, g), go)
    telemetry.reset()
    got = nsa_attention(q, k, v, g, cfg)
    assert _window_events() == 1 and telemetry.served("win") == {"triton_window": 1}
    assert telemetry.served("core") == {"dense_core": 1} and telemetry.snapshot()["fallbacks"] == 0
    assert rel_err(got, want) <= 2e-5
    for name, a, b in zip("qkvg", torch.autograd.grad(got, (q, k, v, g), go), want_grads):
        assert rel_err(a, b) <= 2e-5, name
    torch_flash_core.setenv("NSA_TRITON_WINDOW", "0")
    telemetry.reset()
    off = nsa_attention(q, k, v, g, cfg)
    assert _window_events() == 0 and rel_err(off, want) <= 2e-5
    assert telemetry.served("win") == {"torch_flash": 1} and telemetry.served("core") == {"dense_core": 1}


def test_window_plan_needs_tma(gen, torch_flash_core):
    """The Triton window serves the window's FA-2 providers alike (flash_attn here too; the core step keeps
    that provider for the compressed branch's tail tokens), not with a forced backend, not without TMA
    copies; no case is a fallback."""
    q, k, v, g = make_inputs(gen, 1, 40, 4, 2, 64, 64, torch.float32)
    fast = {**HOOKS.providers, "flash_attn": backend_fakes.emulated("flash_attn")}
    torch_flash_core.setattr(HOOKS, "providers", fast)
    telemetry.reset()
    p = plan.make_plan("auto", q, k, v, CFG)
    assert p.core.provider == "dense_core" and p.core.impl[0].name == "flash_attn"
    assert p.win.provider == "triton_window" and p.win.reason == "ok"
    forced = plan.make_plan("flash_attn", q, k, v, CFG)  # a forced backend serves win itself
    assert forced.core.provider == "dense_core" and (forced.win.provider, forced.win.reason) == ("flash_attn", "forced")
    torch_flash_core.setattr(HOOKS, "tma_force", False)
    p = plan.make_plan("auto", q, k, v, CFG)
    assert p.win.provider == "flash_attn" and p.core.provider == "dense_core"
    assert telemetry.snapshot()["fallbacks"] == 0
