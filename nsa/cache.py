"""The decode cache: what the three branches need, preallocated once, for a batch of sequences of any lengths.

- selected branch: raw K/V of every position, [B, max_len, Hkv, D] (selection may pick any past block);
- sliding branch: a ring buffer of the last `window` K/V (slot = position % window);
- compressed branch: a ring of the last `block_cmp` raw K/V (to compress the next block) and the
  compressed K/V [B, max_blocks, Hkv, D], extended by one entry each time a block completes, i.e. at
  position t with t - l + 1 >= 0 and (t - l + 1) % d == 0.

Lengths. `cache_seqlens` (int32 [B], on the cache's device) holds each sequence's length, as in serving
engines (flash-attn's `flash_attn_with_kvcache`, vLLM): sequence b's next token goes to position
`cache_seqlens[b]`. A prefill fills it (`write`, dense [B, T] input or sequences packed along T with
`cu_seqlens`, B == 1, one entry per cache row); every decode step appends one token to every sequence at
its own position. Nothing reads the lengths back to the host per step: the cache keeps a host-side copy
(`host_seqlens()`, exact as long as the cache is written through this API) that is updated with integer
arithmetic only (O(1) per decode step) and serves to size work and to refuse an overflow of `max_len`
before anything is written.

A decode step writes one slot of each buffer: no torch.cat over the history. Its writes only touch slots
that are dead (ring slots of positions that no future query sees) or past the sequence's length, and the
new length is published last (`cache_seqlens += 1`): a step that raises before that leaves the cache
exactly as it was, as far as any later call can tell.

Rollback. `truncate(lengths)` shortens rows to given lengths (speculative decoding drops the rejected draft
tokens after a verify step): the state becomes that of rows that only ever held their first `lengths`
tokens. Only lengths move for the raw K/V and the compressed blocks (those that needed a dropped token
lie past the new length, are masked by position, and are emitted again as tokens arrive); the two rings
refill, from the raw K/V, the slots that dropped tokens overwrote.
"""

from __future__ import annotations

import torch

from .config import NSAConfig
from .layout import sequence_of
from .validation import NSAInputError


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise NSAInputError(f"{name} must be a positive int, got {value!r}")
    return value


def n_cmp_blocks_dev(length: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """Completed compressed blocks of sequences of the given lengths (device tensor, any int dtype)."""
    full = torch.div(length - cfg.block_cmp, cfg.stride_cmp, rounding_mode="floor") + 1
    return torch.where(length >= cfg.block_cmp, full, torch.zeros_like(full))


class NSACache:
    def __init__(self, config: NSAConfig, batch: int, max_len: int, n_kv_heads: int, d_k: int, d_v: int,
                 *, device=None, dtype=torch.float32):
        if not isinstance(config, NSAConfig):
            raise NSAInputError(f"config must be an nsa.NSAConfig, got {type(config).__name__}")
        for name, value in (("batch", batch), ("max_len", max_len), ("n_kv_heads", n_kv_heads), ("d_k", d_k),
                            ("d_v", d_v)):
            _positive_int(name, value)
        self.config = config
        self.max_len = max_len
        w = min(config.window, max_len)
        kw = dict(device=device, dtype=dtype)
        self.k_sel = torch.zeros(batch, max_len, n_kv_heads, d_k, **kw)
        self.v_sel = torch.zeros(batch, max_len, n_kv_heads, d_v, **kw)
        self.k_win = torch.zeros(batch, w, n_kv_heads, d_k, **kw)
        self.v_win = torch.zeros(batch, w, n_kv_heads, d_v, **kw)
        self.k_raw_cmp = torch.zeros(batch, config.block_cmp, n_kv_heads, d_k, **kw)
        self.v_raw_cmp = torch.zeros(batch, config.block_cmp, n_kv_heads, d_v, **kw)
        n_blocks = max(config.n_cmp_blocks(max_len), 1)
        self.k_cmp = torch.zeros(batch, n_blocks, n_kv_heads, d_k, **kw)
        self.v_cmp = torch.zeros(batch, n_blocks, n_kv_heads, d_v, **kw)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=self.k_sel.device)
        # Host copy of the lengths: per-sequence base (set by write) + decode steps since (O(1) per step).
        self._base = [0] * batch
        self._base_max = 0
        self._base_min = 0
        self._steps = 0
        self.workspaces: dict = {}  # preallocated buffers of fast decode steps, keyed by their owner
        self.rings_hold_raw = {"cmp": True, "win": True}  # see branch_tokens: truncate refills rings from raw K/V

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.k_sel.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.k_sel.shape[2]

    @property
    def d_k(self) -> int:
        return self.k_sel.shape[3]

    @property
    def d_v(self) -> int:
        return self.v_sel.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_sel.dtype

    @property
    def device(self) -> torch.device:
        return self.k_sel.device

    @property
    def window_slots(self) -> int:
        return self.k_win.shape[1]

    @property
    def cmp_capacity(self) -> int:
        return self.k_cmp.shape[1]

    # -- host-side lengths (no device sync) -------------------------------------------------------------
    def host_seqlens(self) -> list[int]:
        """Each sequence's length as the host knows it (exact when the cache is written through this API)."""
        return [x + self._steps for x in self._base]

    @property
    def max_seqlen_bound(self) -> int:
        """Upper bound on max(cache_seqlens), kept on the host: sizes work and catches overflows early."""
        return self._base_max + self._steps

    @property
    def min_seqlen(self) -> int:
        return self._base_min + self._steps

    @property
    def is_empty(self) -> bool:
        return self.max_seqlen_bound == 0

    @property
    def length(self) -> int:
        """The common length of all sequences; a ragged cache has none (read `cache_seqlens` instead)."""
        if self._base_max != self._base_min:
            raise NSAInputError("the cache's sequences have different lengths (ragged batch): there is no single "
                                "`length`; read `cache_seqlens` (device) or `host_seqlens()`")
        return self._base_max + self._steps

    @property
    def n_cmp(self) -> int:
        """Completed compressed blocks of every sequence (uniform caches only, like `length`)."""
        return self.config.n_cmp_blocks(self.length)

    def reset(self) -> None:
        """Empty every sequence. Buffers are not cleared: whatever lies past a length is never read."""
        self.cache_seqlens.zero_()
        self._set_base([0] * self.batch)

    def host_state(self) -> tuple:
        """The host copy of the lengths, to put back after recording a step that did not run (graph capture)."""
        return tuple(self._base), self._steps

    def set_host_state(self, state: tuple) -> None:
        base, steps = state
        self._set_base(list(base))
        self._steps = steps

    def _set_base(self, lengths: list[int]) -> None:
        self._base = list(lengths)
        self._base_max = max(lengths)
        self._base_min = min(lengths)
        self._steps = 0

    # -- validation ------------------------------------------------------------------------------------------
    def check_tokens(self, name: str, x, D: int, *, batch: int | None = None) -> None:
        """x must be [B, T, Hkv, D] in the cache's dtype, on its device (B = the cache's batch unless given)."""
        B = self.batch if batch is None else batch
        if not isinstance(x, torch.Tensor):
            raise NSAInputError(f"{name} must be a torch.Tensor [B={B}, T, Hkv={self.n_kv_heads}, {D}], "
                                f"got {type(x).__name__}")
        if x.dim() != 4 or x.shape[0] != B or x.shape[2] != self.n_kv_heads or x.shape[3] != D:
            raise NSAInputError(f"{name} must have shape [B={B}, T, Hkv={self.n_kv_heads}, {D}], got {tuple(x.shape)}")
        if x.device != self.device:
            raise NSAInputError(f"{name} is on {x.device}, the cache on {self.device}")
        if x.dtype != self.dtype:
            raise NSAInputError(f"{name} has dtype {x.dtype}, the cache holds {self.dtype}: "
                                "create the cache with the model's dtype")

    def branch_tokens(self, k, v, kv_cmp=None, kv_win=None, *, batch: int | None = None) -> tuple:
        """(k, v, kc, vc, kw, vw): new tokens for the cache, checked, one (k, v) pair per branch.

        k, v [B, T, Hkv, D] and the optional kv_cmp / kv_win pairs (a branch's own projections, as
        nsa_attention takes them) must each match the cache (check_tokens) and hold the same T tokens; a
        missing pair is (k, v). B is the cache's batch, or `batch` (1 for packed input). Raises
        NSAInputError naming the argument; writes nothing. nsa_decode and nsa_prefill check their input
        with it before anything is written, and write() before writing."""
        self.check_tokens("k", k, self.d_k, batch=batch)
        self.check_tokens("v", v, self.d_v, batch=batch)
        pairs = {}
        for name, kv in (("kv_cmp", kv_cmp), ("kv_win", kv_win)):
            if kv is None:
                pairs[name] = (k, v)
                continue
            if not (isinstance(kv, (tuple, list)) and len(kv) == 2):
                raise NSAInputError(f"{name} must be a (k, v) pair of tensors")
            self.check_tokens(f"{name}[k]", kv[0], self.d_k, batch=batch)
            self.check_tokens(f"{name}[v]", kv[1], self.d_v, batch=batch)
            if kv[0].shape[1] != k.shape[1] or kv[1].shape[1] != k.shape[1]:
                raise NSAInputError(f"{name} must hold as many tokens as k ({k.shape[1]}), got "
                                    f"{kv[0].shape[1]} and {kv[1].shape[1]}")
            pairs[name] = (kv[0], kv[1])
        if v.shape[1] != k.shape[1]:
            raise NSAInputError(f"v must hold as many tokens as k ({k.shape[1]}), got {v.shape[1]}")
        # Whether each ring still holds nothing but the raw (selected) K/V: then truncate can refill the ring
        # slots that dropped tokens overwrote from the raw K/V. A branch's own K/V is kept nowhere else.
        for ring, name in (("cmp", "kv_cmp"), ("win", "kv_win")):
            if pairs[name][0] is not k or pairs[name][1] is not v:
                self.rings_hold_raw[ring] = False
        return (k, v) + tuple(pairs["kv_cmp"]) + tuple(pairs["kv_win"])

    def check_cu_seqlens(self, cu_seqlens, total: int) -> list[int]:
        """Offsets of one sequence per cache row packed along T: int32 [batch + 1] on the cache's device."""
        if not isinstance(cu_seqlens, torch.Tensor):
            raise NSAInputError(f"cu_seqlens must be an int32 torch.Tensor [batch + 1 = {self.batch + 1}], got "
                                f"{type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32:
            raise NSAInputError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() != self.batch + 1:
            raise NSAInputError(f"cu_seqlens must be 1-D with batch + 1 = {self.batch + 1} entries (one sequence per "
                                f"cache row), got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != self.device:
            raise NSAInputError(f"cu_seqlens is on {cu_seqlens.device}, the cache on {self.device}")
        host = cu_seqlens.tolist()  # once per prefill, never per decode step
        if host[0] != 0 or any(b < a for a, b in zip(host, host[1:])) or host[-1] != total:
            raise NSAInputError(f"cu_seqlens must start at 0, be non-decreasing and end at the packed length {total}, "
                                f"got {host[:16]}{'...' if len(host) > 16 else ''}")
        return host

    def check_room(self, new_tokens: list[int] | int) -> None:
        """Refuse (before anything is written) a write that would pass max_len for any sequence."""
        lengths = self.host_seqlens()
        news = [new_tokens] * self.batch if isinstance(new_tokens, int) else new_tokens
        over = [(b, n + x) for b, (n, x) in enumerate(zip(lengths, news)) if n + x > self.max_len]
        if over:
            b, need = over[0]
            raise NSAInputError(f"cache overflow: sequence {b} would hold {need} tokens > max_len={self.max_len} "
                                f"({len(over)} sequence(s) too long); create the cache with a larger max_len")

    # -- writes ------------------------------------------------------------------------------------------
    def write(self, k, v, kv_cmp=None, kv_win=None, compress_fn=None, *, cu_seqlens=None) -> None:
        """Append new tokens to every sequence, each at its own length, and complete compressed blocks.

        Dense input k, v [B, T, Hkv, D] (B = the cache's batch): T tokens per sequence. Packed input
        k, v [1, total, Hkv, D] with cu_seqlens (int32 [batch + 1]): sequence b gets tokens
        cu_seqlens[b]:cu_seqlens[b+1]. kv_cmp / kv_win: (k, v) of those branches when they have their own
        projections; compress_fn: (phi_k, phi_v) for config.compress == "mlp". Runs on the device with
        static shapes; O(tokens + window) work, plus the compressed blocks that complete.
        """
        if cu_seqlens is None:
            k, v, kc, vc, kw, vw = self.branch_tokens(k, v, kv_cmp, kv_win)
            T = k.shape[1]
            news = [T] * self.batch
        else:
            k, v, kc, vc, kw, vw = self.branch_tokens(k, v, kv_cmp, kv_win, batch=1)
            host = self.check_cu_seqlens(cu_seqlens, k.shape[1])
            news = [b - a for a, b in zip(host, host[1:])]
        if self.config.compress == "mlp" and compress_fn is None:
            raise NSAInputError("config.compress='mlp' needs compress_fn=(phi_k, phi_v)")
        self.check_room(news)
        if max(news) == 0:
            return
        lengths = self.host_seqlens()
        device, B = self.device, self.batch
        start = self.cache_seqlens.long()
        if cu_seqlens is None:
            T = news[0]
            row0 = torch.arange(B, device=device) * T
            n_new = torch.full((B,), T, dtype=torch.long, device=device)
            b_of = torch.arange(B, device=device).repeat_interleave(T)
            local = torch.arange(T, device=device).repeat(B)
            flat = [x.reshape(B * T, *x.shape[2:]) for x in (k, v, kc, vc, kw, vw)]
        else:
            cu = cu_seqlens.long()
            row0, n_new = cu[:-1], cu[1:] - cu[:-1]
            tok = torch.arange(k.shape[1], device=device)
            b_of = sequence_of(cu, tok)
            local = tok - cu[b_of]
            flat = [x[0] for x in (k, v, kc, vc, kw, vw)]
        end = start + n_new
        fk, fv, fkc, fvc, fkw, fvw = flat
        cfg = self.config
        with torch.no_grad():
            pos = start[b_of] + local
            self._store_tokens(b_of, pos, fk, fv)
            # Compressed blocks completed by these tokens (before the raw ring moves on): their tokens come
            # from the new input (positions >= start) or the raw ring (the last l - 1 before it).
            i0 = cfg.n_cmp_blocks(min(lengths))
            i1 = cfg.n_cmp_blocks(max(n + x for n, x in zip(lengths, news)))
            if i1 > i0:
                slots = torch.arange(i0, i1, device=device)
                P = slots[:, None] * cfg.stride_cmp + torch.arange(cfg.block_cmp, device=device)  # [N, l]
                rel = P[None] - start[:, None, None]  # [B, N, l]
                from_new = rel >= 0
                row = (row0[:, None, None] + rel).clamp(0, fk.shape[0] - 1)
                ring = P % cfg.block_cmp
                mask = from_new[..., None, None]
                kb = torch.where(mask, fkc[row], self.k_raw_cmp[:, ring])  # [B, N, l, Hkv, Dk]
                vb = torch.where(mask, fvc[row], self.v_raw_cmp[:, ring])
                kcmp, vcmp = compress_blocks(kb, vb, compress_fn)
                done = ((slots[None] >= n_cmp_blocks_dev(start, cfg)[:, None])
                        & (slots[None] < n_cmp_blocks_dev(end, cfg)[:, None]))
                self._store_cmp(torch.arange(B, device=device)[:, None], slots[None], done, kcmp, vcmp)
            for ring_buf, src in ((self.k_win, fkw), (self.v_win, fvw), (self.k_raw_cmp, fkc), (self.v_raw_cmp, fvc)):
                _ring_update(ring_buf, src, start, end, row0)
            self.cache_seqlens.copy_(end.to(torch.int32))
        self._set_base([n + x for n, x in zip(lengths, news)])

    def append_step(self, k, v, kc, vc, kw, vw, compress_fn=None) -> None:
        """Decode: write one validated token per sequence at its own position (k.. [B, 1, Hkv, D]).

        Does not publish the new lengths (see `commit_step`): every slot written here is past the length
        or dead, so an error before the commit leaves the cache as it was.
        """
        t = self.cache_seqlens.long()
        b = torch.arange(self.batch, device=self.device)
        with torch.no_grad():
            self._store_tokens(b, t, k[:, 0], v[:, 0])
            slot = t % self.window_slots
            self.k_win[b, slot] = kw[:, 0]
            self.v_win[b, slot] = vw[:, 0]
            slot = t % self.config.block_cmp
            self.k_raw_cmp[b, slot] = kc[:, 0]
            self.v_raw_cmp[b, slot] = vc[:, 0]
            self.compress_step(compress_fn)

    def compress_step(self, compress_fn=None) -> None:
        """The compressed block completed by the token at position cache_seqlens (if any), from the raw ring."""
        cfg = self.config
        t = self.cache_seqlens.long()
        b = torch.arange(self.batch, device=self.device)
        rel = t + 1 - cfg.block_cmp
        done = (rel >= 0) & (rel % cfg.stride_cmp == 0)
        i = torch.div(rel, cfg.stride_cmp, rounding_mode="floor").clamp(0, self.cmp_capacity - 1)
        slots = (t[:, None] + 1 + torch.arange(cfg.block_cmp, device=self.device)) % cfg.block_cmp  # oldest first
        with torch.no_grad():
            kcmp, vcmp = compress_blocks(self.k_raw_cmp[b[:, None], slots][:, None],
                                         self.v_raw_cmp[b[:, None], slots][:, None], compress_fn)
            self._store_cmp(b, i, done, kcmp[:, 0], vcmp[:, 0])

    def commit_step(self, on_device: bool = True) -> None:
        """Publish one decode step: every length + 1 (on the device unless a kernel already did it)."""
        if on_device:
            self.cache_seqlens.add_(1)
        self._steps += 1

    # -- rollback ------------------------------------------------------------------------------------------
    def check_lengths(self, lengths) -> list[int]:
        """New lengths for truncate, as a host list: a list of `batch` ints or an int tensor [batch] on the
        cache's device (read back to the host here), each in [0, the row's current length]."""
        B, now = self.batch, self.host_seqlens()
        if isinstance(lengths, torch.Tensor):
            if lengths.dtype not in (torch.int32, torch.int64) or lengths.shape != (B,):
                raise NSAInputError(f"lengths must be an int32/int64 tensor of shape [batch={B}], got "
                                    f"{lengths.dtype} {tuple(lengths.shape)}")
            if lengths.device != self.device:
                raise NSAInputError(f"lengths is on {lengths.device}, the cache on {self.device}")
            host = lengths.tolist()  # the one synchronisation of a truncate (the host keeps the lengths)
        elif isinstance(lengths, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
                                                         for x in lengths) and len(lengths) == B:
            host = list(lengths)
        else:
            raise NSAInputError(f"lengths must be a list of batch={B} ints or an int tensor [batch] on the "
                                f"cache's device, got {lengths!r}")
        bad = [b for b, (x, n) in enumerate(zip(host, now)) if not 0 <= x <= n]
        if bad:
            b = bad[0]
            raise NSAInputError(f"lengths[{b}] = {host[b]} must lie in [0, {now[b]}] (row {b}'s current length): "
                                "truncate only drops tokens")
        return host

    def truncate(self, lengths) -> None:
        """Shorten each row to `lengths[b]` tokens (0 <= lengths[b] <= its length), as if it never held more.

        For speculative decoding: after appending k draft tokens (nsa_prefill into the cache) keep each
        row's accepted prefix. lengths: a list of `batch` ints, or an int32/int64 tensor [batch] on the
        cache's device; equal lengths leave a row as it is.

        What changes: the lengths (device `cache_seqlens` and the host copy); compressed blocks that needed a
        dropped token lie past the new length (masked by position, written again when their last token
        arrives); ring slots whose token was overwritten by a dropped one are refilled from the raw K/V (a
        gather of at most window + block_cmp tokens per row, on the device). A PagedNSACache also gives back
        pages wholly past the new length where it owns the pages (see PagedNSACache.truncate).

        Cost: a tensor `lengths` is read back to the host once (one synchronisation, as cu_seqlens in a
        prefill: the cache keeps its lengths on the host to size work and take pages); a list costs none
        (one host-to-device copy). Not inside a captured CUDA graph. Rows whose window or compression has
        its own K/V (kv_win / kv_cmp given) cannot be refilled: truncating them past what the ring still
        holds raises NSAInputError (and changes nothing).
        """
        new = self.check_lengths(lengths)
        old = self.host_seqlens()
        if new == old:
            return
        self._check_rings_refillable(old, new)
        new_dev = (lengths if isinstance(lengths, torch.Tensor)
                   else torch.tensor(new, dtype=torch.int32).to(self.device, non_blocking=True)).long()
        old_dev = self.cache_seqlens.long()
        with torch.no_grad():
            for ring in ("win", "cmp"):
                if self.rings_hold_raw[ring]:
                    self._refill_ring(ring, old_dev, new_dev)
            self.cache_seqlens.copy_(new_dev.to(torch.int32))
        self._release(new)
        self._set_base(new)

    def _rings(self, ring: str) -> tuple:
        return (self.k_win, self.v_win) if ring == "win" else (self.k_raw_cmp, self.v_raw_cmp)

    def _check_rings_refillable(self, old: list[int], new: list[int]) -> None:
        """Refuse a truncate that needs ring tokens a branch's own K/V held and that are overwritten."""
        cfg = self.config
        for ring, name in (("win", "kv_win"), ("cmp", "kv_cmp")):
            if self.rings_hold_raw[ring]:
                continue
            R = self._rings(ring)[0].shape[1]
            for b, (n, L) in enumerate(zip(old, new)):
                # oldest position a later token reads from the ring: the window's, or the next block's first
                need = max(0, L - R + 1) if ring == "win" else cfg.n_cmp_blocks(L) * cfg.stride_cmp
                if L < n and need < min(L, n - R):  # position p's slot was overwritten when p < n - R
                    raise NSAInputError(f"lengths[{b}] = {L}: row {b} needs the {name} K/V of positions "
                                        f"{need}..{min(L, n - R) - 1} again, which dropped tokens overwrote in "
                                        f"its ring of {R}; the cache keeps a branch's own K/V nowhere else, so "
                                        f"with {name} given a row can only drop tokens its ring still covers")

    def _refill_ring(self, ring: str, old, new) -> None:
        """Ring slot s holds the latest position p < length with p = s (mod R): refill the slots whose
        position changed with the new lengths (the raw K/V still holds every position below them)."""
        rk, rv = self._rings(ring)
        R = rk.shape[1]
        s = torch.arange(R, device=rk.device)[None]
        p_new = new[:, None] - 1 - torch.remainder(new[:, None] - 1 - s, R)
        p_old = old[:, None] - 1 - torch.remainder(old[:, None] - 1 - s, R)
        lost = ((p_new >= 0) & (p_new != p_old))[..., None, None]
        b = torch.arange(self.batch, device=rk.device)[:, None].expand_as(p_new)
        k, v = self._load_tokens(b, p_new.clamp(min=0))
        rk.copy_(torch.where(lost, k, rk))
        rv.copy_(torch.where(lost, v, rv))

    def _release(self, lengths: list[int]) -> None:
        """Storage beyond the new lengths (a paged cache gives pages back): nothing to do here."""

    # -- storage: where tokens and compressed blocks live (a paged cache replaces these) ----------------------
    def _store_tokens(self, b, pos, k, v) -> None:
        """Raw K/V of the tokens at positions pos of sequences b (long tensors of one shape, rows of k/v)."""
        self.k_sel[b, pos] = k
        self.v_sel[b, pos] = v

    def _load_tokens(self, b, pos) -> tuple:
        """Raw K/V of the tokens at positions pos of sequences b ([*pos.shape, Hkv, D] each)."""
        return self.k_sel[b, pos], self.v_sel[b, pos]

    def _store_cmp(self, b, i, done, kc, vc) -> None:
        """Compressed block i of sequence b := kc/vc where `done` (b, i, done broadcast to kc's leading dims)."""
        mask = done[..., None, None]
        self.k_cmp[b, i] = torch.where(mask, kc, self.k_cmp[b, i])
        self.v_cmp[b, i] = torch.where(mask, vc, self.v_cmp[b, i])

    def compressed_kv(self, n: int, row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n compressed blocks of every sequence (or of `row` only), [B or 1, n, Hkv, D]; entries
        past a sequence's own blocks are stale or zero: the branches mask them by position."""
        rows = slice(None) if row is None else slice(row, row + 1)
        return self.k_cmp[rows, :n], self.v_cmp[rows, :n]

    def selected_kv(self, row: int | None = None) -> tuple:
        """(k, v, page kwargs) for nsa.branches.selected.naive.selected_chunk: raw K/V by position, of every
        sequence or of `row` only."""
        rows = slice(None) if row is None else slice(row, row + 1)
        return self.k_sel[rows], self.v_sel[rows], {}

    # -- what the branches read ----------------------------------------------------------------------------
    def window_positions(self, t: torch.Tensor) -> torch.Tensor:
        """Position held by each window slot [B, W] once the token at t [B] is written (-1: empty)."""
        W = self.window_slots
        s = torch.arange(W, device=t.device)
        p = t[:, None] - torch.remainder(t[:, None] - s[None], W)
        return torch.where(p >= 0, p, torch.full_like(p, -1))

    def workspace(self, key, factory):
        """A preallocated buffer set of a fast decode path, made once per key and reused by every step."""
        ws = self.workspaces.get(key)
        if ws is None:
            ws = self.workspaces[key] = factory()
        return ws


def compress_blocks(kb, vb, compress_fn=None):
    """kb/vb [B, N, l, Hkv, D] -> compressed [B, N, Hkv, D]: the mean, or phi (compress_fn) over each block."""
    if compress_fn is None:
        return kb.mean(dim=2), vb.mean(dim=2)
    B, N = kb.shape[:2]
    return (compress_fn[0](kb.flatten(0, 1)).unflatten(0, (B, N)),
            compress_fn[1](vb.flatten(0, 1)).unflatten(0, (B, N)))


def _ring_update(ring, flat, start, end, row0) -> None:
    """ring [B, W, ...] after appending tokens [start, end) of each sequence (rows row0 + i of flat).

    Slot s ends up holding the latest position p < end with p = s (mod W): from the new tokens when
    p >= start, else it keeps its old content. A gather over [B, W]: static shapes, no duplicate writes.
    """
    W = ring.shape[1]
    s = torch.arange(W, device=ring.device)
    p = end[:, None] - 1 - torch.remainder(end[:, None] - 1 - s[None], W)
    from_new = p >= start[:, None]
    row = (row0[:, None] + p - start[:, None]).clamp(0, flat.shape[0] - 1)
    ring.copy_(torch.where(from_new[..., None, None], flat[row], ring))
