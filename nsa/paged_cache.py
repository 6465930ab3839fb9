"""A paged decode cache for serving engines: fixed-size pages in one shared pool, a block table per sequence.

The layout and argument names of flash-attn's `flash_attn_with_kvcache` and vLLM:

- raw K/V (what the selected branch reads): `k_pages` / `v_pages` [num_pages, page_size, Hkv, D]; position
  u of the sequence in row b lives in page `block_table[b, u // page_size]`, row `u % page_size`;
- compressed K/V: paged with the same block table. Page p holds the `page_size // stride_cmp` compressed
  blocks that start in it (block i starts at token i * stride_cmp), in `k_cmp_pages` / `v_cmp_pages`
  [num_pages, page_size // stride_cmp, Hkv, D]: freeing a sequence frees both, and a page costs
  1 + 1 / stride_cmp times its raw K/V;
- the sliding window's ring (W = min(window, capacity) slots) and the raw compression ring (block_cmp
  slots) stay per row, as in NSACache: they hold the window's and compression's own K/V (which differ
  from the selected branch's when kv_win / kv_cmp are given), and their size does not grow with the context;
- `block_table` int32 [batch, max_pages_per_seq] and `cache_seqlens` int32 [batch] on the cache's device.

Rows and pages. The cache has `batch` rows; each holds one sequence (or none: length 0). Pages come from a
host-side free list: a write or decode step that needs a new page for a row takes the next free one (so
a sequence's pages are anywhere in the pool, in any order), `free(rows)` gives a row's pages back (the next
sequence reuses them) and empties the row; `truncate(lengths)` shortens rows and gives back the pages
wholly past their new lengths. An engine that manages pages itself gives its tables with
`load_tables(block_table, cache_seqlens)` (host tensors: validated on the host, copied to the device).

Page size: a power of two and a multiple of stride_cmp (so a compressed block starts in exactly one page).
It need not be a multiple of block_sel: the selected branch looks each token's page up.

Every decode step appends one token to every row (static shapes: capturable in a CUDA graph). Pages a step
needs are taken on the host before it runs; under CUDA-graph capture that cannot happen (the table update
would be recorded), so `reserve(n)` takes the pages of the next n tokens of every row ahead of capture.
"""

from __future__ import annotations

import torch

from .cache import NSACache, _positive_int
from .config import NSAConfig
from .validation import NSAInputError


class PagedNSACache(NSACache):
    """NSACache's lengths bookkeeping, validation, rings and write/decode logic on paged K/V storage.

    It does not run NSACache.__init__ (which allocates contiguous [batch, max_len] buffers): it sets the
    state the inherited methods use itself, and replaces the storage methods (_store_tokens, _store_cmp,
    compressed_kv, selected_kv) and the sizes read from the buffers. A state added to NSACache.__init__
    must be added here too (tests/cpu/test_paged_cache.py runs every inherited path).
    """

    def __init__(self, config: NSAConfig, batch: int, num_pages: int, page_size: int, max_pages_per_seq: int,
                 n_kv_heads: int, d_k: int, d_v: int, *, device=None, dtype=torch.float32):
        if not isinstance(config, NSAConfig):
            raise NSAInputError(f"config must be an nsa.NSAConfig, got {type(config).__name__}")
        for name, value in (("batch", batch), ("num_pages", num_pages), ("page_size", page_size),
                            ("max_pages_per_seq", max_pages_per_seq), ("n_kv_heads", n_kv_heads), ("d_k", d_k),
                            ("d_v", d_v)):
            _positive_int(name, value)
        if page_size & (page_size - 1) or page_size % config.stride_cmp:
            raise NSAInputError(f"page_size must be a power of two and a multiple of stride_cmp "
                                f"({config.stride_cmp}), got {page_size}")
        self.config = config
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_len = max_pages_per_seq * page_size  # a sequence's capacity (its block table's reach)
        kw = dict(device=device, dtype=dtype)
        self.k_pages = torch.zeros(num_pages, page_size, n_kv_heads, d_k, **kw)
        self.v_pages = torch.zeros(num_pages, page_size, n_kv_heads, d_v, **kw)
        # One extra compressed slot past the pool: writes of blocks that do not complete go there (never read)
        cpp = page_size // config.stride_cmp
        self._k_cmp_flat = torch.zeros(num_pages * cpp + 1, n_kv_heads, d_k, **kw)
        self._v_cmp_flat = torch.zeros(num_pages * cpp + 1, n_kv_heads, d_v, **kw)
        self.k_cmp_pages = self._k_cmp_flat[:-1].view(num_pages, cpp, n_kv_heads, d_k)
        self.v_cmp_pages = self._v_cmp_flat[:-1].view(num_pages, cpp, n_kv_heads, d_v)
        w = min(config.window, self.max_len)
        self.k_win = torch.zeros(batch, w, n_kv_heads, d_k, **kw)
        self.v_win = torch.zeros(batch, w, n_kv_heads, d_v, **kw)
        self.k_raw_cmp = torch.zeros(batch, config.block_cmp, n_kv_heads, d_k, **kw)
        self.v_raw_cmp = torch.zeros(batch, config.block_cmp, n_kv_heads, d_v, **kw)
        dev = self.k_pages.device
        self.block_table = torch.zeros(batch, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=dev)
        self._pages: list[list[int]] = [[] for _ in range(batch)]  # host copy of each row's pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() takes page 0 first
        self._base = [0] * batch
        self._base_max = self._base_min = self._steps = 0
        self._external = False  # pages managed by the engine (load_tables), not by the free list
        self.workspaces: dict = {}
        self.rings_hold_raw = {"cmp": True, "win": True}

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_table.shape[1]

    @property
    def n_kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def d_k(self) -> int:
        return self.k_pages.shape[3]

    @property
    def d_v(self) -> int:
        return self.v_pages.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages.dtype

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    def cmp_capacity(self) -> int:
        return max(self.config.n_cmp_blocks(self.max_len), 1)

    @property
    def cmp_per_page(self) -> int:
        return self.page_size // self.config.stride_cmp

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_of(self, row: int) -> list[int]:
        """The pages of the sequence in `row`, in position order (host copy)."""
        return list(self._pages[row])

    # -- pages ---------------------------------------------------------------------------------------------
    def check_room(self, new_tokens: list[int] | int) -> None:
        """Refuse a write past a row's capacity or the pool, else take the pages it needs (before any write)."""
        news = [new_tokens] * self.batch if isinstance(new_tokens, int) else new_tokens
        over = [(b, n + x) for b, (n, x) in enumerate(zip(self.host_seqlens(), news)) if n + x > self.max_len]
        if over:
            b, need = over[0]
            raise NSAInputError(f"cache overflow: sequence {b} would hold {need} tokens > max_pages_per_seq x "
                                f"page_size = {self.max_len}; create the cache with a larger max_pages_per_seq")
        need = [max(0, -(-(n + x) // self.page_size) - len(p))
                for n, x, p in zip(self.host_seqlens(), news, self._pages)]
        if sum(need) == 0:
            return
        if self._external:
            b = next(b for b, n in enumerate(need) if n)
            raise NSAInputError(f"block_table is too short: row {b} needs {need[b]} more page(s) of {self.page_size} "
                                "for this write; the engine manages the pages (load_tables): give them first")
        if sum(need) > len(self._free):
            raise NSAInputError(f"page pool exhausted: this write needs {sum(need)} new pages, {len(self._free)} "
                                f"are free (of num_pages={self.num_pages}); free finished sequences "
                                "(cache.free(rows)) or create the cache with more pages")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise NSAInputError("the step needs new pages while a CUDA graph is captured (the table update would "
                                "be recorded): call cache.reserve(n) before capturing")
        rows, cols, pages = [], [], []
        for b, n in enumerate(need):
            for _ in range(n):
                page = self._free.pop()
                rows.append(b)
                cols.append(len(self._pages[b]))
                pages.append(page)
                self._pages[b].append(page)
        self.block_table[rows, cols] = torch.tensor(pages, dtype=torch.int32).to(self.device, non_blocking=True)

    def reserve(self, new_tokens: int) -> None:
        """Take the pages of every row's next `new_tokens` tokens now (before capturing a CUDA graph)."""
        if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 0:
            raise NSAInputError(f"new_tokens must be an int >= 0, got {new_tokens!r}")
        self.check_room(new_tokens)

    def free(self, rows) -> None:
        """End the sequences in `rows` (int or list): their pages go back to the pool, their lengths to 0."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        for b in rows:
            if not (isinstance(b, int) and not isinstance(b, bool) and 0 <= b < self.batch):
                raise NSAInputError(f"rows must be row indices in [0, {self.batch}), got {b!r}")
        lengths = self.host_seqlens()
        for b in rows:
            if not self._external:
                self._free.extend(reversed(self._pages[b]))  # the last page freed is the next taken
            self._pages[b] = []
            lengths[b] = 0
        self.cache_seqlens[rows] = 0
        self._set_base(lengths)

    def reset(self) -> None:
        self.free(list(range(self.batch)))

    def truncate(self, lengths) -> None:
        """NSACache.truncate (rows shortened to `lengths`, as if they never held more), and the pages.

        Where the cache owns the pages (its free list: writes, `reserve`, `free`), the pages of a row wholly
        past its new length go back to the pool (the last one given back is the next taken) and
        `pages_of(row)` loses them; pages taken by `reserve` past the new length go back too (reserve again
        before capturing a CUDA graph). Where the engine owns the block table (`load_tables`), the table and
        the pages stay as they are: the engine frees or reuses them, and the next writes go to the same pages.
        """
        super().truncate(lengths)

    def _release(self, lengths: list[int]) -> None:
        if self._external:
            return
        for b, n in enumerate(lengths):
            keep = -(-n // self.page_size)
            self._free.extend(reversed(self._pages[b][keep:]))
            del self._pages[b][keep:]

    def load_tables(self, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
        """Adopt an engine's tables (it manages the pages): block_table int32 [batch, n <= max_pages_per_seq],
        cache_seqlens int32 [batch], both on the host (validated there, then copied to the device).

        Row b's pages are its leading non-negative entries, -1 pads the rest: they must cover its
        cache_seqlens[b] tokens, and may go further (pages given ahead for the next writes, as an engine
        allocates them before a step). The cache's own free list is not used while the engine manages the
        pages: a write past a row's pages raises."""
        for name, x in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
            if not isinstance(x, torch.Tensor) or x.dtype != torch.int32:
                raise NSAInputError(f"{name} must be an int32 torch.Tensor, got "
                                    f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if cache_seqlens.shape != (self.batch,):
            raise NSAInputError(f"cache_seqlens must have shape [batch={self.batch}], got {tuple(cache_seqlens.shape)}")
        if (block_table.dim() != 2 or block_table.shape[0] != self.batch
                or block_table.shape[1] > self.max_pages_per_seq):
            raise NSAInputError(f"block_table must have shape [batch={self.batch}, n <= max_pages_per_seq="
                                f"{self.max_pages_per_seq}], got {tuple(block_table.shape)}")
        lengths = cache_seqlens.tolist()  # host tensors: no device synchronisation
        table = block_table.tolist()
        pages = []
        for b, (n, row) in enumerate(zip(lengths, table)):
            given = next((i for i, p in enumerate(row) if p < 0), len(row))
            if any(p != -1 for p in row[given:]):
                raise NSAInputError(f"block_table row {b}: after its pages only -1 (padding) may follow, got "
                                    f"{row[given:]}")
            used = -(-n // self.page_size)
            if n < 0 or used > given:
                raise NSAInputError(f"block_table is too short: row {b} holds {n} tokens, which need {used} pages "
                                    f"of {self.page_size}, the table gives {given}")
            bad = [p for p in row[:given] if p >= self.num_pages]
            if bad:
                raise NSAInputError(f"block_table row {b} names page {bad[0]}, outside the pool [0, {self.num_pages})")
            pages.append(row[:given])
        seen = [p for row in pages for p in row]
        if len(set(seen)) != len(seen):
            raise NSAInputError("block_table gives one page to two positions (pages in use must be distinct)")
        self._pages = pages
        self._free = []
        self._external = True
        self.block_table.zero_()
        self.block_table[:, :block_table.shape[1]] = block_table.to(self.device, non_blocking=True)
        self.cache_seqlens.copy_(cache_seqlens.to(self.device, non_blocking=True))
        self._set_base(lengths)

    # -- storage -------------------------------------------------------------------------------------------
    def slots(self, b, pos):
        """Flat row (page * page_size + offset) of positions pos of rows b in k_pages.flatten(0, 1)."""
        page = self.block_table[b, torch.div(pos, self.page_size, rounding_mode="floor")].long()
        return page * self.page_size + pos % self.page_size

    def _cmp_slots(self, b, i):
        start = i * self.config.stride_cmp
        # clamped: a block past a row's pages has no page (its garbage entry is never read, nor written)
        col = torch.div(start, self.page_size, rounding_mode="floor").clamp(0, self.max_pages_per_seq - 1)
        page = self.block_table[b, col].long().clamp(0, self.num_pages - 1)
        return page * self.cmp_per_page + torch.div(start % self.page_size, self.config.stride_cmp,
                                                    rounding_mode="floor")

    def _store_tokens(self, b, pos, k, v) -> None:
        s = self.slots(b, pos)
        self.k_pages.view(-1, *self.k_pages.shape[2:])[s] = k
        self.v_pages.view(-1, *self.v_pages.shape[2:])[s] = v

    def _load_tokens(self, b, pos) -> tuple:
        s = self.slots(b, pos)
        return self.k_pages.flatten(0, 1)[s], self.v_pages.flatten(0, 1)[s]

    def _store_cmp(self, b, i, done, kc, vc) -> None:
        # blocks that do not complete write to the spare slot: no two live blocks share a slot
        s = torch.where(done, self._cmp_slots(b, i), torch.full_like(done, self._k_cmp_flat.shape[0] - 1,
                                                                      dtype=torch.long))
        s = s.expand(kc.shape[:-2])
        self._k_cmp_flat[s] = kc
        self._v_cmp_flat[s] = vc

    def compressed_kv(self, n: int, row: int | None = None):
        i = torch.arange(n, device=self.device)[None]
        b = torch.arange(self.batch, device=self.device) if row is None else torch.tensor([row], device=self.device)
        s = self._cmp_slots(b[:, None], i)
        return self._k_cmp_flat[s], self._v_cmp_flat[s]

    def selected_kv(self, row: int | None = None) -> tuple:
        table = self.block_table if row is None else self.block_table[row:row + 1]
        return self.k_pages, self.v_pages, {"block_table": table, "page_size": self.page_size}

    def token_kv(self, row: int, length: int | None = None):
        """Raw K/V [length, Hkv, D] of the sequence in `row` (tests, debugging)."""
        n = self.host_seqlens()[row] if length is None else length
        s = self.slots(torch.full((n,), row, device=self.device), torch.arange(n, device=self.device))
        return self.k_pages.flatten(0, 1)[s], self.v_pages.flatten(0, 1)[s]


__all__ = ["PagedNSACache"]
