"""The Triton decode kernels in Triton's CPU interpreter (TRITON_INTERPRET=1), fp32 and fp16, tiny shapes.

(bf16 only on the GPU: the interpreter of triton 3.7 returns garbage from tl.dot on bf16 inputs.)

- ragged packed prefill + kernel decode steps equal the prefill of each whole sequence: identical blocks,
  outputs to 1e-5, at positions where a compressed block completes, the window wraps and a selection
  block starts, with the work split over several programs (compressed blocks, window slots, scoring
  chunks, selected blocks), Dk != Dv, head dims and group sizes that are not powers of two;
- mathematically equal scores: bitwise-equal scores and the prefill's (lower-index) choice;
- compress="mlp" and separate K/V per branch; the tiny model generating through the kernels;
- decode steps after drafts were appended and truncated (speculative decoding), both caches;
- the launcher: five launches, no host synchronisation, no allocation with out=; a step that dies after
  the append kernel leaves the cache consistent; routing and telemetry.
Skipped with the reason when triton does not import.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from .interp import kernel_modules

(kd,) = kernel_modules("decode", probe="decode._append_kernel")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from decode_cases import (  # noqa: E402
    all_events,
    decode_all,
    decode_rows,
    expected,
    make_case,
    make_spec_case,
    prefill_cache,
    prefill_paged_cache,
    rel_err,
    run_spec,
)
from torch.overrides import TorchFunctionMode  # noqa: E402

from nsa import (  # noqa: E402
    NSACache,
    NSAConfig,
    PagedNSACache,
    nsa_decode,
    nsa_prefill,
    nsa_reference,
    plan,  # noqa: E402
    telemetry,
)
from nsa.model.llama_block_nsa import TinyNSALM  # noqa: E402

# window 40 > 16 keys per tile: three window programs; selection blocks of 8, four of them per query
CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=40)
EVENTS = {"cmp_block_completes", "window_wraps", "sel_block_starts"}


@pytest.fixture(autouse=True)
def _interp(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("NSA_USE_TRITON_DECODE", raising=False)
    # tiles of 16 keys, scoring chunks of 4 blocks: several programs per branch even on tiny shapes; the
    # combine loads 2 partials at a time, so merging 3 or more folds loaded chunks into a running softmax
    monkeypatch.setattr(kd, "TUNING", kd.Tuning(target_programs=64, block_n=16, chunk_j=4, min_tiles=1, part_chunk=2))
    telemetry.reset()
    saved = (plan.TRITON["decode"].capability, plan.TRITON["decode"].allow_cpu)
    yield
    plan.TRITON["decode"].capability, plan.TRITON["decode"].allow_cpu = saved


def _check_case(case, *, max_len=None, tol=1e-5):
    cache = prefill_cache(case, max_len=max_len)
    want, want_idx = expected(case)
    got, idx = decode_all(case, cache, "triton")
    assert torch.equal(idx, want_idx)
    assert torch.isfinite(got).all() and rel_err(got, want) <= tol
    assert cache.cache_seqlens.tolist() == cache.host_seqlens() == [L + case.steps for L in case.lengths]
    return cache, idx


@pytest.mark.parametrize("window_with_sel, uneven, early", [(True, False, False), (False, True, False),
                                                           (False, False, True)],
                         ids=["window_in_sel_launch", "window_in_cmp_launch-uneven_cmp_shares", "early_combine"])
def test_kernels_ragged_decode_equals_prefill(gen, monkeypatch, window_with_sel, uneven, early):
    # 0 -> first blocks; 37 -> window wraps at 40, block at 39, selection block at 40; 70 -> 2 compressed splits
    # uneven: 49 compressed slots in 2 shares of 28 (cmp_align 4): the second tile of the first share is masked
    # early: the combine merges the compressed and window partials before it waits for the selection's
    extra = dict(cmp_align=4, target_cmp=12) if uneven else {}
    monkeypatch.setattr(kd, "TUNING", dataclasses.replace(kd.TUNING, window_with_sel=window_with_sel,
                                                          early_combine=early, **extra))
    case = make_case(gen, CFG, [0, 37, 70], 5, 4, 2, 16, 24, dtype=torch.float32)
    cache, _ = _check_case(case, max_len=200 if uneven else None)
    ws = kd.workspace_for(cache, 4)
    assert ws.n_split_cmp >= 2 and ws.n_split_win >= 3 and ws.n_chunks >= 3 and ws.n_split_sel >= 2
    assert ws.CHUNK_WIN == 2  # the window's 3+ partials merge in two loads: the running sum is rescaled
    assert ws.window_with_sel is window_with_sel
    if uneven:
        assert ws.blocks_per_split % ws.BLOCK_N != 0
    assert EVENTS <= all_events(case, cache)
    assert telemetry.served("sel")["triton_decode"] == 5


def test_kernels_fp16(gen):
    """The 16-bit path (bf16 on the GPU takes the same code): blocks as prefill on most rows, outputs close."""
    case = make_case(gen, CFG, [6, 45], 4, 4, 2, 16, 16, dtype=torch.float16)
    cache = prefill_cache(case)
    want, want_idx = expected(case)
    got, idx = decode_all(case, cache, "triton")
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    same = (idx == want_idx).all(dim=-1).all(dim=-1)
    assert same.float().mean() >= 0.85
    assert rel_err(got[same], want[same]) <= 5e-3


def test_kernels_odd_group_and_head_dims(gen):
    # no forced local block: the token's own block competes on its score like the others
    cfg = CFG.with_(window=12, n_sel=3, n_local=0)
    case = make_case(gen, cfg, [9, 23], 4, 5, 1, 12, 20, dtype=torch.float32)
    _check_case(case)


def test_kernels_selection_blocks_of_three_strides(gen):
    # l' / d = 3, not a power of two: the scoring kernel sums each block's compressed blocks one offset at a
    # time (the contiguous tile applies where l' / d is a power of two)
    cfg = CFG.with_(block_sel=12, window=16)
    case = make_case(gen, cfg, [11, 50], 4, 4, 2, 16, 16, dtype=torch.float32)
    _check_case(case)


def test_kernels_mlp_compression_and_branch_kv(gen):
    cfg = CFG.with_(compress="mlp", window=12)
    w = torch.randn(cfg.block_cmp, generator=gen)
    phi = (lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)),
           lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)).cos())
    case = make_case(gen, cfg, [6, 19], 4, 4, 2, 16, 16, dtype=torch.float32, branch_kv=True, compress_fn=phi)
    _check_case(case)


@pytest.mark.parametrize("tie", ["zero_q", "identical_blocks"])
def test_equal_scores_are_bitwise_equal_and_ties_go_to_the_lower_block(gen, tie):
    """q = 0, or every compressed key identical (constant keys in exact binary fractions): every full block
    scores the same; the kernels must give them bitwise-equal scores and pick what prefill and the oracle pick."""
    case = make_case(gen, CFG, [44, 61], 3, 4, 2, 16, 16, dtype=torch.float32, zero_q=tie == "zero_q")
    if tie == "identical_blocks":
        pattern = torch.tensor([0.5, -1.0, 0.25, 1.0] * 4)
        case.full["k"][:] = pattern
    cache, idx = _check_case(case)  # the prefill's blocks
    ws = kd.workspace_for(cache, 4)
    for b, L in enumerate(case.lengths):
        t = L + case.steps - 1
        # blocks 1 .. whose overlapping compressed blocks (2j-1 .. 2j+1) are all visible at the last step
        full_blocks = ws.scores[b * 2:(b + 1) * 2, 1:(t - CFG.block_cmp + 1) // CFG.block_sel]
        assert full_blocks.shape[1] >= 3
        assert (full_blocks == full_blocks[:, :1]).all(), "equal blocks got different scores"
    f = case.full
    ref = nsa_reference(f["q"], f["k"], f["v"], f["g"], CFG, cu_seqlens=torch.tensor(case.cu_full, dtype=torch.int32))
    assert torch.equal(idx, torch.stack([ref.indices[0, r] for r in decode_rows(case)], dim=1))


@pytest.mark.sample
def test_tiny_model_generates_through_the_kernels():
    torch.manual_seed(0)
    cfg = CFG.with_(window=8)
    model = TinyNSALM(32, 16, 1, 4, 2, 8, 8, cfg, decode_backend="triton").eval()
    prompt = torch.randint(0, 32, (2, 11))
    out, logits = model.generate(prompt, 4, return_logits=True)
    ref, ref_logits = model.generate_uncached(prompt, 4, return_logits=True)
    assert torch.equal(out, ref)
    assert rel_err(logits, ref_logits) <= 1e-5
    assert telemetry.served("cmp")["triton_decode"] == 3


# --- the launcher ----------------------------------------------------------------------------------------

KERNELS = ("_append_kernel", "_cmp_win_kernel", "_score_topk_kernel", "_sel_kernel", "_combine_kernel")


class _Recorder:
    def __init__(self, name, log, real=None, fail=False):
        self.name, self.log, self.real, self.fail = name, log, real, fail

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, grid))
            if self.fail:
                raise RuntimeError(f"injected failure in {self.name}")
            if self.real is not None:
                return self.real[grid](*args, **kwargs)
        return launch


class _Watch(TorchFunctionMode):
    SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"}
    ALLOC = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "full_like", "tensor", "arange", "clone",
             "contiguous", "to", "new_empty", "new_zeros", "new_full"}

    def __init__(self):
        super().__init__()
        self.syncs, self.allocs = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCS:
            self.syncs.append(name)
        if name in self.ALLOC:
            self.allocs.append(name)
        return func(*args, **(kwargs or {}))


def test_launcher_five_launches_no_sync_no_allocation(gen, monkeypatch):
    case = make_case(gen, CFG, [5, 20], 2, 4, 2, 16, 16, dtype=torch.float32)
    cache = prefill_cache(case, max_len=30)
    log = []
    for name in KERNELS:
        monkeypatch.setattr(kd, name, _Recorder(name, log))  # launches recorded, nothing runs
    f, row = case.full, decode_rows(case)[0]
    args = [f[n][0, row][:, None] for n in "qkvg"]
    out = torch.empty(2, 1, 4, 16)
    nsa_decode(*args, cache, backend="triton", out=out)  # first step: makes the workspace
    log.clear()
    with _Watch() as watch:
        res = nsa_decode(*args, cache, backend="triton", out=out)
    assert res is out
    assert [n for n, _ in log] == list(KERNELS)
    assert watch.syncs == [] and watch.allocs == []


def test_failure_after_the_append_kernel_leaves_the_cache_consistent(gen, monkeypatch):
    case = make_case(gen, CFG, [13, 30], 3, 4, 2, 16, 16, dtype=torch.float32)
    cache = prefill_cache(case)
    want, want_idx = expected(case)
    log = []
    real = kd._score_topk_kernel
    monkeypatch.setattr(kd, "_score_topk_kernel", _Recorder("_score_topk_kernel", log, fail=True))
    f, row = case.full, decode_rows(case)[0]
    with pytest.raises(RuntimeError, match="injected"):
        nsa_decode(*(f[n][0, row][:, None] for n in "qkvg"), cache, backend="triton")
    assert cache.cache_seqlens.tolist() == [13, 30] and cache.host_seqlens() == [13, 30]
    monkeypatch.setattr(kd, "_score_topk_kernel", real)
    got, idx = decode_all(case, cache, "triton")
    assert torch.equal(idx, want_idx) and rel_err(got, want) <= 1e-5


def test_auto_routes_to_the_kernels_when_they_can_run(gen):
    plan.TRITON["decode"].allow_cpu = True
    case = make_case(gen, CFG, [3, 9], 1, 4, 2, 16, 16, dtype=torch.float32)
    cache = prefill_cache(case)
    telemetry.reset()
    decode_all(case, cache, "auto")
    counts = {(r["branch"], r["backend"], r["reason"]): r["calls"] for r in telemetry.snapshot()["counts"]}
    assert counts == {(b, "triton_decode", "ok"): 1 for b in ("cmp", "sel", "win")}


@triton.jit
def _merge_probe(CAND, OUT, t, n_cand, BLOCK_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                 N_SEL: tl.constexpr, N_PAD: tl.constexpr, NC_PAD: tl.constexpr):
    srt = kd._merge_candidates(CAND, 0, t, n_cand, BLOCK_SEL, N_INIT, N_LOCAL, N_SEL, N_PAD, NC_PAD)
    rk = tl.arange(0, N_PAD)
    tl.store(OUT + rk, srt, mask=rk < N_SEL)


@pytest.mark.parametrize("n_sel,n_init,n_local,n_chunks", [(16, 1, 2, 17), (7, 0, 0, 5), (13, 2, 3, 3), (4, 1, 1, 1)])
def test_candidate_merge_takes_the_forced_blocks_and_the_best_keys(n_sel, n_init, n_local, n_chunks):
    # Each chunk's candidates: its best n - n_init - n_local keys in descending order, -1 padded (what the
    # scoring kernel writes: no step selects more free blocks); equal scores across chunks break ties by block
    # index inside the key. The merge must give the forced blocks plus the best `need` free blocks of all the
    # chunks (not only of what they wrote), ascending, -1 padded.
    gen = torch.Generator().manual_seed(n_sel * 100 + n_chunks)
    block_sel, cj = 64, 8
    k_free = kd.max_free_blocks(n_sel, n_init, n_local)  # the workspace's K_FREE
    for t in (0, 70, 5 * 64 + 3, 40 * 64 + 63):
        jt = t // block_sel
        forced = sorted(set(range(min(jt + 1, n_init))) | set(range(max(0, jt - n_local + 1), jt + 1)))
        lists, every = [], []
        for c in range(n_chunks):
            js = [j for j in range(c * cj, (c + 1) * cj) if j <= jt and j not in forced]
            score = torch.randint(0, 4, (len(js),), generator=gen).float() / 4  # many exact ties
            keys = [(int(torch.tensor(float(s)).view(torch.int32)) << 32) + (2**31 - 1 - j) for s, j in zip(score, js)]
            every += keys
            keys = sorted(keys, reverse=True)[:k_free]
            lists.append(keys + [-1] * (k_free - len(keys)))
        cand = torch.tensor(sum(lists, []), dtype=torch.int64)
        need = n_sel - len(forced)
        best = sorted(every, reverse=True)[:max(need, 0)]
        want = sorted(forced + [2**31 - 1 - (k & 0xFFFFFFFF) for k in best])
        want += [-1] * (n_sel - len(want))
        out = torch.full((n_sel,), -7, dtype=torch.int64)
        n_pad = max(2, 1 << (n_sel - 1).bit_length())
        _merge_probe[(1,)](cand, out, t, cand.numel(), BLOCK_SEL=block_sel, N_INIT=n_init, N_LOCAL=n_local,
                           N_SEL=n_sel, N_PAD=n_pad, NC_PAD=1 << (cand.numel() - 1).bit_length())
        assert out.tolist() == want, (t, out.tolist(), want)


def test_kernels_on_the_paged_cache(gen):
    """Paged cache (nsa.PagedNSACache), pages of 4 tokens (a selection block spans two) in shuffled order:
    blocks identical to the contiguous cache's kernels and to prefill, outputs to 1e-5; a freed row's pages
    go to the next sequence, whose steps on the kernels equal its prefill. (Pages of 8: the next test.)"""
    page_size = 4
    case = make_case(gen, CFG, [0, 37, 70], 5, 4, 2, 16, 24, dtype=torch.float32)
    want, want_idx = expected(case)
    c_out, c_idx = decode_all(case, prefill_cache(case), "triton")
    cache = prefill_paged_cache(case, page_size, seed=page_size)
    got, idx = decode_all(case, cache, "triton")
    assert torch.equal(idx, c_idx) and torch.equal(idx, want_idx)
    assert rel_err(got, c_out) <= 1e-5 and rel_err(got, want) <= 1e-5
    assert cache.cache_seqlens.tolist() == cache.host_seqlens() == [L + 5 for L in case.lengths]
    assert EVENTS <= all_events(case, cache)
    assert telemetry.served("sel")["triton_decode"] >= 10
    # row 2 ends; a new sequence (prompt 9) takes its pages, the others go on
    freed = cache.pages_of(2)
    cache.free(2)
    new = make_case(gen, CFG, [9], 4, 4, 2, 16, 24, dtype=torch.float32)
    f = new.full
    cu = torch.tensor([0, 0, 0, 9], dtype=torch.int32)
    nsa_prefill(*(f[n][:, :9] for n in ("q", "k", "v", "g")), cache, cu_seqlens=cu)
    assert cache.pages_of(2) == freed[:len(cache.pages_of(2))]
    want_new, want_new_idx = expected(new)
    for s in range(4):
        q, k, v = (torch.randn(3, 1, h, d, generator=gen) for h, d in ((4, 16), (2, 16), (2, 24)))
        gg = torch.rand(3, 1, 4, 3, generator=gen)
        for x, n in ((q, "q"), (k, "k"), (v, "v"), (gg, "g")):
            x[2, 0] = f[n][0, 9 + s]
        o, i = nsa_decode(q, k, v, gg, cache, backend="triton", return_indices=True)
        assert torch.equal(i[2, 0], want_new_idx[0, s])
        assert rel_err(o[2, 0], want_new[0, s]) <= 1e-5


def test_kernels_paged_fp16_mlp_and_branch_kv(gen):
    cfg = CFG.with_(compress="mlp", window=12)
    w = torch.randn(cfg.block_cmp, generator=gen)
    phi = (lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)),
           lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)).cos())
    case = make_case(gen, cfg, [6, 19], 4, 4, 2, 16, 16, dtype=torch.float16, branch_kv=True, compress_fn=phi)
    c_out, c_idx = decode_all(case, prefill_cache(case), "triton")
    got, idx = decode_all(case, prefill_paged_cache(case, 8, seed=5), "triton")
    assert torch.equal(idx, c_idx)
    assert rel_err(got, c_out) <= 2e-3


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kernels_after_a_truncate(gen, paged):
    """Drafts appended and truncated (none, some, all kept; window 12 and the compression ring wrapped by
    the drafts), then kernel decode steps: equal to one prefill of the kept sequences."""
    cfg = CFG.with_(window=12)
    case = make_spec_case(gen, cfg, [9, 14, 21], 5, [0, 1, 5], after=0, steps=4, Dk=16, Dv=24,
                          dtype=torch.float32)
    if paged:
        cache = PagedNSACache(cfg, 3, 30, 4, 8, 2, 16, 24, dtype=torch.float32)
    else:
        cache = NSACache(cfg, 3, 32, 2, 16, 24, dtype=torch.float32)
    pairs = run_spec(case, cache, backend="triton")
    for got, want in pairs:
        assert rel_err(got, want) <= 1e-5
    assert telemetry.served("sel")["triton_decode"] == 4


def test_programmatic_dependent_launch_is_planned_on_sm90_and_later_only(monkeypatch):
    from nsa.hooks import HOOKS
    from nsa.kernels.triton.decode import parts, workspace

    cpu = torch.device("cpu")
    assert not kd.pdl_supported(cpu)  # the interpreter: no launch options at all
    monkeypatch.setattr(HOOKS, "pretend_gpu", (8, 0))
    assert not kd.pdl_supported(cpu)
    monkeypatch.setattr(HOOKS, "pretend_gpu", (9, 0))
    assert kd.pdl_supported(cpu) is (parts.HAS_GDC and workspace._launch_pdl_option())


def test_early_combine_is_planned_where_the_combine_grid_is_small():
    # (early_combine, window_with_sel) for: PDL or not, combine programs, SMs
    auto = kd.Tuning()
    assert kd.plan_combine(auto, True, 64, 132) == (True, False)  # 64k x 1: the window moves to launch 2
    assert kd.plan_combine(auto, True, 264, 132) == (True, False)  # 2 per SM
    assert kd.plan_combine(auto, True, 265, 132) == (False, True)  # 64k x 8 has 512
    assert kd.plan_combine(auto, False, 64, 132) == (False, True)  # no PDL: nothing starts early
    assert kd.plan_combine(auto, True, 64, 0) == (False, True)  # the interpreter
    assert kd.plan_combine(kd.Tuning(window_with_sel=True), True, 64, 132) == (False, True)
    assert kd.plan_combine(kd.Tuning(early_combine=False), True, 64, 132) == (False, True)
    assert kd.plan_combine(kd.Tuning(early_combine=True), False, 9999, 132) == (True, False)
    with pytest.raises(ValueError, match="early_combine needs window_with_sel=False"):
        kd.plan_combine(kd.Tuning(early_combine=True, window_with_sel=True), True, 64, 132)
