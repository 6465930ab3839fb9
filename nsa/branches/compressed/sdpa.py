"""Compressed branch on scaled_dot_product_attention over query chunks (nsa.kernels.sdpa folds the G
heads into the query length). SDPA returns no LSE, so one extra q.k_cmp^T product per chunk (no grad)
gives it. Rows with no visible block: the mask unmasks block 0 for them (so no SDPA backend produces
NaN, forward or backward), the output is zeroed and the LSE is -inf.
Signature after binding: `(q, k_cmp, v_cmp, layout, cfg, scale) -> (o, lse)`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...config import NSAConfig
from ...kernels.sdpa import chunk_len, fold, rows, unfold
from ...toggles import Toggles
from ..attend import compute_dtype
from .naive import visible


def compressed_sdpa(toggles: Toggles, q, k_cmp, v_cmp, layout, cfg: NSAConfig, scale: float):
    B, T, Hq, _ = q.shape
    Hkv, Dv = k_cmp.shape[2], v_cmp.shape[3]
    G = Hq // Hkv
    C = chunk_len(T, G, layout.n_cmp, toggles.sdpa_chunk)
    outs, lses = [], []
    for c0 in range(0, T, C):
        c1 = min(T, c0 + C)
        n = layout.cmp_visible_bound(c1, cfg)
        if n == 0:
            outs.append(q.new_zeros(B, c1 - c0, Hq, Dv))
            lses.append(q.new_full((B, c1 - c0, Hq), float("-inf"), dtype=torch.float32))
            continue
        t_glob = torch.arange(c0, c1, device=q.device)
        vis = visible(layout.cmp_start[:, :n], layout.cmp_valid[:, :n], t_glob, layout.seq_start[:, c0:c1], cfg)
        has = vis.any(-1)
        first = torch.arange(n, device=q.device) == 0
        safe = vis | (~has[..., None] & first)
        qc = q[:, c0:c1]
        kc, vc = k_cmp[:, :n].transpose(1, 2), v_cmp[:, :n].transpose(1, 2)
        o = F.scaled_dot_product_attention(fold(qc, Hkv), kc, vc, attn_mask=rows(safe, G), scale=scale)
        o = unfold(o, c1 - c0)
        outs.append(torch.where(has[:, :, None, None], o, torch.zeros_like(o)))
        with torch.no_grad():
            ct = compute_dtype(q.dtype)
            logits = torch.einsum("bchgd,bnhd->bchgn", qc.detach().to(ct).unflatten(2, (Hkv, G)),
                                  k_cmp[:, :n].detach().to(ct)) * scale
            logits = logits.masked_fill(~vis[:, :, None, None, :], float("-inf"))
            lses.append(torch.logsumexp(logits, dim=-1).flatten(2).float())
    if not outs:
        return q.new_zeros(B, 0, Hq, Dv), q.new_zeros(B, 0, Hq, dtype=torch.float32)
    return torch.cat(outs, 1), torch.cat(lses, 1)
