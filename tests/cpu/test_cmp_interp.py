"""The compressed-branch kernels (nsa.kernels.triton.cmp_attn) in Triton's CPU interpreter: o, LSE and the
gradients against an fp64 oracle (rows before the first block's end, the staircase of visible blocks,
T not a multiple of a tile, more cache blocks than visible, GQA, Dk as two column tiles with a narrower
V, the dK/dV kernel's head shares), and inside the dense core against the torch path. fp32 (the
interpreter's bf16 dot is not faithful; the GPU suite covers bf16)."""

from __future__ import annotations

import pytest
import torch

from .interp import kernel_modules

tma, cmp_attn = kernel_modules("tma", "cmp_attn", probe="cmp_attn._cmp_fwd_kernel")

from nsa import NSAConfig, nsa_attention, plan, telemetry  # noqa: E402
from nsa.hooks import HOOKS  # noqa: E402

from . import backend_fakes  # noqa: E402
from .helpers import make_inputs, rel_err  # noqa: E402


def cmp_oracle(q, kc, vc, l, d, scale):
    """fp64 (o [B, T, Hq, Dv], lse [B, T, Hq]) of each query over the compressed blocks ending at or before it
    (block i ends at i*d + l - 1); o = 0, lse = -inf for rows that see none."""
    B, T, Hq, _ = q.shape
    G = Hq // kc.shape[2]
    kk, vv = kc.double().repeat_interleave(G, 2), vc.double().repeat_interleave(G, 2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), kk) * scale
    ends = torch.arange(kc.shape[1]) * d + l - 1
    seen = ends[None, :] <= torch.arange(T)[:, None]
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(seen.any(1)[:, None], torch.softmax(s.masked_fill(~seen.any(1)[:, None], 0.0), -1), 0.0)
    return torch.einsum("bhts,bshd->bthd", p, vv), lse.transpose(1, 2)


@pytest.fixture
def descriptors(monkeypatch):
    monkeypatch.setattr(HOOKS, "tma_force", True)  # the interpreter runs TMA descriptors on CPU tensors


def _maxabs(x):
    return x.abs().max().item() if x.numel() else 0.0


def _blocks(T, l, d):
    return (T - l) // d + 1 if T >= l else 0


# (T, l, d, G, D, tiles, extra blocks): tiles of 16 make every key-tile kind appear at small T (unmasked
# tiles, the staircase, rows that see nothing); l = d; T shorter than l; the default tiles; a cache longer
# than the blocks T sees.
CASES = [(100, 8, 4, 2, 16, (16, 16), 0), (77, 16, 4, 1, 16, (16, 16), 3), (50, 4, 4, 2, 16, (16, 16), 0),
         (7, 8, 4, 2, 16, (16, 16), 2), (130, 8, 2, 2, 32, (32, 16), 0), (90, 8, 4, 2, 64, None, 0)]


@pytest.mark.parametrize("T,l,d,G,D,tiles,extra", CASES)
def test_cmp_forward_and_backward_match_oracle(gen, descriptors, T, l, d, G, D, tiles, extra):
    B, Hkv = 2, 2
    N = _blocks(T, l, d) + extra
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    kc, vc = (torch.randn(B, N, Hkv, D, generator=gen) for _ in range(2))
    do = torch.randn(B, T, Hkv * G, D, generator=gen)
    cfg = None if tiles is None else {"BM": tiles[0], "BN": tiles[1], "STAGES": 2}
    o, lse = cmp_attn.cmp_forward(q, kc, vc, l, d, 0.3, config=cfg)
    leaves = [x.double().requires_grad_() for x in (q, kc, vc)]
    want_o, want_lse = cmp_oracle(*leaves, l, d, 0.3)
    assert o.shape == (B, T, Hkv * G, D) and lse.shape == (B, T, Hkv * G)
    assert (o.double() - want_o).abs().max() <= 2e-5
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert _maxabs((lse.double() - want_lse)[~empty]) <= 2e-5
    bcfg = None if tiles is None else {**cfg, "SHARES": 2}
    got = cmp_attn.cmp_backward(do, q, kc, vc, o, lse, l, d, 0.3, config=bcfg)
    want = torch.autograd.grad(want_o, leaves, do.double()) if N else [torch.zeros_like(x) for x in leaves]
    for name, a, b in zip(("q", "k_cmp", "v_cmp"), got, want):
        assert a.shape == b.shape and _maxabs(a.double() - b) <= 2e-5, name


@pytest.mark.parametrize("shares,bm_kv", [(1, 16), (3, 32)])
def test_cmp_backward_head_shares_and_dkdv_tiles(gen, descriptors, shares, bm_kv):
    """The dK/dV kernel over 1 or 3 shares of a group of 4 heads (the last share shorter), on query tiles of
    its own length: the same gradients."""
    B, T, Hkv, G, D, l, d = 1, 83, 2, 4, 16, 8, 4
    N = _blocks(T, l, d)
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    kc, vc = (torch.randn(B, N, Hkv, D, generator=gen) for _ in range(2))
    do = torch.randn(B, T, Hkv * G, D, generator=gen)
    o, lse = cmp_attn.cmp_forward(q, kc, vc, l, d, 0.3, config={"BM": 16, "BN": 16, "STAGES": 2})
    cfg = {"BM": 16, "BN": 16, "STAGES": 2, "BM_KV": bm_kv, "STAGES_KV": 2, "SHARES": shares}
    got = cmp_attn.cmp_backward(do, q, kc, vc, o, lse, l, d, 0.3, config=cfg)
    leaves = [x.double().requires_grad_() for x in (q, kc, vc)]
    want = torch.autograd.grad(cmp_oracle(*leaves, l, d, 0.3)[0], leaves, do.double())
    for name, a, b in zip(("q", "k_cmp", "v_cmp"), got, want):
        assert (a.double() - b).abs().max() <= 2e-5, name


@pytest.mark.sample
def test_cmp_two_column_tiles_and_narrower_v(gen, descriptors):
    """Dk = 96 as 64 + 32 columns with Dv = 64 (the paper's 192 / 128 runs as 128 + 64): o, LSE and grads."""
    B, T, Hkv, G, l, d = 1, 70, 2, 2, 8, 4
    N = _blocks(T, l, d)
    q = torch.randn(B, T, Hkv * G, 96, generator=gen)
    kc = torch.randn(B, N, Hkv, 96, generator=gen)
    vc = torch.randn(B, N, Hkv, 64, generator=gen)
    do = torch.randn(B, T, Hkv * G, 64, generator=gen)
    o, lse = cmp_attn.cmp_forward(q, kc, vc, l, d, 0.2)
    got = cmp_attn.cmp_backward(do, q, kc, vc, o, lse, l, d, 0.2)
    leaves = [x.double().requires_grad_() for x in (q, kc, vc)]
    want_o, _ = cmp_oracle(*leaves, l, d, 0.2)
    assert (o.double() - want_o).abs().max() <= 2e-5
    for name, a, b in zip(("q", "k_cmp", "v_cmp"), got, torch.autograd.grad(want_o, leaves, do.double())):
        assert a.shape == b.shape and (a.double() - b).abs().max() <= 2e-5, name


def test_cmp_refuses_too_few_blocks(descriptors):
    q = torch.randn(1, 40, 2, 16)
    kc = torch.randn(1, 3, 1, 16)
    with pytest.raises(ValueError, match="hold 3 / 3 blocks; queries up to T=40 see 9"):
        cmp_attn.cmp_forward(q, kc, kc, 8, 4, 1.0)
    with pytest.raises(ValueError, match="block_cmp and stride_cmp must be >= 1"):
        cmp_attn.cmp_forward(q, kc, kc, 8, 0, 1.0)


# --- inside the dense core -----------------------------------------------------------------------------------


clean_env = backend_fakes.clean_env


@pytest.fixture
def torch_flash_core(clean_env):
    """torch_flash (emulated) for cmp and win, the Triton kernels on CPU, TMA descriptors on: auto takes the
    dense core with the Triton window and, up to NSA_TRITON_CMP_MAX_LEN, the Triton compressed branch."""
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


def _events(name):
    return sum(e["calls"] for e in telemetry.snapshot()["events"] if e["event"] == name)


CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=1, window=12)


@pytest.mark.parametrize("T,Dk,Dv", [(37, 64, 64), (30, 96, 64)])
def test_dense_core_with_triton_cmp_matches_torch_path(gen, torch_flash_core, T, Dk, Dv):
    """Output and every gradient equal the torch path's with the compressed branch on these kernels (their
    event and the plan say so); NSA_TRITON_CMP_MAX_LEN shorter than T, or unset (default off), keeps the branch
    on its FA-2 provider."""
    q, k, v, g = make_inputs(gen, 2, T, 4, 2, Dk, Dv, torch.float32, True)
    want = nsa_attention(q, k, v, g, CFG, backend="torch")
    go = torch.randn(want.shape, generator=gen)
    want_grads = torch.autograd.grad(want, (q, k, v, g), go)
    cases = ((T, "triton_cmp", "cmp_forward"), (T - 1, "torch_flash", "fold_view"), (None, "torch_flash", "fold_view"))
    for max_len, provider, event in cases:
        if max_len is None:
            torch_flash_core.delenv("NSA_TRITON_CMP_MAX_LEN", raising=False)
        else:
            torch_flash_core.setenv("NSA_TRITON_CMP_MAX_LEN", str(max_len))
        telemetry.reset()
        got = nsa_attention(q, k, v, g, CFG)
        got_grads = torch.autograd.grad(got, (q, k, v, g), go)
        p = plan.make_plan("auto", q, k, v, CFG)
        assert p.cmp.provider == provider and p.core.provider == "dense_core", (max_len, p.cmp)
        assert _events(event) >= 1 and (_events("cmp_forward") == 0) == (provider != "triton_cmp")
        assert rel_err(got, want) < 1e-5, max_len
        for name, a, b in zip(("q", "k", "v", "gates"), got_grads, want_grads):
            assert rel_err(a, b) < 1e-5, (max_len, name)
