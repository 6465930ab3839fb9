"""The paged decode cache (nsa.PagedNSACache) on the torch path: decode, chunked prefill, multi-token appends,
freed and reused rows, bad input. The Triton kernels on it: tests/cpu/test_decode_triton_interp.py.

Tiny shapes that cross page boundaries: pages of 4 tokens (smaller than a selection block of 8: one block
spans two pages), 8 (one block each) and 16 (two blocks each); pages handed out in a shuffled order.
"""

from __future__ import annotations

import pytest
import torch
from decode_cases import decode_all, expected, make_case, prefill_cache, prefill_paged_cache, rel_err

from nsa import NSAConfig, NSAInputError, PagedNSACache, nsa_attention, nsa_decode, nsa_prefill, telemetry

CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=20)


def _pages_in_order(cache) -> bool:
    return all(p == sorted(p) and (not p or p == list(range(p[0], p[0] + len(p))))
               for p in (cache.pages_of(b) for b in range(cache.batch)))


@pytest.mark.parametrize("page_size", [4, 8, 16])
def test_paged_decode_equals_contiguous_fp32(gen, page_size):
    # 0: the first page is taken by the first step; 23 -> window (20) wraps; 41: several pages
    case = make_case(gen, CFG, [0, 23, 41], 6, 4, 2, 8, 6, dtype=torch.float32)
    want, want_idx = expected(case)
    contiguous = decode_all(case, prefill_cache(case), "torch")
    paged = prefill_paged_cache(case, page_size, seed=page_size)
    assert not _pages_in_order(paged)
    got, idx = decode_all(case, paged, "torch")
    assert torch.equal(idx, contiguous[1]) and torch.equal(idx, want_idx)
    assert rel_err(got, contiguous[0]) <= 1e-5 and rel_err(got, want) <= 1e-5
    assert paged.cache_seqlens.tolist() == paged.host_seqlens() == [L + 6 for L in case.lengths]
    # every token of every sequence is where the block table says
    for b, L in enumerate(case.lengths):
        k, _ = paged.token_kv(b)
        a = case.cu_full[b]
        assert torch.equal(k, case.full["k"][0, a:a + L + 6])
    assert telemetry.served("sel")["torch"] >= 6


def test_paged_decode_bf16_close_to_contiguous(gen):
    case = make_case(gen, CFG, [13, 30], 4, 4, 2, 8, 8, dtype=torch.bfloat16)
    contiguous, c_idx = decode_all(case, prefill_cache(case), "torch")
    got, idx = decode_all(case, prefill_paged_cache(case, 4, seed=3), "torch")
    assert torch.equal(idx, c_idx)
    assert rel_err(got, contiguous) <= 1e-2


def test_freed_rows_are_reused_by_the_next_sequence(gen):
    """Row 1 ends; its pages go back to the pool; a new sequence fills row 1 (a packed prefill giving only it
    tokens) while rows 0 and 2 go on: every row's outputs equal the prefill of its own whole sequence."""
    old = make_case(gen, CFG, [9, 30, 17], 2, 4, 2, 8, 8, dtype=torch.float64)
    cache = prefill_paged_cache(old, 4, seed=1)
    decode_all(old, cache, "torch")
    freed = cache.pages_of(1)
    cache.free(1)
    assert cache.host_seqlens()[1] == 0 and cache.cache_seqlens.tolist()[1] == 0
    # the continuation: rows 0 and 2 go on with their sequences (their first 11 and 19 tokens are the old
    # ones), row 1 holds a new one of 13 tokens; then 3 decode steps
    new = make_case(gen, CFG, [11, 13, 19], 3, 4, 2, 8, 8, dtype=torch.float64)
    for name, x in new.full.items():
        for b in (0, 2):
            a, L = old.cu_full[b], old.lengths[b] + old.steps
            x[0, new.cu_full[b]:new.cu_full[b] + L] = old.full[name][0, a:a + L]
    f = new.full
    rows = torch.arange(new.cu_full[1], new.cu_full[1] + 13)
    cu = torch.tensor([0, 0, 13, 13], dtype=torch.int32)
    out = nsa_prefill(*(f[n][:, rows] for n in ("q", "k", "v", "g")), cache, cu_seqlens=cu)
    assert sorted(cache.pages_of(1)) == sorted(freed[:4])  # 13 tokens: 4 pages, the ones row 1 gave back
    whole = nsa_attention(f["q"], f["k"], f["v"], f["g"], CFG, cu_seqlens=torch.tensor(new.cu_full, dtype=torch.int32),
                          backend="torch")
    assert rel_err(out[0], whole[0, rows]) <= 1e-12
    want, want_idx = expected(new)
    got, idx = decode_all(new, cache, "torch")
    assert torch.equal(idx, want_idx) and rel_err(got, want) <= 1e-12


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_chunked_prefill_and_multi_token_appends_equal_one_prefill(gen, paged):
    """A prompt in dense chunks of 5, 11, 1 tokens, a ragged packed chunk, then 3-token appends (the verify
    step of speculative decoding) and a plain decode step: every output as one prefill of the whole."""
    case = make_case(gen, CFG, [0, 0], 0, 4, 2, 8, 8, dtype=torch.float64, branch_kv=True)
    B, T = 2, 40
    full = {n: torch.randn(B, T, *x.shape[2:], generator=gen, dtype=torch.float64) for n, x in case.full.items()}
    full["g"] = full["g"].abs()
    want = nsa_attention(full["q"], full["k"], full["v"], full["g"], CFG, kv_cmp=(full["kc"], full["vc"]),
                         kv_win=(full["kw"], full["vw"]), backend="torch")
    if paged:
        cache = PagedNSACache(CFG, B, 40, 4, 10, 2, 8, 8, dtype=torch.float64)
        cache._free = torch.randperm(40, generator=gen).tolist()
    else:
        cache = prefill_cache(case, max_len=T)

    def part(a, e):
        x = {n: full[n][:, a:e] for n in full}
        return (x["q"], x["k"], x["v"], x["g"]), dict(kv_cmp=(x["kc"], x["vc"]), kv_win=(x["kw"], x["vw"]))

    got = []
    for a, e in ((0, 5), (5, 16), (16, 17)):
        args, kwargs = part(a, e)
        got.append(nsa_prefill(*args, cache, **kwargs))
    # ragged chunk, packed: row 0 gets 4 tokens (17..20), row 1 gets 6 (17..22)
    pk = {n: torch.cat([full[n][0:1, 17:21], full[n][1:2, 17:23]], 1) for n in full}
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    o = nsa_prefill(pk["q"], pk["k"], pk["v"], pk["g"], cache, cu_seqlens=cu, kv_cmp=(pk["kc"], pk["vc"]),
                    kv_win=(pk["kw"], pk["vw"]))
    assert rel_err(o[0, :4], want[0, 17:21]) <= 1e-12 and rel_err(o[0, 4:], want[1, 17:23]) <= 1e-12
    # row 0 catches up with two 1-token packed appends (row 1 gets none)
    one = torch.tensor([0, 1, 1], dtype=torch.int32)
    for s in (21, 22):
        pk = {n: full[n][0:1, s:s + 1] for n in full}
        o = nsa_prefill(pk["q"], pk["k"], pk["v"], pk["g"], cache, cu_seqlens=one,
                        kv_cmp=(pk["kc"], pk["vc"]), kv_win=(pk["kw"], pk["vw"]))
        assert rel_err(o[0], want[0, s:s + 1]) <= 1e-12
    for a, e in ((23, 26), (26, 29), (29, 39)):  # multi-token appends, across pages and selection blocks
        args, kwargs = part(a, e)
        got.append(nsa_prefill(*args, cache, **kwargs))
    args, kwargs = part(39, 40)
    got.append(nsa_decode(*args, cache, backend="torch", **kwargs))
    dense = torch.cat(got, 1)
    spans = [(0, 17), (23, 40)]
    assert rel_err(dense, torch.cat([want[:, a:e] for a, e in spans], 1)) <= 1e-12
    assert cache.host_seqlens() == [T, T] == cache.cache_seqlens.tolist()
    assert telemetry.served("cmp")["torch"] > 0


def test_engine_tables_are_validated(gen):
    cache = PagedNSACache(CFG, 2, 10, 4, 4, 2, 8, 8, dtype=torch.float64)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    ok = torch.tensor([[3, 7, -1, -1], [1, 2, -1, -1]], dtype=torch.int32)
    for table, seqlens, match in (
        (ok.long(), lens, "block_table must be an int32"),
        (ok, lens.long(), "cache_seqlens must be an int32"),
        (ok[:, :1], lens, "block_table is too short: row 0 holds 5 tokens"),
        (torch.zeros(2, 5, dtype=torch.int32), lens, r"block_table must have shape \[batch=2, n <= max_pages"),
        (torch.tensor([[3, 10], [1, 2]], dtype=torch.int32), lens, "block_table row 0 names page 10"),
        (torch.tensor([[3, -1], [1, 2]], dtype=torch.int32), lens, "too short: row 0 holds 5 tokens, which need 2"),
        (torch.tensor([[3, 7, -1, 4], [1, 2, -1, -1]], dtype=torch.int32), lens, "only -1 .padding. may follow"),
        (torch.tensor([[3, 1], [1, 2]], dtype=torch.int32), lens, "one page to two positions"),
        (ok, lens[:1], r"cache_seqlens must have shape \[batch=2\]"),
    ):
        with pytest.raises(NSAInputError, match=match):
            cache.load_tables(table, seqlens)
    cache.load_tables(ok, lens)
    assert cache.host_seqlens() == [5, 8] and cache.pages_of(1) == [1, 2]
    q, k, v = (torch.randn(2, 1, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    g = torch.rand(2, 1, 4, 3, generator=gen, dtype=torch.float64)
    # row 1 holds 8 tokens in 2 full pages: its next token needs a page the engine has not given
    with pytest.raises(NSAInputError, match="block_table is too short: row 1 needs 1 more page"):
        nsa_decode(q, k, v, g, cache)
    assert cache.host_seqlens() == [5, 8]


def test_engine_managed_pages(gen):
    """An engine gives every row's pages ahead (shuffled, -1 padded) through load_tables: prefill and decode
    write and read through them (the cache takes no page itself) and equal prefill of the whole sequences;
    a step past the pages given raises before writing."""
    case = make_case(gen, CFG, [5, 18], 3, 4, 2, 8, 8, dtype=torch.float64)
    cache = PagedNSACache(CFG, 2, 12, 4, 8, 2, 8, 8, dtype=torch.float64)
    perm = torch.randperm(12, generator=gen)
    table = torch.full((2, 8), -1, dtype=torch.int32)
    table[0, :2], table[1, :6] = perm[:2], perm[2:8]  # row 0: 8 tokens of room, row 1: 24
    cache.load_tables(table, torch.zeros(2, dtype=torch.int32))
    prefill_cache(case, cache=cache)
    want, want_idx = expected(case)
    got, idx = decode_all(case, cache, "torch")
    assert torch.equal(idx, want_idx) and rel_err(got, want) <= 1e-12
    assert cache.pages_of(0) == perm[:2].tolist() and cache.host_seqlens() == [8, 21]
    q, k, v = (torch.randn(2, 1, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    with pytest.raises(NSAInputError, match="block_table is too short: row 0 needs 1 more page"):
        nsa_decode(q, k, v, torch.rand(2, 1, 4, 3, generator=gen, dtype=torch.float64), cache)
    assert cache.host_seqlens() == [8, 21] == cache.cache_seqlens.tolist()


def test_bad_construction_and_pool_exhaustion(gen):
    for kwargs, match in ((dict(page_size=6), "page_size must be a power of two"),
                          (dict(page_size=2), "multiple of stride_cmp"),
                          (dict(num_pages=0), "num_pages must be a positive int")):
        args = dict(config=CFG, batch=2, num_pages=4, page_size=4, max_pages_per_seq=4, n_kv_heads=2, d_k=8, d_v=8)
        with pytest.raises(NSAInputError, match=match):
            PagedNSACache(**{**args, **kwargs})
    cache = PagedNSACache(CFG, 2, 3, 4, 4, 2, 8, 8, dtype=torch.float64)
    q, k, v = (torch.randn(2, 5, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    g = torch.rand(2, 5, 4, 3, generator=gen, dtype=torch.float64)
    with pytest.raises(NSAInputError, match="page pool exhausted: this write needs 4 new pages, 3 are free"):
        nsa_prefill(q, k, v, g, cache)
    assert cache.is_empty and cache.free_pages == 3
    with pytest.raises(NSAInputError, match="cache overflow"):
        nsa_prefill(*(torch.cat([x] * 4, 1) for x in (q, k, v, g)), cache)
    with pytest.raises(NSAInputError, match="rows must be row indices"):
        cache.free(2)


def test_reserve_takes_pages_ahead_and_decode_then_takes_none(gen):
    case = make_case(gen, CFG, [3, 6], 5, 4, 2, 8, 8, dtype=torch.float64)
    cache = prefill_paged_cache(case, 4, seed=2)
    cache.reserve(5)
    tables = [cache.pages_of(b) for b in range(2)]
    free = cache.free_pages
    want, want_idx = expected(case)
    got, idx = decode_all(case, cache, "torch")
    assert [cache.pages_of(b) for b in range(2)] == tables and cache.free_pages == free
    assert torch.equal(idx, want_idx) and rel_err(got, want) <= 1e-12


def test_serve_paged_example(capsys):
    """examples/serve_paged.py: continuous batching of 3 requests on 2 rows (a finished request's pages go to
    the next one) equals generating each request alone."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "serve_paged.py"
    spec = importlib.util.spec_from_file_location("serve_paged", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--requests", "3"]) == 0
    text = capsys.readouterr().out
    assert "every request equals its generation alone" in text
    reused = int(text.split(" pages reused")[0].rsplit(" ", 1)[1])
    assert reused > 0
