"""Appending k tokens per row to a non-empty cache (nsa_prefill; speculative decoding's verify step) as k
decode steps on the Triton decode kernels, in Triton's CPU interpreter (TRITON_INTERPRET=1), fp32.

- the same k for every row (dense [B, k] or packed with equal lengths), both caches, ragged cached lengths,
  k = 1 and 3 (3: crossing a compressed-block completion, page boundaries and a selection block's start):
  outputs equal the torch append and one prefill of the whole sequences (1e-5), and decode steps after
  the append still equal the prefill; telemetry names the kernels and the route;
- compress="mlp" with the branches' own K/V, as the decode step takes them;
- speculative decoding: drafts appended on the kernels, truncated, then more tokens and decode steps;
- ragged k (and a row without new tokens) stays on the torch append, reported as such; backend= is
  respected (torch, a prefill provider, triton forced); bad input raises before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from .interp import kernel_modules

(kd,) = kernel_modules("decode", probe="decode._append_kernel")

from decode_cases import (  # noqa: E402
    decode_rows,
    events,
    expected,
    make_case,
    make_spec_case,
    prefill_cache,
    prefill_paged_cache,
    rel_err,
    run_spec,
)

from nsa import NSAConfig, NSAInputError, PagedNSACache, nsa_decode, nsa_prefill, plan, telemetry  # noqa: E402

from .helpers import slow  # noqa: E402

# window 12: the window ring wraps within the prompts; pages of 4 tokens (half a selection block)
CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=12)
PAGE = 4
NAMES = ("q", "k", "v", "g")


@pytest.fixture(autouse=True)
def _kernels_on_cpu(monkeypatch):
    """backend="auto" takes the decode kernels on CPU tensors (in the interpreter), as it does on CUDA."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("NSA_USE_TRITON_DECODE", raising=False)
    monkeypatch.setattr(kd, "TUNING", kd.Tuning(target_programs=64, block_n=16, chunk_j=4, min_tiles=1, part_chunk=2))
    saved = (plan.TRITON["decode"].capability, plan.TRITON["decode"].allow_cpu)
    plan.TRITON["decode"].allow_cpu = True
    telemetry.reset()
    yield
    plan.TRITON["decode"].capability, plan.TRITON["decode"].allow_cpu = saved


def _cache(case, paged):
    return prefill_paged_cache(case, PAGE, seed=3) if paged else prefill_cache(case)


def _new_tokens(case, n, packed=False):
    """The case's first n decoded tokens of every row: dense [B, n, ...] (q, k, v, g and the branch K/V),
    or packed [1, B * n, ...] with cu_seqlens."""
    rows = torch.stack(decode_rows(case)[:n], dim=1)  # [B, n] packed rows of the whole sequences
    take = (lambda x: x[0, rows.flatten()][None]) if packed else (lambda x: x[0, rows])
    f = case.full
    args = [take(f[n_]) for n_ in NAMES]
    kw = dict(compress_fn=case.compress_fn, **case.branch_kv(take))
    if packed:
        kw["cu_seqlens"] = torch.arange(0, case.batch * n + 1, n, dtype=torch.int32)
    return args, kw


def _append(case, cache, n, backend="auto", packed=False):
    args, kw = _new_tokens(case, n, packed)
    out = nsa_prefill(*args, cache, backend=backend, **kw)
    return out.unflatten(1, (case.batch, n))[0] if packed else out


def _route():
    events = {e["event"]: e["calls"] for e in telemetry.snapshot()["events"] if e["backend"] == "append"}
    counts = {(r["branch"], r["backend"], r["reason"]): r["calls"] for r in telemetry.snapshot()["counts"]}
    return events, counts


def _decode_rest(case, cache, first):
    """nsa_decode (kernels) for the case's tokens from `first` on: [B, steps - first, Hq, Dv]."""
    f, outs = case.full, []
    for row in decode_rows(case)[first:]:
        outs.append(nsa_decode(*(f[n][0, row][:, None] for n in NAMES), cache, backend="triton",
                               compress_fn=case.compress_fn,
                               **case.branch_kv(lambda x, row=row: x[0, row][:, None]))[:, 0])
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("k", [slow(1), 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_equal_k_appends_as_kernel_steps(gen, paged, k):
    # cached 5, 18, 30 (ragged): k = 3 completes a compressed block at 7, starts new pages at 20 and 32 and
    # starts a selection block at 32; two decode steps follow the append
    case = make_case(gen, CFG, [5, 18, 30], k + 2, 4, 2, 16, 24, dtype=torch.float32)
    want, _ = expected(case)
    cache, ref = _cache(case, paged), _cache(case, paged)
    telemetry.reset()
    got = _append(case, cache, k)
    assert _route() == ({"decode_steps": 1}, {(b, "triton_decode", "ok"): 1 for b in ("cmp", "sel", "win")})
    assert cache.cache_seqlens.tolist() == cache.host_seqlens() == [L + k for L in case.lengths]
    torch_out = _append(case, ref, k, backend="torch")
    assert got.shape == torch_out.shape == want[:, :k].shape
    assert rel_err(got, want[:, :k]) <= 1e-5 and rel_err(got, torch_out) <= 1e-5
    assert rel_err(_decode_rest(case, cache, k), want[:, k:]) <= 1e-5
    if k == 3:  # within the appended tokens
        appended = [[L + j for j in range(k)] for L in case.lengths]
        assert set().union(*(events(CFG, p, cache.window_slots) for p in appended)) == {
            "cmp_block_completes", "window_wraps", "sel_block_starts"}
        assert sum(any(p % PAGE == 0 for p in row) for row in appended) == 2  # tokens 20 and 32 start pages


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_packed_equal_lengths_append_as_kernel_steps(gen, paged):
    """cu_seqlens with 3 tokens for every row: the steps, and the output in the packed layout [1, B * 3]."""
    case = make_case(gen, CFG, [6, 21], 4, 4, 2, 16, 24, dtype=torch.float32)
    want, _ = expected(case)
    cache = _cache(case, paged)
    telemetry.reset()
    got = _append(case, cache, 3, packed=True)
    assert _route()[0] == {"decode_steps": 1}
    assert rel_err(got, want[:, :3]) <= 1e-5
    assert rel_err(_decode_rest(case, cache, 3), want[:, 3:]) <= 1e-5


def test_mlp_compression_and_branch_kv(gen):
    cfg = CFG.with_(compress="mlp")
    w = torch.randn(cfg.block_cmp, generator=gen)
    phi = (lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)),
           lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)).cos())
    case = make_case(gen, cfg, [6, 19], 4, 4, 2, 16, 16, dtype=torch.float32, branch_kv=True, compress_fn=phi)
    want, _ = expected(case)
    cache = _cache(case, paged=True)
    got = _append(case, cache, 3)
    assert _route()[0] == {"decode_steps": 1}
    assert rel_err(got, want[:, :3]) <= 1e-5
    assert rel_err(_decode_rest(case, cache, 3), want[:, 3:]) <= 1e-5


def test_verify_step_drafts_on_the_kernels_then_truncate(gen):
    """Speculative decoding on the paged cache: 5 drafts per row appended on the kernels, truncated to the
    accepted ones (none, some, all), 2 tokens appended, then decode steps: equal to one prefill of the kept
    sequences."""
    case = make_spec_case(gen, CFG, [9, 14, 21], 5, [0, 1, 5], after=2, steps=2, Dk=16, Dv=24,
                          dtype=torch.float32)
    cache = PagedNSACache(CFG, 3, 30, PAGE, 8, 2, 16, 24, dtype=torch.float32)
    for got, want in run_spec(case, cache, backend="triton"):
        assert rel_err(got, want) <= 1e-5
    assert _route()[0] == {"decode_steps": 2}  # the drafts, and the 2 tokens after the truncate


@pytest.mark.parametrize("news", [[2, 3, 1], [0, 2, 2]], ids=["ragged_k", "a_row_without_tokens"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_ragged_k_stays_on_the_torch_append(gen, paged, news):
    case = make_case(gen, CFG, [5, 18, 29], 3, 4, 2, 16, 24, dtype=torch.float32)
    want, _ = expected(case)
    cache = _cache(case, paged)
    rows = torch.cat([r[:n] for r, n in zip(torch.stack(decode_rows(case), dim=1), news)])
    cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    with pytest.raises(NSAInputError, match="backend='triton' cannot run this append: rows get"):
        nsa_prefill(*(case.full[n][:, rows] for n in NAMES), cache, cu_seqlens=cu, backend="triton")
    assert cache.host_seqlens() == case.lengths
    telemetry.reset()
    out = nsa_prefill(*(case.full[n][:, rows] for n in NAMES), cache, cu_seqlens=cu)
    assert _route() == ({"torch_ragged": 1}, {(b, "torch", "decode"): 1 for b in ("cmp", "sel", "win")})
    assert telemetry.snapshot()["fallbacks"] == 0
    assert rel_err(out[0], torch.cat([want[b, :n] for b, n in enumerate(news)])) <= 1e-5
    assert cache.host_seqlens() == [L + n for L, n in zip(case.lengths, news)]


@pytest.mark.sample
@pytest.mark.parametrize("backend,route,reason", [("torch", "torch_planned", "forced"),
                                                  ("sdpa", "torch_backend", "forced"),
                                                  ("triton", "decode_steps", "forced")])
def test_backend_is_respected(gen, backend, route, reason):
    case = make_case(gen, CFG, [5, 18], 2, 4, 2, 16, 24, dtype=torch.float32)
    want, _ = expected(case)
    cache = prefill_cache(case)
    telemetry.reset()
    got = _append(case, cache, 2, backend=backend)
    served = "triton_decode" if route == "decode_steps" else "torch"
    assert _route() == ({route: 1}, {(b, served, reason): 1 for b in ("cmp", "sel", "win")})
    assert rel_err(got, want) <= 1e-5


def test_the_torch_step_planned_keeps_the_torch_append(gen, monkeypatch):
    """The decode step's own guards decide (here NSA_USE_TRITON_DECODE=0): the torch append, with its reason."""
    monkeypatch.setenv("NSA_USE_TRITON_DECODE", "0")
    case = make_case(gen, CFG, [5, 18], 2, 4, 2, 16, 24, dtype=torch.float32)
    cache = prefill_cache(case)
    telemetry.reset()
    got = _append(case, cache, 2)
    assert _route() == ({"torch_planned": 1}, {(b, "torch", "disabled"): 1 for b in ("cmp", "sel", "win")})
    assert rel_err(got, expected(case)[0]) <= 1e-5


def test_bad_input_raises_before_anything_is_written(gen):
    case = make_case(gen, CFG, [5, 18], 3, 4, 2, 16, 24, dtype=torch.float32)
    cache = prefill_cache(case, max_len=20)
    before = (cache.cache_seqlens.clone(), cache.k_sel.clone(), cache.k_win.clone())
    (q, k, v, g), _ = _new_tokens(case, 3)
    with pytest.raises(NSAInputError, match="cache overflow: sequence 1 would hold 21 tokens > max_len=20"):
        nsa_prefill(q, k, v, g, cache)
    with pytest.raises(NSAInputError, match=r"kv_win\[v\] must have shape"):
        nsa_prefill(q, k, v, g, cache, kv_win=(k, v[..., :3]))
    with pytest.raises(NSAInputError, match="backend must be one of"):
        nsa_prefill(q[:, :1], k[:, :1], v[:, :1], g[:, :1], cache, backend="fast")
    assert cache.host_seqlens() == [5, 18]
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.cache_seqlens, cache.k_sel, cache.k_win)))
