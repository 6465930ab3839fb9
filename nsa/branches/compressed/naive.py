"""Compressed branch in plain PyTorch: the per-chunk function (chunked pipeline, decode) and the whole-T
naive twin with the branch signature `(q, k_cmp, v_cmp, layout, cfg, scale) -> (o, lse)`."""

from __future__ import annotations

import torch

from ...config import NSAConfig
from ...layout import SeqLayout
from ..attend import attend, chunks, compute_dtype


def visible(cmp_start, cmp_valid, t_glob, seq_start, cfg: NSAConfig):
    """[B, C, N]: block slot n is visible to the query at global position t_glob[c] iff it belongs to the
    query's sequence and ends at or before it (i*d + l - 1 <= t)."""
    return (
        cmp_valid[:, None, :]
        & (cmp_start[:, None, :] >= seq_start[:, :, None])
        & (cmp_start[:, None, :] + (cfg.block_cmp - 1) <= t_glob[None, :, None])
    )


def compressed_chunk(qc, k_cmp, v_cmp, cmp_start, cmp_valid, t_glob, seq_start, cfg: NSAConfig, scale):
    """q [B,C,Hkv,G,Dk] at global positions t_glob [C]; k_cmp/v_cmp [B,N,Hkv,D] with slot metadata [B,N].
    Returns (out [B,C,Hkv,G,Dv], lse [B,C,Hkv,G])."""
    mask = visible(cmp_start, cmp_valid, t_glob, seq_start, cfg)
    return attend(qc, k_cmp, v_cmp, mask, scale, return_lse=True)


def compressed_attention(q, k_cmp, v_cmp, layout: SeqLayout, cfg: NSAConfig, scale, chunk=None):
    """Whole-T naive twin: o [B, T, Hq, Dv] in q's dtype, lse [B, T, Hq] fp32 (-inf for empty rows)."""
    B, T, Hq, _ = q.shape
    Hkv = k_cmp.shape[2]
    ct = compute_dtype(q.dtype)
    outs, lses = [], []
    for c0, c1 in chunks(T, chunk):
        n = layout.cmp_visible_bound(c1, cfg)
        t_glob = torch.arange(c0, c1, device=q.device)
        qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, Hq // Hkv))
        o, lse = compressed_chunk(qc, k_cmp[:, :n].to(ct), v_cmp[:, :n].to(ct), layout.cmp_start[:, :n],
                                  layout.cmp_valid[:, :n], t_glob, layout.seq_start[:, c0:c1], cfg, scale)
        outs.append(o.flatten(2, 3))
        lses.append(lse.flatten(2, 3).float())
    if not outs:
        return q.new_zeros(B, 0, Hq, v_cmp.shape[-1]), q.new_zeros(B, 0, Hq, dtype=torch.float32)
    return torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 1)
