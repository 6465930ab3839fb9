"""The selection backward without atomics (reverse index, dq and dk/dv kernels) in Triton's CPU interpreter.

Tiny shapes, fp32 kernels against the fp64 torch selected branch (autograd) and the fp64 oracle
(nsa.reference): outputs and dq/dk/dv for G in {1, 2, 3, 4, 16}, Dk != Dv, -1 padding, empty rows, blocks
longer than one kernel tile, packed input with empty and length-1 sequences starting anywhere, repeated
blocks, blocks with several chunks (partials + reduce), bitwise equal repeated runs; the reverse index and the
work plan against Python-built ones, and the plan built only after the dq kernel's launch. dq/dk/dv are
poisoned (NaN) before the kernels run, so an element no kernel writes fails the test.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from .interp import kernel_modules

reverse_index, selection_bwd = kernel_modules("reverse_index", "selection_bwd",
                                              probe="selection_bwd._sel_bwd_dq_kernel")

from nsa import NSAConfig, nsa_reference  # noqa: E402
from nsa.branches.selected import naive  # noqa: E402
from nsa.kernels.triton.selection import sel_forward, selected_attention_triton  # noqa: E402

from .helpers import slow  # noqa: E402
from .test_triton_sel_interp import inputs, random_indices, selected_attention_torch  # noqa: E402

TOL = 1e-5  # fp32 kernel vs fp64: max |got - want| / max(1, max |want|)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(selection_bwd, "POISON_OUTPUTS", True)


def seq_start_of(lengths):
    cu = [0, *itertools.accumulate(lengths)]
    ss = torch.zeros(1, cu[-1], dtype=torch.long)
    for a, b in zip(cu, cu[1:]):
        ss[0, a:b] = a
    return ss, torch.tensor(cu, dtype=torch.int32)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item() if b.numel() else 0.0


def kernel_and_fp64(gen, q, k, v, idx, ss, ls):
    """Kernel (q's dtype) vs the fp64 torch selected branch: output and gradients. Returns the kernel's
    output, its gradients and the output gradient used."""
    out = selected_attention_triton(q, k, v, idx, ss, ls)
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), go.to(out.dtype))
    xd = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = selected_attention_torch(*xd, naive.dedupe_indices(idx), ss, ls)
    want = torch.autograd.grad(ref, xd, go)
    assert rel(out, ref) < TOL, ("o", rel(out, ref))
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), f"d{name} has NaN/inf (an element not written?)"
        assert rel(a, b) < TOL, (f"d{name}", rel(a, b))
    return out, got, go


# --- the reverse index and the work plan against Python ----------------------------------------------------


def python_reverse_index(idx, ss, ls):
    """{(b, h, global start token of the block): [query tokens ascending]} and {(b, s0): block length}."""
    B, T, H, n = idx.shape
    lists, lengths = {}, {}
    for b in range(B):
        for t in range(T):
            pos = t - int(ss[b, t])
            if pos % ls == 0:
                end = t
                while end + 1 < T and int(ss[b, end + 1]) == int(ss[b, t]) and end + 1 - t < ls:
                    end += 1
                lengths[(b, t)] = end - t + 1
            for h in range(H):
                for j in idx[b, t, h].tolist():
                    if j >= 0 and j * ls <= pos:
                        lists.setdefault((b, h, int(ss[b, t]) + j * ls), []).append(t)
    return lists, lengths


@pytest.mark.parametrize("lengths", [None, [0, 1, 13, 0, 9, 1, 20]])
def test_reverse_index_matches_python(gen, lengths):
    ls, H, n = 4, 2, 3
    if lengths is None:
        B, T = 2, 23
        ss = torch.zeros(B, T, dtype=torch.long)
    else:
        ss, _ = seq_start_of(lengths)
        B, T = ss.shape
    idx = random_indices(gen, ss, B, T, H, n, ls)
    idx[0, T // 2, 0, -1] = T  # a block after the query: fully masked, in no list
    rix = reverse_index.build_reverse_index(idx.to(torch.int32), ss.to(torch.int32), ls)
    lists, lengths_py = python_reverse_index(idx, ss, ls)
    off, qs = rix.offsets, rix.queries
    assert off.shape == (B * H * T + 1,) and off[0] == 0 and off[-1] == sum(map(len, lists.values()))
    for b, h, s0 in itertools.product(range(B), range(H), range(T)):
        key = (b * H + h) * T + s0
        assert qs[off[key]:off[key + 1]].tolist() == lists.get((b, h, s0), []), (b, h, s0)
    got_len = {(b, s): int(rix.block_len[b, s]) for b in range(B) for s in range(T) if rix.block_len[b, s] > 0}
    assert got_len == lengths_py


def test_work_plan_covers_each_entry_once(gen):
    ls, H, n, chunk = 4, 2, 3, 3
    ss, _ = seq_start_of([0, 1, 13, 0, 9, 1, 20])
    B, T = ss.shape
    idx = random_indices(gen, ss, B, T, H, n, ls, pad_prob=0.0)
    idx[0, :, :, 0] = torch.where(torch.arange(T) - ss[0] >= 0, 0, -1)[:, None]  # block 0 of each sequence: long lists
    idx = naive.dedupe_indices(idx)
    plan = selection_bwd.plan_backward(idx.to(torch.int32), ss.to(torch.int32), ls, chunk)
    rix = reverse_index.build_reverse_index(idx.to(torch.int32), ss.to(torch.int32), ls)
    lists, lengths = python_reverse_index(idx, ss, ls)
    items = plan.items[: int(plan.n_items)].tolist()
    sizes = [e - f for _, _, _, f, e, _ in items]
    assert sizes == sorted(sizes, reverse=True), "biggest chunks first"
    assert max(sizes) <= chunk
    seen = {}
    parts = []
    for bh, s0, blen, first, end, part in items:
        b, h = divmod(bh, H)
        assert blen == lengths[(b, s0)]
        seen.setdefault((b, h, s0), []).append((first, end, part))
    # every block has items (empty ones write zeros), every list is covered once, in order
    assert set(seen) == {(b, h, s) for (b, s) in lengths for h in range(H)}
    for key, chunks in seen.items():
        chunks.sort()
        toks = [t for f, e, _ in chunks for t in rix.queries[f:e].tolist()]
        assert toks == lists.get(key, [])
        if len(chunks) > 1:
            assert all(p >= 0 for _, _, p in chunks)
            parts += [p for _, _, p in chunks]
        else:
            assert chunks[0][2] == -1
    assert sorted(parts) == list(range(len(parts))) and len(parts) <= plan.n_partials_bound
    n_red = int(plan.n_reduce)
    assert n_red == sum(len(c) > 1 for c in seen.values()) > 0
    for bh, s0, _, p0, p1 in plan.reduce[:n_red].tolist():
        b, h = divmod(bh, H)
        assert sorted(p for _, _, p in seen[(b, h, s0)]) == list(range(p0, p1))


# --- gradients against fp64 ----------------------------------------------------------------------------------


# Dk = 48 and 40: two column tiles (32 + 16, the second full or masked), as the paper's 192 runs as 128 + 64
@pytest.mark.sample
@pytest.mark.parametrize("G,Dk,Dv", [slow(1, 16, 8), slow(2, 16, 16), (3, 8, 16),
                                     slow(4, 24, 8), (16, 16, 8), (2, 48, 16), slow(1, 40, 8)])
def test_grads_vs_fp64(gen, G, Dk, Dv):
    B, T, Hkv, ls, n = 1, 29, 2 if G < 16 else 1, 8, 3
    q, k, v = inputs(gen, B, T, Hkv, G, Dk, Dv)
    ss = torch.zeros(B, T, dtype=torch.long)
    idx = random_indices(gen, ss, B, T, Hkv, n, ls)
    idx[0, 9] = -1  # an empty row: output 0, no gradient
    idx[0, 20, 0] = torch.tensor([3, 1, 0])  # unsorted
    out, (dq, _, _), _ = kernel_and_fp64(gen, q, k, v, idx, ss, ls)
    assert (out[0, 9] == 0).all() and (dq[0, 9] == 0).all()


def test_several_chunks_per_block_and_bitwise_repeats(gen, monkeypatch):
    """Chunks of 3 queries: most blocks take the partials + reduce path. A second run: the same bits. Dk = 40:
    the partials of two column tiles, the second one masked."""
    monkeypatch.setattr(selection_bwd, "CHUNK_ROWS", 6)
    B, T, Hkv, G, ls = 1, 24, 1, 2, 8
    q, k, v = inputs(gen, B, T, Hkv, G, 40, 8)
    ss = torch.zeros(B, T, dtype=torch.long)
    idx = random_indices(gen, ss, B, T, Hkv, 3, ls, pad_prob=0.1)
    chunk = selection_bwd.bwd_config(G, 40, 8, ls, q.dtype, q.device)["chunk"]
    plan = selection_bwd.plan_backward(naive.dedupe_indices(idx).to(torch.int32), ss.to(torch.int32), ls, chunk)
    assert chunk == 3 and int(plan.n_reduce) >= 2, "the test must exercise the partials"
    _, first, go = kernel_and_fp64(gen, q, k, v, idx, ss, ls)
    again = torch.autograd.grad(selected_attention_triton(q, k, v, idx, ss, ls), (q, k, v), go.float())
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_block_longer_than_one_tile(gen, monkeypatch):
    """l' = 24 with 16-token tiles in both kernels: two sub-tiles per block, the second one half masked."""
    monkeypatch.setattr(selection_bwd, "DQ_MAX_BLOCK_N", 16)
    monkeypatch.setattr(selection_bwd, "DKDV_MAX_BLOCK_N", 16)
    monkeypatch.setattr(selection_bwd, "CHUNK_ROWS", 8)
    B, T, Hkv, G, ls = 1, 53, 1, 2, 24
    q, k, v = inputs(gen, B, T, Hkv, G, 16, 8)
    ss = torch.zeros(B, T, dtype=torch.long)
    kernel_and_fp64(gen, q, k, v, random_indices(gen, ss, B, T, Hkv, 2, ls, pad_prob=0.0), ss, ls)


def test_packed_with_empty_and_length_one_sequences(gen, monkeypatch):
    """Sequences start at tokens that are not multiples of l' (1, 13, 22, ...): block slots by start token.
    Outputs also against the oracle (nsa.reference, sel gate only, the same block indices)."""
    monkeypatch.setattr(selection_bwd, "CHUNK_ROWS", 8)
    ls, Hkv, G = 4, 2, 2
    ss, cu = seq_start_of([0, 1, 12, 0, 9, 1, 14])
    T = ss.shape[1]
    q, k, v = inputs(gen, 1, T, Hkv, G, 16, 8)
    cfg = NSAConfig(block_cmp=4, stride_cmp=4, block_sel=ls, n_sel=3, n_init=1, n_local=1, window=4)
    pos = torch.arange(T)[None] - ss
    idx = naive.top_n_blocks(torch.rand(1, T, Hkv, cfg.n_sel_blocks(T), generator=gen), pos, cfg)
    out, _, _ = kernel_and_fp64(gen, q, k, v, idx, ss, ls)
    gates = torch.zeros(1, T, Hkv * G, 3, dtype=torch.float64)
    gates[..., 1] = 1
    oracle = nsa_reference(q, k, v, gates, cfg, cu_seqlens=cu, block_indices=idx)
    assert rel(out, oracle.o_sel) < TOL


def test_repeated_blocks_count_once(gen):
    """Direct callers may name a block twice ([0, 2, 2]): counted once, as in the reference."""
    B, T, Hkv, G, ls = 1, 30, 1, 2, 8
    q, k, v = inputs(gen, B, T, Hkv, G, 16, 16)
    ss = torch.zeros(B, T, dtype=torch.long)
    pos = torch.arange(T)
    idx = torch.stack([torch.zeros_like(pos), (pos // ls).clamp(max=2), (pos // ls).clamp(max=2)], -1)
    idx = idx[None, :, None, :].expand(B, T, Hkv, 3).clone()
    idx[0, 25, 0] = torch.tensor([1, 1, 1])
    out, _, _ = kernel_and_fp64(gen, q, k, v, idx, ss, ls)  # against the deduplicated fp64 branch
    unique = torch.where(idx[..., 2:] == idx[..., 1:2], -1, idx[..., 2:])
    once = selected_attention_triton(q, k, v, torch.cat([idx[..., :2], unique], -1), ss, ls)
    torch.testing.assert_close(out, once, rtol=0, atol=0)
    gates = torch.zeros(B, T, Hkv * G, 3, dtype=torch.float64)
    gates[..., 1] = 1
    cfg = NSAConfig(block_cmp=8, stride_cmp=8, block_sel=ls, n_sel=3, n_init=1, n_local=1, window=8)
    assert rel(out, nsa_reference(q, k, v, gates, cfg, block_indices=idx).o_sel) < TOL


def test_no_atomics_left_in_the_selection_kernels():
    import inspect

    from nsa.kernels.triton import selection

    for mod in (selection, selection_bwd, reverse_index):
        assert "tl.atomic" not in inspect.getsource(mod), mod.__name__


def test_work_plan_is_built_after_the_dq_launch(gen, monkeypatch):
    """The dq kernel is yielded (and so launched) before the reverse index and the work plan are built: their
    small device operations then queue behind it instead of delaying it."""
    built = []
    plan = selection_bwd.plan_backward
    monkeypatch.setattr(selection_bwd, "plan_backward", lambda *a: built.append(1) or plan(*a))
    B, T, Hkv, G, ls = 1, 20, 1, 2, 8
    q, k, v = (x.detach() for x in inputs(gen, B, T, Hkv, G, 16, 16))
    ss = torch.zeros(B, T, dtype=torch.int32)
    idx = random_indices(gen, ss, B, T, Hkv, 2, ls).to(torch.int32)
    o, lse = sel_forward(q, k, v, idx, ss, ls, 0.25)
    _, launches = selection_bwd.backward_launches(torch.randn_like(o), q, k, v, o, lse, idx, ss, ls, 0.25)
    assert next(launches)[0] is selection_bwd._sel_bwd_dq_kernel and not built
    assert [x[0] for x in launches] == [selection_bwd._sel_bwd_dkdv_kernel, selection_bwd._sel_bwd_reduce_kernel]
    assert built == [1]
