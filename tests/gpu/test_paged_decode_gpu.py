"""The paged decode cache (nsa.PagedNSACache) on the GPU.

- ragged decode on the paged cache (pages in shuffled order) through the Triton kernels (backend "auto",
  asserted to be served by them) equals the contiguous cache's: fp32 identical blocks and outputs to 1e-5
  (and the prefill's), bf16 identical blocks (the contiguous cache has the same capacity, so the same
  split plan: the same arithmetic on the same values);
- the step captured in a CUDA graph and replayed equals the eager steps (kernels: bit for bit; torch step:
  1e-6), pages reserved before capture (cache.reserve), crossing page boundaries during the replays;
- drafts appended (as decode steps on the kernels) and truncated (speculative decoding, cache.truncate with
  a device tensor), then decode steps on the kernels, both caches: equal to one prefill of the kept
  sequences (fp32, 1e-5);
- pages past 2^31 elements of the pool (int64 addresses): a sequence whose pages sit at the end of a
  pool of 2^31+ elements decodes as on a small pool.
"""

from __future__ import annotations

import pytest
import torch
from decode_cases import (
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

from nsa import NSACache, NSAConfig, PagedNSACache, nsa_decode, telemetry

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")]
SMALL = NSAConfig(block_cmp=16, stride_cmp=8, block_sel=16, n_sel=6, n_init=1, n_local=2, window=64)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("NSA_USE_TRITON_DECODE", raising=False)
    telemetry.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg,page,lengths,steps,Hq,Hkv,D", [
    (SMALL, 8, [0, 63, 130, 333], 12, 8, 2, 32),           # pages smaller than a selection block
    (NSAConfig(), 64, [1, 500, 1100, 2047], 20, 16, 2, 64),  # paper blocks, a page per selection block
], ids=["small-page8", "paper-page64"])
def test_paged_decode_equals_contiguous(gen, dtype, cfg, page, lengths, steps, Hq, Hkv, D):
    case = make_case(gen, cfg, lengths, steps, Hq, Hkv, D, D, dtype=dtype, device="cuda")
    paged = prefill_paged_cache(case, page, seed=1)
    # the same capacity: the same split plan, so the same arithmetic on the same values
    c_out, c_idx = decode_all(case, prefill_cache(case, max_len=paged.max_len), "auto")
    telemetry.reset()
    got, idx = decode_all(case, paged, "auto")
    assert telemetry.served("sel") == {"triton_decode": steps}, telemetry.snapshot()
    assert paged.cache_seqlens.tolist() == paged.host_seqlens() == [L + steps for L in lengths]
    assert torch.equal(idx, c_idx)
    if dtype == torch.float32:
        want, want_idx = expected(case)
        assert torch.equal(idx, want_idx) and rel_err(got, want) <= 1e-5
    assert rel_err(got, c_out) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend,tol", [("triton", 0.0), ("torch", 1e-6)])
def test_paged_cuda_graph_replay_equals_eager(gen, backend, tol):
    steps = 10
    case = make_case(gen, SMALL, [3, 70, 200], steps, 8, 2, 32, 32, dtype=torch.float32, device="cuda")
    eager_cache, graph_cache = prefill_paged_cache(case, 8, seed=1), prefill_paged_cache(case, 8, seed=2)
    eager, _ = decode_all(case, eager_cache, backend)
    f = case.full
    B, Hq = case.batch, f["q"].shape[2]
    static = {n: torch.empty(B, 1, *f[n].shape[2:], device="cuda", dtype=f[n].dtype) for n in "qkvg"}
    out = torch.empty(B, 1, Hq, 32, device="cuda")
    rows = decode_rows(case)

    def load(s):
        for n in "qkvg":
            static[n].copy_(f[n][0, rows[s]][:, None])

    def step():
        return nsa_decode(static["q"], static["k"], static["v"], static["g"], graph_cache, backend=backend, out=out)

    graph_cache.reserve(steps)  # every page the steps need, taken before capture
    load(0)
    got = [step().clone()]  # eager warm-up step (compiles)
    host = graph_cache.host_state()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph_cache.set_host_state(host)
    for s in range(1, steps):
        load(s)
        graph.replay()
        graph_cache.commit_step(on_device=False)
        got.append(out.clone())
    got = torch.cat(got, dim=1)
    assert graph_cache.cache_seqlens.tolist() == graph_cache.host_seqlens() == eager_cache.host_seqlens()
    assert rel_err(got, eager) <= tol if tol else torch.equal(got, eager)


def test_pages_past_2_31_elements(gen):
    """A pool of 2^31 + 2^13 bf16 elements per K and V (4 GiB each): the sequences' pages at its far end."""
    page, Hkv, D = 64, 1, 128
    per_page = page * Hkv * D
    num_pages = (1 << 31) // per_page + 1
    if torch.cuda.mem_get_info()[0] < 4 * num_pages * per_page + (2 << 30):
        pytest.skip("needs about 10 GiB of free GPU memory")
    cfg = NSAConfig()
    case = make_case(gen, cfg, [700, 1500], 6, 4, Hkv, D, D, dtype=torch.bfloat16, device="cuda")
    cache = PagedNSACache(cfg, 2, num_pages, page, 24, Hkv, D, D, device="cuda", dtype=torch.bfloat16)
    c_out, c_idx = decode_all(case, prefill_cache(case, max_len=cache.max_len, prefill_backend=None), "triton")
    cache._free = list(range(num_pages - 60, num_pages))  # the last pages: row offsets past 2^31 elements
    prefill_cache(case, cache=cache, prefill_backend=None)
    assert max(max(cache.pages_of(b)) for b in range(2)) * per_page >= 1 << 31
    got, idx = decode_all(case, cache, "triton")
    assert torch.equal(idx, c_idx) and rel_err(got, c_out) <= 1e-2


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_after_truncate_equals_prefill(gen, paged):
    # 5 + 0 of 12 kept, 70 + 6 (the next compressed block and the window need ring slots the drafts took),
    # 130 + 12 (all kept); 12 kernel steps after the truncate cross compressed-block completions
    steps = 12
    case = make_spec_case(gen, SMALL, [5, 70, 130], 12, [0, 6, 12], after=0, steps=steps, Hq=8, Hkv=2, Dk=32,
                          Dv=32, dtype=torch.float32, device="cuda")
    if paged:
        cache = PagedNSACache(SMALL, 3, 80, 8, 20, 2, 32, 32, device="cuda", dtype=torch.float32)
    else:
        cache = NSACache(SMALL, 3, 160, 2, 32, 32, device="cuda", dtype=torch.float32)
    telemetry.reset()
    for got, want in run_spec(case, cache, backend="auto", tensor_lengths=True):
        assert rel_err(got, want) <= 1e-5
    # the drafts' append (12 per row) ran as decode steps on the kernels too: one more record
    assert telemetry.served("sel").get("triton_decode") == steps + 1, telemetry.snapshot()
    assert {e["event"] for e in telemetry.snapshot()["events"] if e["backend"] == "append"} == {"decode_steps"}
