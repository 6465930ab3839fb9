"""Ragged decode cases shared by the CPU tests, the GPU tests and the GPU edge sweep.

A case: sequences of different prompt lengths, packed into one prefill (cu_seqlens), then `steps` decode
steps that append one token to every sequence at its own position. The expected result is the prefill of
every whole sequence (nsa_attention over the packed full sequences, backend "torch" unless given) at the
decoded positions: outputs and selected blocks.

tests/ is on sys.path through the rootdir conftest, so tests import this as `decode_cases`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa import NSACache, NSAConfig, PagedNSACache, nsa_attention, nsa_decode, nsa_prefill


@dataclass
class RaggedCase:
    cfg: NSAConfig
    lengths: list[int]  # prompt length of each sequence
    steps: int
    full: dict  # packed whole sequences: q, k, v, g (+ kc, vc, kw, vw) [1, total, H, D]
    cu_full: list[int]
    compress_fn: tuple | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def branch_kv(self, take):
        if "kc" not in self.full:
            return {}
        f = self.full
        return dict(kv_cmp=(take(f["kc"]), take(f["vc"])), kv_win=(take(f["kw"]), take(f["vw"])))

    def positions(self) -> list[list[int]]:
        """Decoded positions t of each sequence."""
        return [list(range(L, L + self.steps)) for L in self.lengths]


def make_case(gen, cfg, lengths, steps, Hq, Hkv, Dk, Dv, *, dtype=torch.float64, device="cpu", branch_kv=False,
              compress_fn=None, zero_q=False) -> RaggedCase:
    """Fresh random whole sequences (prompt + decoded tokens) for each prompt length."""
    total = sum(L + steps for L in lengths)
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + L + steps)
    full = {}
    for name, dims in (("q", (Hq, Dk)), ("k", (Hkv, Dk)), ("v", (Hkv, Dv))):
        full[name] = torch.randn(1, total, *dims, generator=gen, dtype=torch.float64)
    full["g"] = torch.rand(1, total, Hq, 3, generator=gen, dtype=torch.float64)
    if branch_kv:
        for name, D in (("kc", Dk), ("vc", Dv), ("kw", Dk), ("vw", Dv)):
            full[name] = torch.randn(1, total, Hkv, D, generator=gen, dtype=torch.float64)
    if zero_q:
        full["q"].zero_()
    full = {n: x.to(device=device, dtype=dtype) for n, x in full.items()}
    return RaggedCase(cfg, list(lengths), steps, full, cu, compress_fn)


def expected(case: RaggedCase, backend: str = "torch"):
    """Prefill of the whole sequences at the decoded positions: out [B, steps, Hq, Dv], idx [B, steps, Hkv, n]."""
    f = case.full
    cu = torch.tensor(case.cu_full, dtype=torch.int32, device=f["q"].device)
    out, idx = nsa_attention(f["q"], f["k"], f["v"], f["g"], case.cfg, cu_seqlens=cu, backend=backend,
                             return_indices=True, compress_fn=case.compress_fn, **case.branch_kv(lambda x: x))
    rows = decode_rows(case)
    return (torch.stack([out[0, r] for r in rows], dim=1), torch.stack([idx[0, r] for r in rows], dim=1))


def decode_rows(case: RaggedCase) -> list[torch.Tensor]:
    """For each step, the packed row of every sequence's token: [steps] x LongTensor [B]."""
    device = case.full["q"].device
    return [torch.tensor([a + L + s for a, L in zip(case.cu_full, case.lengths)], device=device)
            for s in range(case.steps)]


def prefill_cache(case: RaggedCase, *, max_len: int | None = None, prefill_backend: str | None = "torch",
                  cache: NSACache | None = None) -> NSACache:
    """A cache holding every sequence's prompt, filled by one packed nsa_prefill (prefill_backend=None: by
    NSACache.write alone, without computing the prompts' attention). cache: an empty one to fill."""
    f = case.full
    q = f["q"]
    Hkv, Dk, Dv = f["k"].shape[2], f["k"].shape[3], f["v"].shape[3]
    max_len = max_len or max(case.lengths) + case.steps
    if cache is None:
        cache = NSACache(case.cfg, case.batch, max_len, Hkv, Dk, Dv, device=q.device, dtype=q.dtype)
    rows = torch.cat([torch.arange(a, a + L) for a, L in zip(case.cu_full, case.lengths)]).to(q.device)
    cu = [0]
    for L in case.lengths:
        cu.append(cu[-1] + L)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)

    def take(x):
        return x[:, rows]

    if prefill_backend is None:
        cache.write(take(f["k"]), take(f["v"]), cu_seqlens=cu_t, compress_fn=case.compress_fn, **case.branch_kv(take))
    else:
        nsa_prefill(take(q), take(f["k"]), take(f["v"]), take(f["g"]), cache, cu_seqlens=cu_t,
                    backend=prefill_backend, compress_fn=case.compress_fn, **case.branch_kv(take))
    return cache


def prefill_paged_cache(case: RaggedCase, page_size: int, *, num_pages: int | None = None, seed: int = 0,
                        prefill_backend: str | None = "torch") -> PagedNSACache:
    """prefill_cache on a PagedNSACache whose free list is shuffled (seed): each sequence's pages lie anywhere
    in the pool, in any order. Room for the prompts and the decoded tokens, plus spare pages."""
    f = case.full
    q = f["q"]
    Hkv, Dk, Dv = f["k"].shape[2], f["k"].shape[3], f["v"].shape[3]
    per_seq = -(-(max(case.lengths) + case.steps) // page_size)
    num_pages = num_pages or per_seq * case.batch + 3
    cache = PagedNSACache(case.cfg, case.batch, num_pages, page_size, per_seq, Hkv, Dk, Dv, device=q.device,
                          dtype=q.dtype)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    cache._free = order  # the allocator pops from the end: pages come out of order
    return prefill_cache(case, cache=cache, prefill_backend=prefill_backend)


def decode_all(case: RaggedCase, cache: NSACache, backend: str, *, step_hook=None):
    """Every decode step: out [B, steps, Hq, Dv], idx [B, steps, Hkv, n] (step_hook(s, cache) after each step)."""
    f = case.full
    outs, idxs = [], []
    for s, row in enumerate(decode_rows(case)):
        def take(x, row=row):
            return x[0, row][:, None]

        o, i = nsa_decode(take(f["q"]), take(f["k"]), take(f["v"]), take(f["g"]), cache, backend=backend,
                          return_indices=True, compress_fn=case.compress_fn, **case.branch_kv(take))
        outs.append(o[:, 0])
        idxs.append(i[:, 0])
        if step_hook is not None:
            step_hook(s, cache)
    return torch.stack(outs, dim=1), torch.stack(idxs, dim=1)


def events(cfg: NSAConfig, positions: list[int], window_slots: int) -> set[str]:
    """Which cache events the decoded positions cross: a compressed block completes, the window ring wraps
    (a slot is overwritten), a selection block starts."""
    seen = set()
    for t in positions:
        rel = t + 1 - cfg.block_cmp
        if rel >= 0 and rel % cfg.stride_cmp == 0:
            seen.add("cmp_block_completes")
        if t >= window_slots:
            seen.add("window_wraps")
        if t % cfg.block_sel == 0 and t > 0:
            seen.add("sel_block_starts")
    return seen


def all_events(case: RaggedCase, cache: NSACache) -> set[str]:
    return set().union(*(events(case.cfg, p, cache.window_slots) for p in case.positions()))


def rel_err(got, want) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.numel() == 0:
        return 0.0
    d = (got - want).abs().max()
    return float("inf") if torch.isnan(d) else float(d / want.abs().max().clamp_min(1e-30))


# --- speculative decoding: k drafts appended, the rejected ones truncated ------------------------------------

@dataclass
class SpecCase:
    """Per row: a prompt, k draft tokens of which `accepted` are kept, then `after` tokens appended in one
    write and `steps` decode steps. `true` packs each row's kept sequence (prompt, accepted drafts, after,
    steps); `rejected` [B, k, ...] holds the drafts that get dropped (row b's last k - accepted[b])."""

    cfg: NSAConfig
    prompts: list[int]
    k: int
    accepted: list[int]
    after: int
    steps: int
    true: dict
    rejected: dict
    cu: list[int]

    @property
    def batch(self) -> int:
        return len(self.prompts)

    def row(self, b: int, name: str, a: int, e: int) -> torch.Tensor:
        return self.true[name][0, self.cu[b] + a:self.cu[b] + e]


def make_spec_case(gen, cfg, prompts, k, accepted, after, steps, Hq=4, Hkv=2, Dk=8, Dv=6,
                   dtype=torch.float64, device="cpu") -> SpecCase:
    lengths = [P + a + after + steps for P, a in zip(prompts, accepted)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    dims = {"q": (Hq, Dk), "k": (Hkv, Dk), "v": (Hkv, Dv)}

    def rnd(lead):
        out = {n: torch.randn(*lead, *d, generator=gen, dtype=torch.float64) for n, d in dims.items()}
        out["g"] = torch.rand(*lead, Hq, 3, generator=gen, dtype=torch.float64)
        return {n: x.to(device=device, dtype=dtype) for n, x in out.items()}

    return SpecCase(cfg, list(prompts), k, list(accepted), after, steps, rnd((1, cu[-1])), rnd((len(prompts), k)),
                    cu)


def run_spec(case: SpecCase, cache: NSACache, *, backend: str = "torch", tensor_lengths: bool = False,
             compress_fn=None, on_drafts=None):
    """Prompts (packed prefill), the k drafts of every row (one write), truncate to the accepted ones,
    `after` tokens (one write), `steps` decode steps (`backend`; compress_fn: phi for compress="mlp";
    on_drafts(cache) runs before the truncate). Returns [(got, want)] for every output
    of a kept token, the wanted one from one prefill of the kept sequences (nsa_attention, torch)."""
    B, names, f = case.batch, ("q", "k", "v", "g"), case.true
    device = f["q"].device
    rows = torch.cat([torch.arange(case.cu[b], case.cu[b] + P) for b, P in enumerate(case.prompts)]).to(device)
    cu_p = [0]
    for P in case.prompts:
        cu_p.append(cu_p[-1] + P)
    nsa_prefill(*(f[n][:, rows] for n in names), cache, compress_fn=compress_fn,
                cu_seqlens=torch.tensor(cu_p, dtype=torch.int32, device=device))
    drafts = {}
    for n in names:
        x = case.rejected[n].clone()
        for b, (P, a) in enumerate(zip(case.prompts, case.accepted)):  # the accepted drafts first
            x[b, :a] = case.row(b, n, P, P + a)
        drafts[n] = x
    out = nsa_prefill(*(drafts[n] for n in names), cache, compress_fn=compress_fn)
    got = [out[b, :a] for b, a in enumerate(case.accepted)]
    if on_drafts is not None:
        on_drafts(cache)
    new = [P + a for P, a in zip(case.prompts, case.accepted)]
    cache.truncate(torch.tensor(new, dtype=torch.int32, device=device) if tensor_lengths else new)
    assert cache.cache_seqlens.tolist() == cache.host_seqlens() == new
    cur = list(new)

    def dense(n, T):
        return torch.stack([case.row(b, n, cur[b], cur[b] + T) for b in range(B)])

    if case.after:
        out = nsa_prefill(*(dense(n, case.after) for n in names), cache, compress_fn=compress_fn)
        got += [out[b] for b in range(B)]
        cur = [c + case.after for c in cur]
    for _ in range(case.steps):
        got.append(nsa_decode(*(dense(n, 1) for n in names), cache, backend=backend, compress_fn=compress_fn)[:, 0])
        cur = [c + 1 for c in cur]
    whole = nsa_attention(f["q"], f["k"], f["v"], f["g"], case.cfg, backend="torch", compress_fn=compress_fn,
                          cu_seqlens=torch.tensor(case.cu, dtype=torch.int32, device=device))[0]
    want = [whole[case.cu[b] + case.prompts[b]:case.cu[b] + new[b]] for b in range(B)]
    if case.after:
        want += [whole[case.cu[b] + new[b]:case.cu[b] + new[b] + case.after] for b in range(B)]
    for s in range(case.steps):
        want.append(torch.stack([whole[case.cu[b] + new[b] + case.after + s] for b in range(B)]))
    return list(zip(got, want))
