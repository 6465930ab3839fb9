"""Sliding branch in plain PyTorch: the per-chunk function (chunked pipeline, decode) and the whole-T
naive twin with the branch signature `(q, k, v, layout, cfg, scale) -> o_win`."""

from __future__ import annotations

import torch

from ...config import NSAConfig
from ...layout import SeqLayout
from ..attend import attend, chunks, compute_dtype


def sliding_chunk(q, k, v, key_pos, t_glob, seq_start, cfg: NSAConfig, scale):
    """q [B,C,Hkv,G,Dk]; k/v [B,N,Hkv,D] holding global positions key_pos [N] (or [B, N]; -1 = empty).

    Query t attends u with max(seq_start, t - w + 1) <= u <= t.
    """
    if key_pos.dim() == 1:
        key_pos = key_pos[None]
    kp = key_pos[:, None, :]
    mask = (
        (kp >= 0)
        & (kp <= t_glob[None, :, None])
        & (kp > t_glob[None, :, None] - cfg.window)
        & (kp >= seq_start[:, :, None])
    )
    return attend(q, k, v, mask, scale)


def sliding_attention(q, k, v, layout: SeqLayout, cfg: NSAConfig, scale, chunk=None):
    """Whole-T naive twin: o [B, T, Hq, Dv] in q's dtype (a band of chunk + w - 1 keys per chunk)."""
    B, T, Hq, _ = q.shape
    Hkv = k.shape[2]
    ct = compute_dtype(q.dtype)
    outs = []
    for c0, c1 in chunks(T, chunk or 256):
        k0 = max(0, c0 - cfg.window + 1)
        t_glob = torch.arange(c0, c1, device=q.device)
        qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, Hq // Hkv))
        o = sliding_chunk(qc, k[:, k0:c1].to(ct), v[:, k0:c1].to(ct), torch.arange(k0, c1, device=q.device),
                          t_glob, layout.seq_start[:, c0:c1], cfg, scale)
        outs.append(o.flatten(2, 3))
    if not outs:
        return q.new_zeros(B, 0, Hq, v.shape[-1])
    return torch.cat(outs, 1).to(q.dtype)
