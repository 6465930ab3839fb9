"""The Triton selection kernel in Triton's CPU interpreter (TRITON_INTERPRET=1), vs the torch selected branch.

Tiny shapes (the interpreter is slow): fp32, forward and gradients, G in {1, 2, 4} (and G over one row
tile), Dk != Dv, -1 padding, empty rows, blocks longer than one tile, packed input with an empty
sequence; then the integration (nsa_attention with the sel branch on the kernel vs backend="torch") and
the routing (guards, toggles, telemetry). Skipped with the reason when triton does not import.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .interp import kernel_modules

selection, tma = kernel_modules("selection", "tma", probe="selection_bwd._sel_bwd_dq_kernel")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nsa import plan, telemetry  # noqa: E402
from nsa.branches.selected import naive  # noqa: E402
from nsa.config import NSAConfig  # noqa: E402
from nsa.functional import nsa_attention  # noqa: E402
from nsa.hooks import HOOKS  # noqa: E402
from nsa.kernels.indices import dedupe_blocks  # noqa: E402
from nsa.kernels.triton.common import selected_tiles  # noqa: E402
from nsa.kernels.triton.selection import selected_attention_triton  # noqa: E402
from nsa.validation import NSAInputError  # noqa: E402

from .helpers import slow  # noqa: E402

SEL_ENV = ("NSA_USE_TRITON_SEL", "NSA_TRITON_SEL_FORCE", "NSA_SEL_TRITON_ALLOW_GRAD", "NSA_SEL_TRITON_MIN_L",
           "NSA_SEL_BACKEND")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in SEL_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    telemetry.reset()
    prov = plan.TRITON["sel"]
    saved = (prov.capability, prov.allow_cpu)
    yield
    prov.capability, prov.allow_cpu = saved


@pytest.fixture(params=["pointers", "tma"])
def copies(request, monkeypatch):
    """K/V tiles of the forward and dq kernels by pointer loads or by TMA descriptors (the interpreter runs
    both on CPU tensors); after the test, the descriptors made tell which path ran."""
    if request.param == "tma" and not tma.triton_has_descriptors():
        pytest.skip(f"this triton has no host-side tensor descriptors (from {tma.MIN_TRITON})")
    monkeypatch.setattr(HOOKS, "tma_force", request.param == "tma")
    monkeypatch.setattr(HOOKS, "tma", request.param == "tma")
    tma.USED.clear()
    yield request.param
    used = {kernel for kernel, n in tma.USED.items() if n}
    assert used == ({"sel_fwd", "sel_dq"} if request.param == "tma" else set()), used


def random_indices(gen, seq_start, B, T, H, n, ls, pad_prob=0.3):
    """Ascending, -1 padded, distinct candidate blocks j <= pos // ls of each token."""
    idx = torch.full((B, T, H, n), -1, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            pos = t - int(seq_start[b, t])
            for h in range(H):
                c = torch.randperm(pos // ls + 1, generator=gen)[:n]
                keep = c[torch.rand(len(c), generator=gen) > pad_prob]
                idx[b, t, h, : len(keep)] = keep.sort().values
    return idx


def selected_attention_torch(q, k, v, indices, seq_start, block_sel):
    """The naive twin (nsa.branches.selected.naive) with the kernel entry point's arguments."""
    B, T = q.shape[:2]
    ss = torch.zeros(B, T, dtype=torch.long) if seq_start is None else seq_start.long().expand(B, T)
    return naive.selected_attention(q, k, v, indices, SimpleNamespace(seq_start=ss),
                                    SimpleNamespace(block_sel=block_sel), q.shape[-1] ** -0.5)


def inputs(gen, B, T, Hkv, G, Dk, Dv, dtype=torch.float32):
    q = torch.randn(B, T, Hkv * G, Dk, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, T, Hkv, Dk, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, T, Hkv, Dv, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def compare(q, k, v, idx, seq_start, ls, gen, tol=2e-5):
    got = selected_attention_triton(q, k, v, idx, seq_start, ls)
    want = selected_attention_torch(q, k, v, idx, seq_start, ls)
    assert got.dtype == q.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    go = torch.randn(got.shape, generator=gen, dtype=got.dtype)
    ga = torch.autograd.grad(got, (q, k, v), go)
    gb = torch.autograd.grad(want, (q, k, v), go)
    for name, a, b in zip("qkv", ga, gb):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, n=name: f"d{n}: {m}")
    return got


# Each group size once, with equal and with unequal (non power of two) head dims: G > 1 with Hkv = 2 tells
# apart every mapping of query heads to KV heads but h * G + g; B = 2 the batch strides. Dk = 48 and 40 run as
# two column tiles (32 + 16, the second one full or masked), as the paper's 192 runs as 128 + 64.
@pytest.mark.parametrize("G,Dk,Dv", [slow(1, 24, 8), slow(2, 16, 16), (4, 24, 8), (2, 48, 16),
                                     slow(1, 40, 8)])
def test_kernel_matches_torch_dense(gen, copies, G, Dk, Dv):
    B, T, Hkv, ls, n = 2, 29, 2, 8, 3
    q, k, v = inputs(gen, B, T, Hkv, G, Dk, Dv)
    ss = torch.zeros(B, T, dtype=torch.long)
    idx = random_indices(gen, ss, B, T, Hkv, n, ls)
    idx[0, 5] = -1  # a row with no block at all: output 0, gradient 0
    out = compare(q, k, v, idx, ss, ls, gen)
    assert (out[0, 5] == 0).all()


@triton.jit
def _tiles_kernel(IDX, POS, OUT, n_sel, block_sel, N_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  N_SUB: tl.constexpr):
    r = tl.program_id(0)
    pos = tl.load(POS + r).to(tl.int64)
    tl.store(OUT + r, selected_tiles(IDX + r * n_sel, 1, n_sel, pos, block_sel, N_PAD, BLOCK_N, N_SUB))


def test_walk_ends_after_the_last_visible_tile():
    """common.selected_tiles (blocks of 8 tokens in sub-tiles of 4, 3 slots): rows whose visible blocks come
    first stop after the last tile holding a visible token, the own block's only up to the query; rows in any
    other order, or with an invisible block between visible ones, are walked whole."""
    rows = [  # (ids, pos, iterations)
        ([0, 1, 2], 20, 6),  # own block 2 to position 4 of 8: both of its sub-tiles
        ([0, 2, -1], 17, 3),  # own block 2 to position 1: its first sub-tile only
        ([0, 2, -1], 16, 3),
        ([1, 2, -1], 19, 3),  # position 3: still the first sub-tile
        ([-1, 0, 2], 17, 6),  # -1 first (not the top-n step's order): whole walk
        ([0, 3, -1], 17, 2),  # block 3 starts after the query: left out; block 0 is not the own block
        ([3, 0, -1], 17, 6),  # an invisible block before a visible one: whole walk
        ([1, 0, -1], 9, 4),  # descending: the last visible block (0) is not the own one, so both whole
        ([-1, -1, -1], 3, 0),  # nothing selected
        ([0, -1, -1], 0, 1),  # the first token
    ]
    idx = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    pos = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    out = torch.full((len(rows),), -7, dtype=torch.int64)
    _tiles_kernel[(len(rows),)](idx, pos, out, 3, 8, N_PAD=4, BLOCK_N=4, N_SUB=2)
    assert out.tolist() == [r[2] for r in rows]


def test_shortened_walk_gives_the_whole_walks_bits(gen, copies):
    """The rows as the top-n step writes them (visible blocks first, -1 padded) and the same rows with their
    -1 slots moved first, which the kernels walk whole: equal outputs, LSE and gradients to the bit, so every
    iteration the short walk leaves out was wholly masked."""
    B, T, Hkv, G, ls, n = 1, 37, 2, 2, 8, 4
    q, k, v = inputs(gen, B, T, Hkv, G, 16, 16)
    ss = torch.zeros(B, T, dtype=torch.int32)
    canon = random_indices(gen, ss, B, T, Hkv, n, ls).to(torch.int32)
    assert (canon[..., -1] == -1).any() and (canon[..., 0] >= 0).any()
    pad_first = canon.sort(-1).values  # -1 first, then the same blocks in the same order
    assert not torch.equal(pad_first, canon)
    scale = 16 ** -0.5
    got = [selection.sel_forward(q, k, v, ix, ss, ls, scale) for ix in (canon, pad_first)]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    do = torch.randn(got[0][0].shape, generator=gen)
    grads = [selection.sel_backward(do, q, k, v, got[0][0], got[0][1], ix, ss, ls, scale) for ix in (canon, pad_first)]
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name


def test_dedupe_puts_blocks_first():
    """The entry points' rows: ascending, each block once, -1 after them (so the kernels' walks end early)."""
    idx = torch.tensor([[3, -1, 0, 3], [-1, -1, -1, -1], [2, 1, 1, 0]], dtype=torch.int32)
    assert dedupe_blocks(idx).tolist() == [[0, 3, -1, -1], [-1, -1, -1, -1], [0, 1, 2, -1]]
    assert dedupe_blocks(idx).dtype == torch.int32


def test_future_blocks_and_unsorted_user_indices(gen):
    """User-given indices may name blocks after the query (fully masked) and need not be sorted."""
    B, T, Hkv, G, ls = 1, 33, 1, 2, 8
    q, k, v = inputs(gen, B, T, Hkv, G, 16, 16)
    ss = torch.zeros(B, T, dtype=torch.long)
    idx = torch.tensor([3, 0, 1], dtype=torch.long).expand(B, T, Hkv, 3).contiguous()
    compare(q, k, v, idx, ss, ls, gen)


def test_block_longer_than_one_tile(gen, copies, monkeypatch):
    """l' = 24 with 16-token sub-tiles: two tiles per block, the second one half masked."""
    monkeypatch.setattr(selection, "MAX_BLOCK_N", 16)
    B, T, Hkv, G, ls = 1, 40, 1, 2, 24
    q, k, v = inputs(gen, B, T, Hkv, G, 16, 8)
    ss = torch.zeros(B, T, dtype=torch.long)
    compare(q, k, v, random_indices(gen, ss, B, T, Hkv, 2, ls, pad_prob=0.0), ss, ls, gen)


@pytest.mark.sample
def test_group_over_several_row_tiles(gen, monkeypatch):
    monkeypatch.setattr(selection, "MAX_BLOCK_G", 16)
    B, T, Hkv, G, ls = 1, 20, 1, 20, 8
    q, k, v = inputs(gen, B, T, Hkv, G, 16, 16)
    ss = torch.zeros(B, T, dtype=torch.long)
    compare(q, k, v, random_indices(gen, ss, B, T, Hkv, 2, ls), ss, ls, gen)


def test_packed_with_empty_sequence(gen, copies):
    cu = [0, 13, 13, 40]
    T = cu[-1]
    ss = torch.zeros(1, T, dtype=torch.long)
    for a, b in zip(cu, cu[1:]):
        ss[0, a:b] = a
    q, k, v = inputs(gen, 1, T, 2, 2, 16, 8)
    compare(q, k, v, random_indices(gen, ss, 1, T, 2, 3, 8), ss, 8, gen)


def test_non_contiguous_inputs(gen, copies):
    B, T, Hkv, G, ls = 1, 24, 2, 2, 8
    qkv = torch.randn(B, T, Hkv * G + 2 * Hkv, 16, generator=gen)
    q = qkv[:, :, : Hkv * G].detach().requires_grad_()
    kv = torch.randn(B, T, Hkv, 32, generator=gen)
    k, v = kv[..., :16].detach().requires_grad_(), kv[..., 16:].detach().requires_grad_()
    q2 = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    ss = torch.zeros(B, T, dtype=torch.long)
    idx = random_indices(gen, ss, B, T, Hkv, 2, ls)
    compare(q2.detach().requires_grad_(), k, v, idx, ss, ls, gen)


def test_empty_inputs():
    q = torch.randn(1, 0, 2, 16)
    k = torch.randn(1, 0, 1, 16)
    out = selected_attention_triton(q, k, k, torch.zeros(1, 0, 1, 2, dtype=torch.long), None, 8)
    assert out.shape == (1, 0, 2, 16)


# --- integration: nsa_attention with the sel branch on the kernel ---------------------------------------

CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=3, n_init=1, n_local=1, window=8)


@pytest.mark.parametrize("packed", [False, True])
def test_nsa_attention_sel_on_triton_matches_torch(gen, monkeypatch, packed):
    B, T, Hq, Hkv, Dk, Dv = (1, 30, 4, 2, 16, 8) if packed else (2, 26, 4, 2, 16, 8)
    q, k, v = inputs(gen, B, T, Hkv, Hq // Hkv, Dk, Dv)
    g = torch.rand(B, T, Hq, 3, generator=gen).requires_grad_()
    cu = torch.tensor([0, 11, 11, 30], dtype=torch.int32) if packed else None
    want, i_want = nsa_attention(q, k, v, g, CFG, backend="torch", cu_seqlens=cu, return_indices=True,
                                 chunk_size=7)
    monkeypatch.setenv("NSA_SEL_BACKEND", "triton_sel")
    telemetry.reset()
    got, i_got = nsa_attention(q, k, v, g, CFG, cu_seqlens=cu, return_indices=True, chunk_size=7)
    assert telemetry.served("sel") == {"triton": 1}
    assert torch.equal(i_got, i_want)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    go = torch.randn(got.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, g), go), torch.autograd.grad(want, (q, k, v, g), go)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.sample
def test_fixed_block_indices_through_triton(gen, monkeypatch):
    B, T, Hq, Hkv = 1, 24, 2, 1
    q, k, v = inputs(gen, B, T, Hkv, Hq // Hkv, 16, 16)
    g = torch.rand(B, T, Hq, 3, generator=gen)
    idx = random_indices(gen, torch.zeros(B, T, dtype=torch.long), B, T, Hkv, 3, 8).to(torch.int32)
    want = nsa_attention(q, k, v, g, CFG, backend="torch", block_indices=idx)
    monkeypatch.setenv("NSA_SEL_BACKEND", "triton_sel")
    got = nsa_attention(q, k, v, g, CFG, block_indices=idx)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# --- routing ---------------------------------------------------------------------------------------------


def counts():
    return {(r["branch"], r["backend"], r["reason"]): r["calls"] for r in telemetry.snapshot()["counts"]}


def small(gen, dtype=torch.float32, grad=False):
    q = torch.randn(1, 20, 2, 16, generator=gen, dtype=dtype)
    k = torch.randn(1, 20, 1, 16, generator=gen, dtype=dtype)
    v = torch.randn(1, 20, 1, 16, generator=gen, dtype=dtype)
    if grad:
        q.requires_grad_()
    return q, k, v, torch.rand(1, 20, 2, 3, generator=gen, dtype=dtype)


def test_auto_on_cpu_keeps_sel_on_torch(gen):
    q, k, v, g = small(gen)
    nsa_attention(q, k, v, g, CFG)
    assert counts()[("sel", "torch", "ok")] == 1


def test_backend_torch_keeps_everything_torch(gen, monkeypatch):
    monkeypatch.setenv("NSA_SEL_BACKEND", "triton_sel")
    q, k, v, g = small(gen)
    nsa_attention(q, k, v, g, CFG, backend="torch")
    assert counts()[("sel", "torch", "forced")] == 1 and telemetry.served("sel") == {"torch": 1}


def test_forced_without_interpreter_raises(gen, monkeypatch):
    monkeypatch.setenv("NSA_SEL_BACKEND", "triton_sel")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, g = small(gen)
    with pytest.raises(NSAInputError, match="TRITON_INTERPRET=1"):
        nsa_attention(q, k, v, g, CFG)


def test_bad_sel_backend_value(gen, monkeypatch):
    monkeypatch.setenv("NSA_SEL_BACKEND", "cuda")
    q, k, v, g = small(gen)
    with pytest.raises(NSAInputError, match="NSA_SEL_BACKEND"):
        nsa_attention(q, k, v, g, CFG)


def test_sel_backend_torch_toggle(gen, monkeypatch):
    plan.TRITON["sel"].allow_cpu = True
    monkeypatch.setenv("NSA_SEL_BACKEND", "torch")
    q, k, v, g = small(gen)
    nsa_attention(q, k, v, g, CFG)
    assert counts()[("sel", "torch", "forced")] == 1


@pytest.mark.parametrize(
    "env,cap,dtype,grad,reason",
    [
        ({"NSA_SEL_TRITON_MIN_L": "1024"}, (9, 0), torch.float32, False, "below_min_len"),
        ({"NSA_SEL_TRITON_MIN_L": "1", "NSA_USE_TRITON_SEL": "0"}, (9, 0), torch.float32, False, "disabled"),
        ({"NSA_SEL_TRITON_MIN_L": "1"}, (8, 9), torch.float32, False, "ada_policy"),
        ({"NSA_SEL_TRITON_MIN_L": "1"}, (7, 5), torch.float32, False, "sm_unsupported"),
        ({"NSA_SEL_TRITON_MIN_L": "1"}, (9, 0), torch.float64, False, "dtype"),
        ({"NSA_SEL_TRITON_MIN_L": "1", "NSA_SEL_TRITON_ALLOW_GRAD": "0"}, (9, 0), torch.float32, True, "grad"),
    ],
)
def test_guards_fall_back_with_reason(gen, monkeypatch, env, cap, dtype, grad, reason):
    prov = plan.TRITON["sel"]
    prov.allow_cpu, prov.capability = True, cap
    for key, val in env.items():
        monkeypatch.setenv(key, val)
    q, k, v, g = small(gen, dtype, grad)
    nsa_attention(q, k, v, g, CFG)
    assert counts()[("sel", "torch", reason)] == 1
    assert telemetry.snapshot()["fallbacks"] >= 1


def test_auto_routes_to_triton_when_guards_pass(gen, monkeypatch):
    prov = plan.TRITON["sel"]
    prov.allow_cpu, prov.capability = True, (8, 9)
    monkeypatch.setenv("NSA_SEL_TRITON_MIN_L", "1")
    monkeypatch.setenv("NSA_TRITON_SEL_FORCE", "1")  # Ada policy overridden
    q, k, v, g = small(gen, grad=True)
    want = nsa_attention(q, k, v, g, CFG, backend="torch")
    telemetry.reset()
    got = nsa_attention(q, k, v, g, CFG)
    assert counts()[("sel", "triton", "ok")] == 1
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_forced_raises_on_guard_failure(gen, monkeypatch):
    monkeypatch.setenv("NSA_SEL_BACKEND", "triton_sel")
    q, k, v, g = small(gen, torch.float64)
    with pytest.raises(NSAInputError, match="dtype"):
        nsa_attention(q, k, v, g, CFG)
