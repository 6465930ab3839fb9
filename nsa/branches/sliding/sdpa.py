"""Sliding branch on scaled_dot_product_attention over query chunks: per chunk a band of chunk + w - 1
keys and a mask from positions (every row sees itself, so no row is empty).
Signature after binding: `(q, k, v, layout, cfg, scale) -> o_win`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...config import NSAConfig
from ...kernels.sdpa import chunk_len, fold, rows, unfold
from ...toggles import Toggles


def sliding_sdpa(toggles: Toggles, q, k, v, layout, cfg: NSAConfig, scale: float):
    B, T, Hq, _ = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    G = Hq // Hkv
    w = cfg.window
    C = chunk_len(T, G, min(T, w) + 1024, toggles.sdpa_chunk)
    outs = []
    for c0 in range(0, T, C):
        c1 = min(T, c0 + C)
        k0 = max(0, c0 - w + 1)
        t_glob = torch.arange(c0, c1, device=q.device)
        kp = torch.arange(k0, c1, device=q.device)
        vis = ((kp[None, None, :] <= t_glob[None, :, None]) & (kp[None, None, :] > t_glob[None, :, None] - w)
               & (kp[None, None, :] >= layout.seq_start[:, c0:c1, None]))
        o = F.scaled_dot_product_attention(fold(q[:, c0:c1], Hkv), k[:, k0:c1].transpose(1, 2),
                                           v[:, k0:c1].transpose(1, 2), attn_mask=rows(vis, G), scale=scale)
        outs.append(unfold(o, c1 - c0))
    if not outs:
        return q.new_zeros(B, 0, Hq, Dv)
    return torch.cat(outs, 1)
