"""One decode step: the new token's NSA output from the cache, equal to the prefill output at that position.

The step runs the same per-chunk branch functions as prefill (nsa.branches.*.naive) on a chunk of one query whose
keys come from the cache: all completed compressed blocks, the selected blocks of the raw K/V, and the
window ring. Nothing is concatenated over the history.
"""

from __future__ import annotations

import torch

from . import telemetry
from .branches.attend import compute_dtype
from .branches.compressed.naive import compressed_chunk
from .branches.selected.naive import selected_chunk, topn_chunk
from .branches.sliding.naive import sliding_chunk
from .cache import NSACache
from .config import NSAConfig
from .validation import NSAInputError, check_qkv


def nsa_decode(q, k, v, gates, cache: NSACache, config: NSAConfig | None = None, *, kv_cmp=None, kv_win=None,
               compress_fn=None, return_indices=False, return_stats=False):
    """Append the new token's k/v ([B, 1, Hkv, D]) to `cache` and return its output [B, 1, Hq, Dv].

    q [B, 1, Hq, Dk], gates [B, 1, Hq, 3]. kv_cmp / kv_win / compress_fn as in nsa_attention.
    return_indices adds the selected blocks [B, 1, Hkv, n_sel]; return_stats a dict with the K/V bytes
    this step read from the cache (compressed blocks + selected tokens + window), counted from the cache.
    """
    cfg = config or cache.config
    if cfg != cache.config:
        raise NSAInputError("config differs from the cache's config")
    shapes = check_qkv(q, k, v, gates)
    if shapes.T != 1:
        raise NSAInputError(f"nsa_decode takes one new token (T=1), got T={shapes.T}: use nsa_attention to prefill")
    if cfg.compress == "mlp" and compress_fn is None:
        raise NSAInputError("config.compress='mlp' needs compress_fn=(phi_k, phi_v)")
    cache.write(k, v, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn)
    t = cache.length - 1
    B, _, Hq, Dk = q.shape
    Hkv = shapes.Hkv
    ct = compute_dtype(q.dtype)
    scale = cfg.softmax_scale(Dk)
    device = q.device
    qc = q.to(ct).unflatten(2, (Hkv, Hq // Hkv))  # [B, 1, Hkv, G, Dk]
    t_glob = torch.full((1,), t, device=device, dtype=torch.long)
    seq_start = torch.zeros(B, 1, dtype=torch.long, device=device)
    pos = t_glob[None].expand(B, 1)

    n = cache.n_cmp
    starts = (torch.arange(n, device=device) * cfg.stride_cmp)[None].expand(B, n)
    valid = torch.ones(B, n, dtype=torch.bool, device=device)
    k_cmp = cache.k_cmp[:, :n].to(ct)
    o_cmp, lse = compressed_chunk(qc, k_cmp, cache.v_cmp[:, :n].to(ct), starts, valid, t_glob, seq_start, cfg, scale)
    indices = topn_chunk(qc, k_cmp, lse, starts, starts, valid, t_glob, seq_start, cfg.n_sel_blocks(t + 1), cfg,
                         scale)
    o_sel = selected_chunk(qc, cache.k_sel, cache.v_sel, indices, pos, seq_start, cfg, scale)
    o_win = sliding_chunk(qc, cache.k_win.to(ct), cache.v_win.to(ct), cache.win_pos, t_glob, seq_start, cfg,
                          scale)
    for branch in ("cmp", "sel", "win"):
        telemetry.record(branch, "torch", "decode")
    g = gates.to(ct)
    out = (g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 1:2] * o_sel.flatten(2, 3)
           + g[..., 2:3] * o_win.flatten(2, 3)).to(q.dtype)
    result = [out]
    if return_indices:
        result.append(indices.to(torch.int32))
    if return_stats:
        # Tokens the selected branch read: positions <= t of each chosen block, summed over batch and heads.
        blk_lo = indices.clamp(min=0) * cfg.block_sel
        n_tok = ((t + 1 - blk_lo).clamp(0, cfg.block_sel) * (indices >= 0)).sum()
        per_tok = (cache.k_sel.shape[3] + cache.v_sel.shape[3]) * cache.k_sel.element_size()
        n_win = min(t + 1, cache.k_win.shape[1])
        stats = {
            "position": t,
            "cmp_blocks": n,
            "kv_bytes_cmp": B * Hkv * n * per_tok,
            "kv_bytes_sel": int(n_tok) * per_tok,
            "kv_bytes_win": B * Hkv * n_win * per_tok,
        }
        stats["kv_bytes"] = stats["kv_bytes_cmp"] + stats["kv_bytes_sel"] + stats["kv_bytes_win"]
        result.append(stats)
    return result[0] if len(result) == 1 else tuple(result)


def nsa_prefill(q, k, v, gates, cache: NSACache, config: NSAConfig | None = None, *, kv_cmp=None, kv_win=None,
                compress_fn=None, backend="auto"):
    """Prefill: outputs for a prompt (nsa_attention) and the cache filled with its K/V."""
    from .functional import nsa_attention

    cfg = config or cache.config
    if cache.length != 0:
        raise NSAInputError(f"nsa_prefill needs an empty cache, this one holds {cache.length} tokens")
    out = nsa_attention(q, k, v, gates, cfg, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn,
                        backend=backend)
    cache.write(k, v, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn)
    return out
