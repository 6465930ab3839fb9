"""A decode step in plain PyTorch: the per-chunk branch functions of prefill (nsa.branches.*.naive) on a
chunk of one query per sequence, keys from the cache (completed compressed blocks, the selected blocks of
the raw K/V, the window ring). Each sequence sits at its own position (`cache_seqlens`), expressed in
per-sequence shifted coordinates so that the prefill masks apply unchanged. Sizes come from the cache's
host-side length bound (no device sync); under CUDA-graph capture, from its capacity (static).

    out, indices = decode_step(q, gates, cache, tokens, compress_fn)     appends the token, then attends
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attend import compute_dtype
from ..compressed.naive import compressed_chunk
from ..selected.naive import selected_chunk, topn_chunk
from ..sliding.naive import sliding_chunk


@dataclass
class TorchStepView:
    """What the torch step's branch calls see of the cache after the append (module doc: shifted coordinates)."""

    qc: torch.Tensor  # [B, 1, Hkv, G, Dk] in the compute dtype
    pos: torch.Tensor  # [B, 1] each sequence's new position t
    seq_start: torch.Tensor  # [B, 1] ref - t: sequence b starts there in shifted coordinates
    t_glob: torch.Tensor  # [1] = ref, the new tokens' shared shifted position
    cmp_local: torch.Tensor  # [B, n] start of each compressed block within its sequence
    n_cmp: int  # compressed blocks any sequence can see (static)
    n_sel_blocks: int  # selection blocks any sequence can see (static)
    win_key_pos: torch.Tensor  # [B, W] shifted position held by each window slot (-1: empty)
    scale: float


def torch_step_view(q, cache) -> TorchStepView:
    cfg = cache.config
    B, _, Hq, Dk = q.shape
    device = q.device
    # Static sizes: everything a sequence of at most `n_tok` tokens can see (the capacity while a CUDA graph
    # is captured, so that the replay serves every later step).
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    n_tok = cache.max_len if capturing else min(cache.max_seqlen_bound + 1, cache.max_len)
    n = min(cfg.n_cmp_blocks(n_tok), cache.cmp_capacity)
    t = cache.cache_seqlens.long()  # position of each sequence's new token
    ref = cache.max_len - 1  # sequence b starts at ref - t_b, so its new token sits at ref
    seq_start = (ref - t)[:, None]
    win = cache.window_positions(t)
    return TorchStepView(
        qc=q.to(compute_dtype(q.dtype)).unflatten(2, (cache.n_kv_heads, Hq // cache.n_kv_heads)),
        pos=t[:, None], seq_start=seq_start, t_glob=torch.full((1,), ref, device=device, dtype=torch.long),
        cmp_local=(torch.arange(n, device=device) * cfg.stride_cmp)[None].expand(B, n), n_cmp=n,
        n_sel_blocks=cfg.n_sel_blocks(n_tok),
        win_key_pos=torch.where(win >= 0, seq_start + win, torch.full_like(win, -1)),
        scale=cfg.softmax_scale(Dk))


def decode_step(q, gates, cache, tokens, compress_fn):
    """The step with the prefill branch functions. Returns (out [B, 1, Hq, Dv], indices int32 [B, 1, Hkv, n])."""
    cfg = cache.config
    cache.append_step(*tokens, compress_fn=compress_fn)
    B = q.shape[0]
    sv = torch_step_view(q, cache)
    ct, n = sv.qc.dtype, sv.n_cmp
    valid = torch.ones(B, n, dtype=torch.bool, device=q.device)
    k_cmp, v_cmp = cache.compressed_kv(n)
    k_cmp = k_cmp.to(ct)
    cmp_start = sv.seq_start + sv.cmp_local
    o_cmp, lse = compressed_chunk(sv.qc, k_cmp, v_cmp.to(ct), cmp_start, valid, sv.t_glob, sv.seq_start, cfg, sv.scale)
    indices = topn_chunk(sv.qc, k_cmp, lse, cmp_start, sv.cmp_local, valid, sv.t_glob, sv.seq_start,
                         sv.n_sel_blocks, cfg, sv.scale)
    k_sel, v_sel, paging = cache.selected_kv()
    o_sel = selected_chunk(sv.qc, k_sel, v_sel, indices, sv.pos, torch.zeros_like(sv.pos), cfg, sv.scale, **paging)
    o_win = sliding_chunk(sv.qc, cache.k_win.to(ct), cache.v_win.to(ct), sv.win_key_pos, sv.t_glob, sv.seq_start, cfg,
                          sv.scale)
    g = gates.to(ct)
    out = (g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 1:2] * o_sel.flatten(2, 3)
           + g[..., 2:3] * o_win.flatten(2, 3)).to(q.dtype)
    return out, indices.to(torch.int32)


__all__ = ["TorchStepView", "decode_step", "torch_step_view"]
