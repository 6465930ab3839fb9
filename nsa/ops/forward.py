"""The `torch` backend: NSA forward (and, through autograd, backward) over chunks of queries.

Memory is bounded by processing `chunk` queries at a time: per chunk the compressed branch sees at most
T/d blocks, the selected branch gathers n*l' tokens per query and KV head, the sliding branch a band of
chunk + w - 1 keys, so time and memory grow as T * (T/d + n*l' + w), never as a dense [T, T] tensor.
With autograd on, each chunk is recomputed in the backward (activation checkpointing) so the saved
state stays at one chunk's size.

When a fast provider serves the selected branch (`providers.sel`, the Triton kernel), the chunk loop
computes the block indices and the cmp + win part of the output per chunk (no torch selected branch),
then one provider call over the whole T produces o_sel from all the indices, and the output is
`partial + g_sel * o_sel`. Without it, every chunk runs the torch selected branch as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..config import NSAConfig
from . import branches
from .layout import SeqLayout, gather_blocks

# Elements of the largest per-chunk intermediate: a few hundred MB on CPU, a few GB on a GPU, where
# larger chunks mean fewer kernel launches. NSA_TORCH_CHUNK_BUDGET overrides both.
DEFAULT_CHUNK_BUDGET = {"cpu": 1 << 26, "cuda": 1 << 28}


@dataclass
class BranchProviders:
    """Hooks that let fast backends replace a branch while the torch backend does the rest.

    Each takes the full-length tensors and returns [B, T, Hq, Dv] outputs (plus, for cmp, the
    per-query log-sum-exp used to recompute selection probabilities), or None to use torch.
    """

    cmp: Callable | None = None
    win: Callable | None = None
    # sel(q, k, v, indices [B, T, Hkv, n] int32, layout, cfg, scale) -> o_sel [B, T, Hq, Dv] (whole T)
    sel: Callable | None = None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def compress_kv(k, v, layout: SeqLayout, cfg: NSAConfig, compress_fn=None):
    """Compressed K/V [B, Nc, Hkv, D] for every slot of the layout (phi = mean unless compress_fn)."""
    if layout.n_cmp == 0:
        B, _, H, _ = k.shape
        return k.new_zeros(B, 0, H, k.shape[-1]), v.new_zeros(B, 0, H, v.shape[-1])
    kb = gather_blocks(k, layout.cmp_start, cfg.block_cmp)
    vb = gather_blocks(v, layout.cmp_start, cfg.block_cmp)
    if compress_fn is None:
        return kb.mean(dim=2), vb.mean(dim=2)
    B, N = kb.shape[:2]
    return (compress_fn[0](kb.flatten(0, 1)).unflatten(0, (B, N)),
            compress_fn[1](vb.flatten(0, 1)).unflatten(0, (B, N)))


def choose_chunk(T: int, Hq: int, Hkv: int, Dk: int, Dv: int, n_cmp: int, cfg: NSAConfig, device_type="cpu") -> int:
    default = DEFAULT_CHUNK_BUDGET.get(device_type, DEFAULT_CHUNK_BUDGET["cpu"])
    budget = int(os.environ.get("NSA_TORCH_CHUNK_BUDGET", default))
    per_query = Hq * (n_cmp + cfg.n_sel * cfg.block_sel + cfg.window) + Hkv * cfg.n_sel * cfg.block_sel * (Dk + Dv)
    chunk = max(16, budget // max(per_query, 1))
    return int(min(T, chunk)) if T > 0 else 1


def _chunk(c0, c1, q, k, v, gates, k_cmp, v_cmp, k_win, v_win, layout, cfg, scale, fixed_indices,
           o_cmp_full, lse_cmp_full, o_win_full, need_indices, sel_deferred=False):
    """One chunk of queries [c0, c1). Returns (out [B, C, Hq, Dv], indices [B, C, Hkv, n] or None).

    sel_deferred: the selected branch is served later over the whole T: return the cmp + win part in the
    compute dtype (no cast) and always the indices.
    """
    B, _, Hq, Dk = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    ct = compute_dtype(q.dtype)
    device = q.device
    t_glob = torch.arange(c0, c1, device=device)
    seq_start = layout.seq_start[:, c0:c1]
    pos = t_glob[None, :] - seq_start
    qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, G))

    n_vis = layout.cmp_visible_bound(c1, cfg)
    cmp_start = layout.cmp_start[:, :n_vis]
    p_cmp = None
    if o_cmp_full is None:
        o_cmp, p_cmp = branches.compressed_branch(
            qc, k_cmp[:, :n_vis], v_cmp[:, :n_vis], cmp_start, layout.cmp_valid[:, :n_vis],
            t_glob, seq_start, cfg, scale)
    else:
        o_cmp = o_cmp_full[:, c0:c1].to(ct).unflatten(2, (Hkv, G))

    indices = None
    if fixed_indices is not None:
        indices = fixed_indices[:, c0:c1]
    else:
        with torch.no_grad():
            if p_cmp is None:  # a fast cmp provider gave the LSE: recompute probabilities from it
                p_cmp = cmp_probs_from_lse(qc, k_cmp[:, :n_vis], lse_cmp_full[:, c0:c1], cmp_start,
                                           layout.cmp_valid[:, :n_vis], t_glob, seq_start, cfg, scale)
            scores = branches.selection_scores(p_cmp.detach(), layout.cmp_local[:, :n_vis],
                                               layout.n_sel_blocks, cfg)
            indices = branches.top_n_blocks(scores, pos, cfg)
    o_sel = None if sel_deferred else branches.selected_branch(qc, k, v, indices, pos, seq_start, cfg, scale)

    if o_win_full is None:
        k0 = max(0, c0 - cfg.window + 1)
        key_pos = torch.arange(k0, c1, device=device)
        o_win = branches.sliding_branch(qc, k_win[:, k0:c1].to(ct), v_win[:, k0:c1].to(ct), key_pos, t_glob,
                                        seq_start, cfg, scale)
    else:
        o_win = o_win_full[:, c0:c1].to(ct).unflatten(2, (Hkv, G))

    g = gates[:, c0:c1].to(ct)
    if sel_deferred:
        return g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 2:3] * o_win.flatten(2, 3), indices
    out = (g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 1:2] * o_sel.flatten(2, 3)
           + g[..., 2:3] * o_win.flatten(2, 3))
    return out.to(q.dtype), (indices if need_indices else None)


def cmp_probs_from_lse(qc, k_cmp, lse, cmp_start, cmp_valid, t_glob, seq_start, cfg, scale):
    """Compressed-branch probabilities exp(s*q.k - lse) for the visible blocks (0 elsewhere)."""
    logits = torch.einsum("bchgd,bnhd->bchgn", qc, k_cmp) * scale
    visible = (
        cmp_valid[:, None, :]
        & (cmp_start[:, None, :] >= seq_start[:, :, None])
        & (cmp_start[:, None, :] + (cfg.block_cmp - 1) <= t_glob[None, :, None])
    )[:, :, None, None, :]
    lse = lse.to(logits.dtype).unflatten(2, (qc.shape[2], qc.shape[3]))[..., None]
    return torch.where(visible & torch.isfinite(lse), torch.exp(logits - lse), torch.zeros_like(logits))


def nsa_forward_torch(q, k, v, gates, cfg: NSAConfig, layout: SeqLayout, *, kv_cmp=None, kv_win=None,
                      compress_fn=None, block_indices=None, need_indices=False, chunk=None,
                      providers: BranchProviders | None = None, use_checkpoint=None):
    """Full NSA forward. Returns (out [B, T, Hq, Dv] in q's dtype, indices int32 or None)."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    scale = cfg.softmax_scale(Dk)
    kc_src, vc_src = kv_cmp if kv_cmp is not None else (k, v)
    k_win, v_win = kv_win if kv_win is not None else (k, v)
    k_cmp, v_cmp = compress_kv(kc_src, vc_src, layout, cfg, compress_fn)
    ct = compute_dtype(q.dtype)
    # Cast once per call, not per chunk. Gathering from compute-dtype copies also makes the backward's
    # scatter-add of K/V gradients accumulate in fp32 rather than in bf16.
    k_cmp_ct, v_cmp_ct = k_cmp.to(ct), v_cmp.to(ct)
    shared_win = k_win is k and v_win is v
    k_sel, v_sel = k, v  # the selected branch's K/V in the storage dtype (a fast sel provider reads these)
    k, v = k.to(ct), v.to(ct)
    k_win, v_win = (k, v) if shared_win else (k_win.to(ct), v_win.to(ct))

    o_cmp_full = lse_cmp_full = o_win_full = None
    if providers is not None and providers.cmp is not None:
        o_cmp_full, lse_cmp_full = providers.cmp(q, k_cmp, v_cmp, layout, cfg, scale)
    if providers is not None and providers.win is not None:
        o_win_full = providers.win(q, k_win, v_win, layout, cfg, scale)

    fixed = branches.dedupe_indices(block_indices) if block_indices is not None else None
    if T == 0:
        return q.new_zeros(B, 0, Hq, Dv), q.new_zeros(B, 0, Hkv, cfg.n_sel, dtype=torch.int32)
    chunk = chunk or choose_chunk(T, Hq, Hkv, Dk, Dv, layout.n_cmp, cfg, q.device.type)
    tensors = (q, k, v, gates, k_cmp_ct, v_cmp_ct, k_win, v_win)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if use_checkpoint is None:
        use_checkpoint = grad and T > chunk
    sel_deferred = providers is not None and providers.sel is not None
    outs, idxs = [], []
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        args = (c0, c1, q, k, v, gates, k_cmp_ct, v_cmp_ct, k_win, v_win, layout, cfg, scale, fixed,
                o_cmp_full, lse_cmp_full, o_win_full, need_indices, sel_deferred)
        if use_checkpoint and grad:
            o, idx = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            o, idx = _chunk(*args)
        outs.append(o)
        idxs.append(idx)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if sel_deferred:  # one fast-provider call over the whole T with every chunk's indices
        idx_all = (torch.cat(idxs, dim=1) if len(idxs) > 1 else idxs[0]).to(torch.int32)
        o_sel = providers.sel(q, k_sel, v_sel, idx_all, layout, cfg, scale)
        out = (out + gates[..., 1:2].to(ct) * o_sel.to(ct)).to(q.dtype)
        return out, (idx_all if need_indices else None)
    indices = None
    if need_indices:
        indices = torch.cat(idxs, dim=1).to(torch.int32) if len(idxs) > 1 else idxs[0].to(torch.int32)
    return out, indices
