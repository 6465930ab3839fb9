"""Ragged decode with the torch step: sequences of different lengths in one cache, each at its own position.

- packed prefill + decode steps equal the prefill of each whole sequence (fp64: identical blocks, 1e-12;
  fp32: identical blocks, 1e-5) at positions where a compressed block completes, the window wraps and a
  selection block starts (asserted, so the cases cannot drift away from them);
- the cache written in chunks equals the cache written at once; the module (RoPE positions per sequence);
- bad inputs are NSAInputError naming the argument; a step that raises leaves the cache as it was;
- no host synchronisation in a step; routing and telemetry of the decode backend.
"""

from __future__ import annotations

import pytest
import torch
from decode_cases import all_events, decode_all, decode_rows, expected, make_case, prefill_cache, rel_err
from torch.overrides import TorchFunctionMode

from nsa import NSAAttention, NSACache, NSAConfig, NSAInputError, nsa_decode, plan, telemetry
from nsa.branches.decode import naive as decode_naive

CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=16)
# prompt lengths: an empty one, one crossing the first block (t = 7) and selection block (t = 8), one crossing
# the window wrap (t = 16), one far in (selection block at 32, compressed blocks at 31 and 35)
LENGTHS = [0, 5, 13, 30]
STEPS = 6
EVENTS = {"cmp_block_completes", "window_wraps", "sel_block_starts"}


def _run(gen, dtype, cfg=CFG, lengths=LENGTHS, steps=STEPS, **kw):
    case = make_case(gen, cfg, lengths, steps, 4, 2, 8, 6, dtype=dtype, **kw)
    cache = prefill_cache(case)
    assert cache.host_seqlens() == lengths and cache.cache_seqlens.tolist() == lengths
    want, want_idx = expected(case)
    got, idx = decode_all(case, cache, "torch")
    assert EVENTS <= all_events(case, cache)
    assert cache.cache_seqlens.tolist() == [L + steps for L in lengths] == cache.host_seqlens()
    return got, idx, want, want_idx


def test_ragged_decode_equals_prefill_fp64(gen):
    got, idx, want, want_idx = _run(gen, torch.float64)
    assert torch.equal(idx, want_idx)
    assert rel_err(got, want) <= 1e-12


def test_ragged_decode_equals_prefill_fp32(gen):
    got, idx, want, want_idx = _run(gen, torch.float32)
    assert torch.equal(idx, want_idx)
    assert rel_err(got, want) <= 1e-5


def test_ragged_with_branch_kv_and_mlp_compression(gen):
    cfg = CFG.with_(compress="mlp", window=12)
    w = torch.randn(cfg.block_cmp, generator=gen, dtype=torch.float64)
    phi = (lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)),
           lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)).cos())
    got, idx, want, want_idx = _run(gen, torch.float64, cfg=cfg, branch_kv=True, compress_fn=phi)
    assert torch.equal(idx, want_idx)
    assert rel_err(got, want) <= 1e-12


def _state(cache):
    names = ("k_sel", "v_sel", "k_win", "v_win", "k_raw_cmp", "v_raw_cmp", "k_cmp", "v_cmp", "cache_seqlens")
    return {n: getattr(cache, n).clone() for n in names}, cache.host_state()


def _same_state(cache, saved):
    tensors, host = saved
    assert cache.host_state() == host
    for name, x in tensors.items():
        assert torch.equal(getattr(cache, name), x), name


def test_chunked_writes_equal_one_write(gen):
    """write() in pieces (dense, then packed ragged chunks) builds the same cache as one write."""
    B, T, Hkv, D = 3, 45, 2, 4
    k, v = torch.randn(B, T, Hkv, D, generator=gen), torch.randn(B, T, Hkv, D, generator=gen)
    one = NSACache(CFG, B, 50, Hkv, D, D)
    one.write(k, v)
    parts = NSACache(CFG, B, 50, Hkv, D, D)
    parts.write(k[:, :7], v[:, :7])
    # ragged middle pieces: sequence b takes cut[b] more tokens, then the rest
    cut = [3, 0, 20]

    def packed(x, lo, hi):
        return torch.cat([x[b:b + 1, lo[b]:hi[b]] for b in range(B)], dim=1)

    def cu(lo, hi):
        return torch.tensor([0] + torch.tensor([h - l for l, h in zip(lo, hi)]).cumsum(0).tolist(), dtype=torch.int32)

    lo, mid, hi = [7] * B, [7 + c for c in cut], [T] * B
    parts.write(packed(k, lo, mid), packed(v, lo, mid), cu_seqlens=cu(lo, mid))
    assert parts.host_seqlens() == mid and parts.cache_seqlens.tolist() == mid
    parts.write(packed(k, mid, hi), packed(v, mid, hi), cu_seqlens=cu(mid, hi))
    for name in ("k_sel", "v_sel", "k_win", "v_win", "k_raw_cmp", "v_raw_cmp", "cache_seqlens"):
        assert torch.equal(getattr(parts, name), getattr(one, name)), name
    n = CFG.n_cmp_blocks(T)
    torch.testing.assert_close(parts.k_cmp[:, :n], one.k_cmp[:, :n], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts.v_cmp[:, :n], one.v_cmp[:, :n], rtol=1e-6, atol=1e-6)
    assert parts.length == T and parts.n_cmp == n


def test_module_ragged_prefill_then_decode_equals_whole_sequences(gen):
    """NSAAttention: packed prompts into an empty cache, then decode: RoPE positions per sequence."""
    torch.manual_seed(0)
    attn = NSAAttention(32, 4, 2, 8, 8, CFG).double()
    lengths, steps = [3, 17, 9], 4
    xs = [torch.randn(1, L + steps, 32, generator=gen, dtype=torch.float64) for L in lengths]
    whole = [attn(x) for x in xs]
    cache = attn.new_cache(len(lengths), max(lengths) + steps)
    cu = torch.tensor([0, 3, 20, 29], dtype=torch.int32)
    y = attn(torch.cat([x[:, :L] for x, L in zip(xs, lengths)], dim=1), cache, cu_seqlens=cu)
    for b, L in enumerate(lengths):
        assert rel_err(y[:, cu[b]:cu[b + 1]], whole[b][:, :L]) <= 1e-12
    for s in range(steps):
        y = attn(torch.cat([x[:, L + s:L + s + 1] for x, L in zip(xs, lengths)], dim=0), cache)
        for b, L in enumerate(lengths):
            assert rel_err(y[b], whole[b][0, L + s:L + s + 1]) <= 1e-12
    with pytest.raises(NSAInputError, match="cu_seqlens"):
        attn(xs[0][:, :1], cache, cu_seqlens=torch.tensor([0, 1], dtype=torch.int32))


# --- bad inputs and atomicity ------------------------------------------------------------------------------

def _small_cache(gen, lengths=(2, 5), max_len=8, dtype=torch.float64):
    case = make_case(gen, CFG, list(lengths), 1, 4, 2, 8, 6, dtype=dtype)
    return case, prefill_cache(case, max_len=max_len)


def _token(gen, B, dtype=torch.float64, Hq=4, Hkv=2, Dk=8, Dv=6):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    gates = torch.rand(B, 1, Hq, 3, generator=gen, dtype=dtype)
    return rnd(B, 1, Hq, Dk), rnd(B, 1, Hkv, Dk), rnd(B, 1, Hkv, Dv), gates


@pytest.mark.parametrize("bad,match", [
    (lambda c: dict(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int64)), "cu_seqlens must be int32"),
    (lambda c: dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), r"cu_seqlens must be 1-D with batch \+ 1 = 3"),
    (lambda c: dict(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32, device="meta")), "cu_seqlens is on meta"),
    (lambda c: dict(cu_seqlens=torch.tensor([0, 4, 3], dtype=torch.int32)), "non-decreasing"),
    (lambda c: dict(cu_seqlens=[0, 2, 5]), "cu_seqlens must be an int32 torch.Tensor"),
])
def test_bad_cu_seqlens(gen, bad, match):
    cache = NSACache(CFG, 2, 8, 2, 8, 6, dtype=torch.float64)
    k, v = torch.randn(1, 5, 2, 8, dtype=torch.float64), torch.randn(1, 5, 2, 6, dtype=torch.float64)
    saved = _state(cache)
    with pytest.raises(NSAInputError, match=match):
        cache.write(k, v, **bad(cache))
    _same_state(cache, saved)


def test_overflow_of_one_sequence_is_refused_before_writing(gen):
    case, cache = _small_cache(gen, lengths=(2, 7), max_len=8)
    q, k, v, g = _token(gen, 2)
    nsa_decode(q, k, v, g, cache)  # 3 and 8 tokens: full
    saved = _state(cache)
    with pytest.raises(NSAInputError, match=r"sequence 1 would hold 9 tokens > max_len=8"):
        nsa_decode(q, k, v, g, cache)
    _same_state(cache, saved)
    with pytest.raises(NSAInputError, match="max_len"):
        cache.write(torch.zeros(1, 9, 2, 8, dtype=torch.float64), torch.zeros(1, 9, 2, 6, dtype=torch.float64),
                    cu_seqlens=torch.tensor([0, 9, 9], dtype=torch.int32))
    _same_state(cache, saved)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v, g: (q[:1], k[:1], v[:1], g[:1]), "batch 1, the cache holds 2"),
    (lambda q, k, v, g: (q.float(), k.float(), v.float(), g), "dtype"),
    (lambda q, k, v, g: (q, k[..., :4], v, g), "k head dim"),
    (lambda q, k, v, g: (q, k, v[:, :, :1], g), "v must have Hkv=2"),
    (lambda q, k, v, g: tuple(x.expand(2, 2, *x.shape[2:]) for x in (q, k, v, g)), "T=1"),
])
def test_bad_step_inputs_leave_cache_untouched(gen, mutate, match):
    _, cache = _small_cache(gen)
    saved = _state(cache)
    with pytest.raises(NSAInputError, match=match):
        nsa_decode(*mutate(*_token(gen, 2)), cache)
    _same_state(cache, saved)


def test_bad_step_options(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernels are then not available on CPU
    _, cache = _small_cache(gen)
    q, k, v, g = _token(gen, 2)
    saved = _state(cache)
    for kwargs, match in (
        (dict(kv_win=(k, v[..., :3])), r"kv_win\[v\]"),
        (dict(kv_cmp=(k,)), "kv_cmp must be a"),
        (dict(out=torch.empty(2, 1, 4, 5, dtype=torch.float64)), "out must be"),
        (dict(backend="sdpa"), "decode_backend"),
        (dict(backend="triton"), "TRITON_INTERPRET=1"),
        (dict(config=CFG.with_(window=8)), "config"),
    ):
        with pytest.raises(NSAInputError, match=match):
            nsa_decode(q, k, v, g, cache, **kwargs)
        _same_state(cache, saved)


def test_failure_after_the_append_leaves_the_cache_consistent(gen, monkeypatch):
    """A step that dies after writing its token (before publishing the lengths) changes nothing a later call
    sees: redoing the step gives the prefill result."""
    case = make_case(gen, CFG, [15, 30], 3, 4, 2, 8, 6)
    cache = prefill_cache(case)
    want, want_idx = expected(case)
    real = decode_naive.selected_chunk

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(decode_naive, "selected_chunk", boom)
    f, row = case.full, decode_rows(case)[0]
    with pytest.raises(RuntimeError, match="injected"):
        nsa_decode(*(f[n][0, row][:, None] for n in "qkvg"), cache)
    assert cache.cache_seqlens.tolist() == [15, 30] and cache.host_seqlens() == [15, 30]
    monkeypatch.setattr(decode_naive, "selected_chunk", real)
    got, idx = decode_all(case, cache, "torch")
    assert torch.equal(idx, want_idx) and rel_err(got, want) <= 1e-12


class _NoHostSync(TorchFunctionMode):
    SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCS:
            raise AssertionError(f"host synchronisation in a decode step: Tensor.{name}")
        return func(*args, **(kwargs or {}))


def test_torch_step_reads_nothing_back_to_the_host(gen):
    case, cache = _small_cache(gen, lengths=(2, 5), max_len=12)
    q, k, v, g = _token(gen, 2)
    with _NoHostSync():
        for _ in range(3):
            nsa_decode(q, k, v, g, cache)
    assert cache.host_seqlens() == [5, 8]


# --- routing and telemetry ------------------------------------------------------------------------------


def _counts():
    return {(r["branch"], r["backend"], r["reason"]): r["calls"] for r in telemetry.snapshot()["counts"]}


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("NSA_USE_TRITON_DECODE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    saved = (plan.TRITON["decode"].capability, plan.TRITON["decode"].allow_cpu)
    telemetry.reset()
    yield
    plan.TRITON["decode"].capability, plan.TRITON["decode"].allow_cpu = saved


def test_auto_on_cpu_runs_torch_as_the_environment(gen, clean):
    _, cache = _small_cache(gen, max_len=10)
    nsa_decode(*_token(gen, 2), cache)
    assert all(_counts()[(b, "torch", "decode")] == 1 for b in ("cmp", "sel", "win"))
    assert telemetry.snapshot()["fallbacks"] == 0


def test_forced_torch(gen, clean):
    _, cache = _small_cache(gen, max_len=10)
    telemetry.reset()
    nsa_decode(*_token(gen, 2), cache, backend="torch")
    assert _counts()[("sel", "torch", "forced")] == 1


@pytest.mark.parametrize("setup,dtype,reason", [
    (lambda mp: mp.setenv("NSA_USE_TRITON_DECODE", "0"), torch.float32, "disabled"),
    (lambda mp: setattr(plan.TRITON["decode"], "capability", (7, 5)), torch.float32, "sm_unsupported"),
    (lambda mp: None, torch.float64, "dtype"),
])
def test_guard_fallback_is_counted_and_forced_raises(gen, clean, monkeypatch, setup, dtype, reason):
    plan.TRITON["decode"].allow_cpu = True  # pretend the kernels could run here: only the guard decides
    setup(monkeypatch)
    _, cache = _small_cache(gen, max_len=10, dtype=dtype)
    q, k, v, g = _token(gen, 2, dtype=dtype)
    nsa_decode(q, k, v, g, cache)
    assert _counts()[("cmp", "torch", reason)] == 1
    assert telemetry.snapshot()["fallbacks"] == 3
    saved = _state(cache)
    with pytest.raises(NSAInputError, match=reason):
        nsa_decode(q, k, v, g, cache, backend="triton")
    _same_state(cache, saved)


def test_group_size_and_grad_guards(gen, clean):
    plan.TRITON["decode"].allow_cpu = True
    cache = NSACache(CFG, 1, 4, 1, 8, 8)
    q = torch.randn(1, 1, 65, 8)
    assert plan.plan_decode("auto", q, cache).reason == "group_size"
    q = torch.randn(1, 1, 4, 8)
    step = plan.plan_decode("auto", q, cache, needs_grad=True)
    assert (step.backend, step.reason) == ("torch", "grad")
    assert plan.plan_decode("auto", q, cache).backend == "triton"


def test_module_passes_its_backend_to_decode(gen, clean):
    attn = NSAAttention(16, 4, 2, 8, 8, CFG, backend="torch")
    cache = attn.new_cache(1, 8)
    attn(torch.randn(1, 3, 16), cache)
    telemetry.reset()
    attn(torch.randn(1, 1, 16), cache)
    assert _counts()[("sel", "torch", "forced")] == 1
    with pytest.raises(NSAInputError, match="TRITON_INTERPRET=1"):
        attn(torch.randn(1, 1, 16), cache, backend="triton")
    attn_sdpa = NSAAttention(16, 4, 2, 8, 8, CFG, backend="sdpa")
    cache = attn_sdpa.new_cache(1, 8)
    with pytest.raises(NSAInputError, match="decode_backend"):
        attn_sdpa(torch.randn(1, 1, 16), cache, backend="torch")  # prefill forced to torch: ok
        attn_sdpa(torch.randn(1, 1, 16), cache)  # decode with "sdpa": no such decode step
    attn_sdpa.decode_backend = "auto"
    attn_sdpa(torch.randn(1, 1, 16), cache)
