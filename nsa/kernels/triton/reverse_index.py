"""Reverse index of the selection: for every (batch, KV head, selection block), the queries that selected it.

The forward takes, per query token and KV head, local block ids of the token's own sequence
(`indices [B, T, Hkv, n]`, -1 = none; `seq_start [B, T]` = global index of each token's sequence start).
The dK/dV backward works per block and needs the transpose. Built on the device with torch ops: no host
sync, no Python loop over tokens or blocks, every size a static bound of the input shapes.

Block slots. Block j of the sequence of token t starts at the global token s0 = seq_start[b, t] + j*l'.
Blocks are disjoint and every block that a query can see (j*l' <= pos) holds its start token, so the start
token names the block: slot key = (b*Hkv + h) * T + s0. There are B*Hkv*T keys (a static bound: slots
whose token is not a block start are simply empty). This works for packed input whose sequences start
anywhere: no slot is derived from a global multiple of l'.

CSR. `offsets [B*Hkv*T + 1]` (int64), `queries [B*T*Hkv*n]` (int32 global token indices): the list of slot
key k is queries[offsets[k]:offsets[k+1]], ascending in the token (a stable sort of the keys, taken in
(b, h, t) order), so the result is deterministic. Entries with j = -1, or naming a block after the query
(fully masked: u > t for every token), are left out; they sort to the end, past offsets[-1].

Repeated blocks in one row would put the token twice in a list; the entry point deduplicates first.

The reverse index and the work plan (plan_work) launch about 130 small kernels. Fusing every elementwise
stretch into one Triton kernel (around the same sorts, cumulative sum and gathers; 50 launches, the same
tensors bit for bit) measured, in CUDA graphs on an H200: 301 -> 191 us at T=8k with one KV head, but
1031 -> 1198 us at T=64k with four, and no change in the training showcase's compiled 8k step (42.2 ms
with these ops, 42.4 and 42.6 fused). It was not kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReverseIndex:
    offsets: torch.Tensor  # [B*Hkv*T + 1] int64
    queries: torch.Tensor  # [B*T*Hkv*n] int32; entries >= offsets[-1] are padding
    block_len: torch.Tensor  # [B, T] int64: tokens in the block that starts at token s (0 if none starts there)
    B: int
    T: int
    Hkv: int

    @property
    def n_keys(self) -> int:
        return self.B * self.Hkv * self.T

    def counts(self) -> torch.Tensor:
        """[B*Hkv*T] int64: queries per slot key."""
        return self.offsets[1:] - self.offsets[:-1]

    def block_exists(self) -> torch.Tensor:
        """[B*Hkv*T] bool: a block starts at the slot's token."""
        return (self.block_len > 0)[:, None, :].expand(self.B, self.Hkv, self.T).reshape(-1)


def block_layout(seq_start: torch.Tensor, block_sel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos [B, T] int64: position in the sequence, block_len [B, T] int64: length of the block starting at
    each token, 0 where no block starts).

    A block is the run of tokens with the same (sequence, pos // l'); its length is min(l', the tokens of its
    sequence left). Counted with a sorted search over each token's block start (non-decreasing in t).
    """
    B, T = seq_start.shape
    ss = seq_start.long()
    t = torch.arange(T, device=ss.device)
    pos = t[None] - ss
    block_start = ss + pos.div(block_sel, rounding_mode="floor") * block_sel  # [B, T], non-decreasing
    tb = t[None].expand(B, T).contiguous()
    n = torch.searchsorted(block_start, tb, right=True) - torch.searchsorted(block_start, tb, right=False)
    return pos, n


def build_reverse_index(indices: torch.Tensor, seq_start: torch.Tensor, block_sel: int, q_offset: int = 0,
                        kv_seq_start: torch.Tensor | None = None) -> ReverseIndex:
    """indices [B, T, Hkv, n] (int, -1 = none, no repeats in a row), seq_start [B, T] -> ReverseIndex.

    Queries at a stream offset: the T query rows are the stream positions [q_offset, q_offset + T) and
    the keys the stream's first Tk positions, kv_seq_start [B, Tk] giving their sequence starts. The slots
    then run over the Tk key tokens (ReverseIndex.T = Tk) and the query lists hold query rows."""
    B, Tq, Hkv, n = indices.shape
    dev = indices.device
    if kv_seq_start is None:  # the plain call: queries and keys are the same tokens
        if q_offset:
            raise ValueError("build_reverse_index: q_offset > 0 needs kv_seq_start (the keys' sequence starts)")
        pos, block_len = block_layout(seq_start, block_sel)
    else:
        _, block_len = block_layout(kv_seq_start, block_sel)
        pos = torch.arange(q_offset, q_offset + Tq, device=dev)[None] - seq_start.long()
    T = block_len.shape[1]  # key tokens: the slot space
    n_keys = B * Hkv * T
    j = indices.long().permute(0, 2, 1, 3)  # [B, Hkv, Tq, n]: flat order (b, h, t, i)
    p = pos[:, None, :, None]
    valid = (j >= 0) & (j * block_sel <= p)
    s0 = seq_start.long()[:, None, :, None] + j * block_sel  # global start token of the block (< T when valid)
    bh = torch.arange(B * Hkv, device=dev).view(B, Hkv, 1, 1)
    key = torch.where(valid, bh * T + s0, torch.full_like(s0, n_keys))
    key = key.reshape(-1)
    # int32 keys halve the radix sort's passes when they fit
    if n_keys < 2**31 - 1:
        key = key.to(torch.int32)
    sorted_key, perm = torch.sort(key, stable=True)
    queries = (perm.div(n, rounding_mode="floor") % max(Tq, 1)).to(torch.int32)
    bounds = torch.arange(n_keys + 1, device=dev, dtype=sorted_key.dtype)
    offsets = torch.searchsorted(sorted_key, bounds, right=False)
    return ReverseIndex(offsets=offsets, queries=queries, block_len=block_len, B=B, T=T, Hkv=Hkv)


@dataclass
class WorkPlan:
    """The dK/dV kernel's work: chunks of at most `chunk` queries of one block, biggest first.

    items [W_bound, 6] int64 rows (b*Hkv + h, block start token, block length, first, end (into
    `queries`), partial slot or -1); the first n_items[0] rows are real. A block whose list fits in one
    chunk (or is empty: its dK/dV are zeros) has one item that writes dK/dV directly; a block with several
    chunks writes one fp32 partial per chunk, reduced in chunk order by the rows of `reduce`
    [n_keys, 5] (b*Hkv + h, block start, block length, first partial, end partial), the first
    n_reduce[0] real, most partials first. Only stable sorts, integer cumulative sums and gathers: the
    plan is the same on every run.
    """

    queries: torch.Tensor  # the reverse index's query lists (ReverseIndex.queries)
    items: torch.Tensor
    n_items: torch.Tensor
    reduce: torch.Tensor
    n_reduce: torch.Tensor
    n_partials_bound: int
    chunk: int


ITEM_FIELDS = 6
REDUCE_FIELDS = 5


def partials_bound(n_entries: int, chunk: int) -> int:
    """Static bound of the partials: a block with c > chunk queries has ceil(c/chunk) < 2c/chunk chunks."""
    return 2 * n_entries // chunk + 1


def plan_work(rix: ReverseIndex, chunk: int) -> WorkPlan:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dev = rix.offsets.device
    K = rix.n_keys
    E = rix.queries.numel()
    counts = rix.counts()
    exists = rix.block_exists()
    nch = torch.where(exists, torch.clamp((counts + chunk - 1).div(chunk, rounding_mode="floor"), min=1),
                      torch.zeros_like(counts))
    multi = nch > 1
    incl = torch.cumsum(nch, 0)
    n_items = incl[-1:] if K else torch.zeros(1, dtype=torch.int64, device=dev)
    w_bound = K + (E + chunk - 1) // chunk
    w = torch.arange(w_bound, device=dev)
    k = torch.searchsorted(incl, w, right=True).clamp_(max=max(K - 1, 0))
    c = w - (incl[k] - nch[k])
    first = rix.offsets[k] + c * chunk
    end = torch.minimum(first + chunk, rix.offsets[k + 1])
    part_incl = torch.cumsum(torch.where(multi, nch, torch.zeros_like(nch)), 0)
    part_first = part_incl - torch.where(multi, nch, torch.zeros_like(nch))
    part = torch.where(multi[k], part_first[k] + c, torch.full_like(c, -1))
    bh = k.div(rix.T, rounding_mode="floor")
    s0 = k % rix.T
    items = torch.stack([bh, s0, block_len_of(rix, bh, s0), first, end, part], 1)
    size = torch.where(w < n_items, end - first, torch.full_like(end, -1))
    # Biggest first balances the persistent programs' load. Orders that keep the programs running at once on
    # fewer queries' q/dO rows (for the L2: ncu shows 21% L2 hits on those gathers) measured slower: H200,
    # bf16, Hq=64, Hkv=4, D=128, the dK/dV kernel at 16 x 4k packed 13.8 ms here against 16.4 in (batch x KV
    # head, block) order and 14.3-16.1 with 64-256-query chunks ordered by (batch x KV head, query range) or
    # (query range, batch x KV head); at 64k 16.5 against 17.1-19.9.
    # narrow keys (the same values): a radix sort takes a pass per byte of the key, so int16 sizes (at most
    # chunk) sort in 2 passes instead of 8, and the reduce rows' int32 keys below in 4
    order = torch.argsort(size.to(_narrow(chunk)), descending=True, stable=True)
    items = items[order].contiguous()

    # reduce rows: the multi-chunk blocks first, most partials first (a stable sort, no scatter)
    kk = torch.arange(K, device=dev)
    kb = kk.div(rix.T, rounding_mode="floor")
    ks = kk % rix.T
    rows = torch.stack([kb, ks, block_len_of(rix, kb, ks), part_first, part_incl], 1)
    order = torch.argsort(torch.where(multi, -nch, torch.ones_like(nch)).to(_narrow(E)), stable=True)
    reduce = rows[order].contiguous()
    n_reduce = multi.long().sum().reshape(1)
    return WorkPlan(queries=rix.queries, items=items, n_items=n_items, reduce=reduce, n_reduce=n_reduce,
                    n_partials_bound=partials_bound(E, chunk), chunk=chunk)


def _narrow(bound: int) -> torch.dtype:
    """The narrowest signed integer dtype that holds every value in [-bound, bound]."""
    return torch.int16 if bound < 2**15 else torch.int32 if bound < 2**31 else torch.int64


def block_len_of(rix: ReverseIndex, bh: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    return rix.block_len.reshape(-1)[bh.div(rix.Hkv, rounding_mode="floor") * rix.T + s0]
