"""Rolling back tokens (speculative decoding's rejected drafts): NSACache.truncate and PagedNSACache.truncate.

Every row: a prompt, k drafts appended in one write, truncated to the accepted ones (none, some, all k),
then more tokens in one write and decode steps; every output of a kept token equals one prefill of the
kept sequences, in fp64. Small blocks (block_cmp 8, stride 4) and window (12): the drafts complete
compressed blocks that need a dropped token and wrap both rings, so a truncate that only moved the lengths
would read dropped tokens. The Triton kernels after a truncate: tests/cpu/test_decode_triton_interp.py.
"""

from __future__ import annotations

import pytest
import torch
from decode_cases import make_case, make_spec_case, prefill_cache, rel_err, run_spec

from nsa import NSACache, NSAConfig, NSAInputError, PagedNSACache, nsa_prefill

CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=12)
# prompt 9 + 0 of 5: the block of tokens 4..11, completed by drafts, is dropped and made again;
# 14 + 1 -> 15: the block 8..15 lost its last token; 21 + 5: all kept (the row is a no-op)
PROMPTS, K, ACCEPTED = [9, 14, 21], 5, [0, 1, 5]


def _contiguous(case, dtype=torch.float64):
    return NSACache(case.cfg, case.batch, 48, 2, 8, 6, dtype=dtype)


def _paged(case, page_size=4, num_pages=40, seed=0):
    cache = PagedNSACache(case.cfg, case.batch, num_pages, page_size, 48 // page_size, 2, 8, 6, dtype=torch.float64)
    cache._free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    return cache


def _assert_all_equal(pairs, tol=1e-12):
    for i, (got, want) in enumerate(pairs):
        assert rel_err(got, want) <= tol, i


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("tensor_lengths", [False, True], ids=["list", "tensor"])
def test_drafts_truncated_equal_prefill_of_the_kept_sequences(gen, paged, tensor_lengths):
    case = make_spec_case(gen, CFG, PROMPTS, K, ACCEPTED, after=3, steps=3)
    cache = _paged(case) if paged else _contiguous(case)
    _assert_all_equal(run_spec(case, cache, tensor_lengths=tensor_lengths))


def test_mlp_compression_at_other_boundaries(gen):
    """Other lengths around block boundaries (12 + 6 drafts all kept; 16 -> 17 and 7 -> 8, whose next blocks
    need ring slots the drafts overwrote) and phi (compress="mlp") over the blocks made again."""
    cfg = CFG.with_(compress="mlp", window=8)
    w = torch.randn(cfg.block_cmp, generator=gen, dtype=torch.float64)
    phi = (lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)),
           lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)).sin())
    case = make_spec_case(gen, cfg, [12, 16, 7], 6, [6, 1, 1], after=2, steps=4)
    _assert_all_equal(run_spec(case, _contiguous(case), compress_fn=phi))


def test_truncate_to_zero_then_a_new_sequence(gen):
    case = make_spec_case(gen, CFG, [0, 0], 0, [0, 0], after=0, steps=0)
    cache = _contiguous(case)
    old = make_case(gen, CFG, [19, 26], 0, 4, 2, 8, 6)
    prefill_cache(old, cache=cache)
    cache.truncate([0, 0])
    assert cache.is_empty and cache.cache_seqlens.tolist() == [0, 0]
    # the empty cache takes new prompts as a fresh one (nsa_attention path), then drafts and decode
    case = make_spec_case(gen, CFG, [10, 13], 3, [1, 2], after=1, steps=2)
    _assert_all_equal(run_spec(case, cache))


def test_noop_truncate_changes_nothing(gen):
    case = make_case(gen, CFG, [17, 30], 0, 4, 2, 8, 6)
    cache = prefill_cache(case, max_len=40)
    saved = [x.clone() for x in (cache.k_sel, cache.k_win, cache.k_raw_cmp, cache.k_cmp, cache.cache_seqlens)]
    cache.truncate(cache.cache_seqlens.clone())
    cache.truncate([17, 30])
    for a, b in zip(saved, (cache.k_sel, cache.k_win, cache.k_raw_cmp, cache.k_cmp, cache.cache_seqlens)):
        assert torch.equal(a, b)
    assert cache.host_seqlens() == [17, 30]


@pytest.mark.parametrize("lengths,match", [
    ([3], r"lengths must be a list of batch=2 ints"),
    ([3, True], r"lengths must be a list of batch=2 ints"),
    ([3.0, 4], r"lengths must be a list of batch=2 ints"),
    ((x for x in (3, 4)), r"lengths must be a list of batch=2 ints"),
    ([-1, 4], r"lengths\[0\] = -1 must lie in \[0, 17\]"),
    ([3, 31], r"lengths\[1\] = 31 must lie in \[0, 30\] \(row 1's current length\)"),
    (torch.tensor([3.0, 4.0]), r"lengths must be an int32/int64 tensor of shape \[batch=2\]"),
    (torch.tensor([3, 4, 5]), r"lengths must be an int32/int64 tensor of shape \[batch=2\]"),
    (torch.tensor([3, 4], device="meta"), "lengths is on meta"),
    (torch.tensor([18, 4]), r"lengths\[0\] = 18"),
])
def test_bad_lengths_are_refused_and_change_nothing(gen, lengths, match):
    case = make_case(gen, CFG, [17, 30], 0, 4, 2, 8, 6)
    cache = prefill_cache(case, max_len=40)
    with pytest.raises(NSAInputError, match=match):
        cache.truncate(lengths)
    assert cache.cache_seqlens.tolist() == cache.host_seqlens() == [17, 30]


def test_branch_kv_rings_truncate_only_what_they_still_cover(gen):
    """Own kv_cmp / kv_win are kept only in the rings: a truncate they still cover goes through (short rows),
    one that needs overwritten ring tokens raises and changes nothing."""
    case = make_case(gen, CFG, [2, 5], 0, 4, 2, 8, 6, branch_kv=True)
    f = case.full
    cache = NSACache(CFG, 2, 40, 2, 8, 6, dtype=torch.float64)
    take = lambda x: x[:, :7]  # noqa: E731  (row 0's 2 and row 1's 5 tokens, packed)
    nsa_prefill(*(take(f[n]) for n in "qkvg"), cache, cu_seqlens=torch.tensor([0, 2, 7], dtype=torch.int32),
                **case.branch_kv(take))
    assert cache.rings_hold_raw == {"cmp": False, "win": False}
    kv = {n: torch.randn(2, 3, 2, 8 if n[0] == "k" else 6, generator=gen, dtype=torch.float64)
          for n in ("k", "v", "kc", "vc", "kw", "vw")}
    q, g = torch.randn(2, 3, 4, 8, generator=gen, dtype=torch.float64), torch.rand(2, 3, 4, 3, generator=gen,
                                                                                     dtype=torch.float64)
    nsa_prefill(q, kv["k"], kv["v"], g, cache, kv_cmp=(kv["kc"], kv["vc"]), kv_win=(kv["kw"], kv["vw"]))
    win_before = cache.k_win.clone()
    cache.truncate([4, 6])  # 5 and 8 tokens held: every ring still covers what the rows keep
    assert torch.equal(cache.k_win, win_before) and cache.host_seqlens() == [4, 6]
    # fill row 1 past its compression ring (8 slots) with more tokens, then ask for a dropped one's slot back
    more = {n: torch.cat([x, x, x], 1) for n, x in kv.items()}
    nsa_prefill(torch.cat([q] * 3, 1), more["k"], more["v"], torch.cat([g] * 3, 1), cache,
                kv_cmp=(more["kc"], more["vc"]), kv_win=(more["kw"], more["vw"]))  # 13 and 15 tokens
    with pytest.raises(NSAInputError, match=r"lengths\[0\] = 5: row 0 needs the kv_win K/V of positions"):
        cache.truncate([5, 15])
    assert cache.host_seqlens() == [13, 15] and cache.cache_seqlens.tolist() == [13, 15]
    cache.truncate([13, 15])  # a no-op needs nothing


@pytest.mark.parametrize("page_size", [4, 8])
def test_paged_pages_past_the_new_length_return_to_the_pool(gen, page_size):
    case = make_spec_case(gen, CFG, [9, 14], 8, [0, 3], after=0, steps=0)
    cache = _paged(case, page_size, num_pages=48 // page_size * 2, seed=page_size)
    before = []
    _assert_all_equal(run_spec(case, cache, on_drafts=lambda c: before.extend(c.pages_of(b) for b in range(2))))
    held = [cache.pages_of(b) for b in range(2)]
    kept = [-(-n // page_size) for n in (9, 17)]
    assert [len(p) for p in held] == kept
    assert all(p[:len(h)] == h for p, h in zip(before, held))  # the prompt's pages stay where they were
    assert cache.free_pages == cache.num_pages - sum(kept)
    # row 0 drops everything: its pages go back and row 1's next tokens take them (last given back first)
    given_back = held[0]
    cache.truncate([0, 17])
    assert cache.pages_of(0) == [] and cache.free_pages == cache.num_pages - kept[1]
    cache._free = [p for p in cache._free if p not in given_back] + given_back  # only row 0's pages are next
    k = torch.randn(1, 2 * page_size, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2 * page_size, 2, 6, generator=gen, dtype=torch.float64)
    cache.write(k, v, cu_seqlens=torch.tensor([0, 0, 2 * page_size], dtype=torch.int32))
    assert set(cache.pages_of(1)[kept[1]:]) <= set(given_back)
    tok, _ = cache.token_kv(1)
    assert torch.equal(tok[17:], k[0])


def test_paged_engine_tables_stay_as_they_are(gen):
    case = make_case(gen, CFG, [6, 11], 0, 4, 2, 8, 6)
    cache = PagedNSACache(CFG, 2, 16, 4, 6, 2, 8, 6, dtype=torch.float64)
    cache.load_tables(torch.tensor([[5, 2, 9, -1], [0, 3, 7, 1]], dtype=torch.int32),
                      torch.tensor([0, 0], dtype=torch.int32))
    prefill_cache(case, cache=cache)
    cache.truncate([1, 3])
    assert cache.pages_of(0) == [5, 2, 9] and cache.pages_of(1) == [0, 3, 7, 1] and cache.free_pages == 0
    assert cache.block_table[:, :4].tolist() == [[5, 2, 9, -1], [0, 3, 7, 1]]
