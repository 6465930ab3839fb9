"""The decode cache: what the three branches need, preallocated once.

- selected branch: raw K/V of every position, [B, max_len, Hkv, D] (selection may pick any past block);
- sliding branch: a ring buffer of the last `window` K/V and the position held in each slot;
- compressed branch: a ring of the last `block_cmp` raw K/V (to compress the next block) and the
  compressed K/V [B, max_blocks, Hkv, D], extended by one entry each time a block completes, i.e. at
  position t with t - l + 1 >= 0 and (t - l + 1) % d == 0.
A decode step writes one slot of each buffer: no torch.cat over the history, no Python work that grows
with it. Every sequence of the batch is at the same position (`length`, kept on the host).
"""

from __future__ import annotations

import torch

from .config import NSAConfig
from .validation import NSAInputError


class NSACache:
    def __init__(self, config: NSAConfig, batch: int, max_len: int, n_kv_heads: int, d_k: int, d_v: int,
                 *, device=None, dtype=torch.float32):
        if max_len < 1:
            raise NSAInputError(f"max_len must be >= 1, got {max_len}")
        self.config = config
        self.max_len = max_len
        self.length = 0
        w = min(config.window, max_len)
        kw = dict(device=device, dtype=dtype)
        self.k_sel = torch.zeros(batch, max_len, n_kv_heads, d_k, **kw)
        self.v_sel = torch.zeros(batch, max_len, n_kv_heads, d_v, **kw)
        self.k_win = torch.zeros(batch, w, n_kv_heads, d_k, **kw)
        self.v_win = torch.zeros(batch, w, n_kv_heads, d_v, **kw)
        self.win_pos = torch.full((w,), -1, dtype=torch.long, device=device)
        self.k_raw_cmp = torch.zeros(batch, config.block_cmp, n_kv_heads, d_k, **kw)
        self.v_raw_cmp = torch.zeros(batch, config.block_cmp, n_kv_heads, d_v, **kw)
        n_blocks = max(config.n_cmp_blocks(max_len), 1)
        self.k_cmp = torch.zeros(batch, n_blocks, n_kv_heads, d_k, **kw)
        self.v_cmp = torch.zeros(batch, n_blocks, n_kv_heads, d_v, **kw)
        self.n_cmp = 0

    @property
    def batch(self) -> int:
        return self.k_sel.shape[0]

    def _check(self, name, x, D):
        want = (self.batch, None, self.k_sel.shape[2], D)
        if x.dim() != 4 or x.shape[0] != want[0] or x.shape[2] != want[2] or x.shape[3] != D:
            raise NSAInputError(f"{name} must have shape [B={want[0]}, T, Hkv={want[2]}, {D}], got {tuple(x.shape)}")
        if x.device != self.k_sel.device:
            raise NSAInputError(f"{name} is on {x.device}, the cache on {self.k_sel.device}")
        if x.dtype != self.k_sel.dtype:
            raise NSAInputError(f"{name} has dtype {x.dtype}, the cache holds {self.k_sel.dtype}: "
                                "create the cache with the model's dtype")

    def write(self, k, v, kv_cmp=None, kv_win=None, compress_fn=None) -> None:
        """Append T new tokens (prefill: T = prompt length; decode: T = 1). k, v [B, T, Hkv, D]."""
        self._check("k", k, self.k_sel.shape[3])
        self._check("v", v, self.v_sel.shape[3])
        T = k.shape[1]
        t0, t1 = self.length, self.length + T
        if t1 > self.max_len:
            raise NSAInputError(f"cache overflow: {t1} tokens > max_len={self.max_len}")
        kc, vc = kv_cmp if kv_cmp is not None else (k, v)
        kw, vw = kv_win if kv_win is not None else (k, v)
        for name, x, D in (("kv_cmp[k]", kc, self.k_sel.shape[3]), ("kv_cmp[v]", vc, self.v_sel.shape[3]),
                           ("kv_win[k]", kw, self.k_sel.shape[3]), ("kv_win[v]", vw, self.v_sel.shape[3])):
            self._check(name, x, D)
        cfg = self.config
        with torch.no_grad():
            self.k_sel[:, t0:t1] = k
            self.v_sel[:, t0:t1] = v
            # Window ring: only the last `w` of the new tokens can survive.
            w = self.k_win.shape[1]
            keep = torch.arange(max(t0, t1 - w), t1, device=self.win_pos.device)
            slots = keep % w
            self.k_win[:, slots] = kw[:, keep - t0].to(self.k_win.dtype)
            self.v_win[:, slots] = vw[:, keep - t0].to(self.v_win.dtype)
            self.win_pos[slots] = keep
            # Compressed blocks completed by these tokens; their raw tokens come from the new input and
            # the raw ring (tokens before t0).
            first = cfg.n_cmp_blocks(t0)
            last = cfg.n_cmp_blocks(t1)
            if last > first:
                starts = torch.arange(first, last, device=k.device) * cfg.stride_cmp
                tok = starts[:, None] + torch.arange(cfg.block_cmp, device=k.device)  # [N, l]
                kb = self._tokens(kc, self.k_raw_cmp, tok, t0)
                vb = self._tokens(vc, self.v_raw_cmp, tok, t0)
                if compress_fn is None:
                    kcmp, vcmp = kb.mean(dim=2), vb.mean(dim=2)
                else:
                    B, N = kb.shape[:2]
                    kcmp = compress_fn[0](kb.flatten(0, 1)).unflatten(0, (B, N))
                    vcmp = compress_fn[1](vb.flatten(0, 1)).unflatten(0, (B, N))
                self.k_cmp[:, first:last] = kcmp
                self.v_cmp[:, first:last] = vcmp
                self.n_cmp = last
            keep = torch.arange(max(t0, t1 - cfg.block_cmp), t1, device=k.device)
            self.k_raw_cmp[:, keep % cfg.block_cmp] = kc[:, keep - t0].to(self.k_raw_cmp.dtype)
            self.v_raw_cmp[:, keep % cfg.block_cmp] = vc[:, keep - t0].to(self.v_raw_cmp.dtype)
        self.length = t1

    def _tokens(self, new, ring, tok, t0):
        """Raw tokens at positions tok [N, l]: from `new` when >= t0, else from the ring (position % l)."""
        from_new = tok >= t0
        idx_new = torch.where(from_new, tok - t0, torch.zeros_like(tok))
        idx_ring = tok % ring.shape[1]
        a = new[:, idx_new].to(ring.dtype)
        b = ring[:, idx_ring]
        return torch.where(from_new[None, :, :, None, None], a, b)

    def reset(self) -> None:
        self.length = 0
        self.n_cmp = 0
        self.win_pos.fill_(-1)

    def kv_bytes_read_per_step(self, n_selected_tokens: int) -> int:
        """Bytes of K/V one decode step reads: compressed blocks + selected tokens + window, per batch row."""
        per_tok = (self.k_sel.shape[3] + self.v_sel.shape[3]) * self.k_sel.shape[2] * self.k_sel.element_size()
        n_win = min(self.length, self.k_win.shape[1])
        return self.batch * per_tok * (self.n_cmp + n_selected_tokens + n_win)
