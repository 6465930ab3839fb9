"""`sdpa`: torch.nn.functional.scaled_dot_product_attention over chunks of queries, explicit masks.

GQA without copying K/V: the G query heads of a KV head are folded into the query length, q
[B, Hkv, C*G, D] against k/v [B, Hkv, N, D] (equal head counts, so no enable_gqa and no backend that
repeats K/V internally), with a boolean mask [B, 1, C*G, N] built per chunk from token positions
(the same visibility rules as nsa.ops.branches). Memory per chunk is C*G*N mask bytes: never a dense
[T, T] mask at long T. With a mask the flash backend is not eligible; SDPA picks memory-efficient,
cuDNN or math.

Compressed branch: SDPA returns no LSE, so the provider computes it per chunk with one extra
q.k_cmp^T product (no grad). Rows with no visible block: the mask unmasks block 0 for them (so no
backend produces NaN, in the forward or the backward) and the output is zeroed; their LSE is -inf.
Used by `auto` on CUDA only (on CPU the torch path serves the same math); backend="sdpa" forces it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import NSAConfig
from .base import CallContext
from .guards import Failure
from .toggles import Toggles

MASK_BUDGET = 1 << 25  # bool mask elements per chunk


def _chunk(T: int, G: int, keys: int, toggles: Toggles) -> int:
    if toggles.sdpa_chunk:
        return toggles.sdpa_chunk
    c = 1024
    while c > 64 and c * G * max(keys, 1) > MASK_BUDGET:
        c //= 2
    return max(1, min(c, T))


def _fold(qc: torch.Tensor, Hkv: int) -> torch.Tensor:
    B, C, Hq, D = qc.shape
    return qc.view(B, C, Hkv, Hq // Hkv, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, C * (Hq // Hkv), D)


def _unfold(o: torch.Tensor, C: int) -> torch.Tensor:
    B, Hkv, CG, Dv = o.shape
    G = CG // C
    return o.view(B, Hkv, C, G, Dv).permute(0, 2, 1, 3, 4).reshape(B, C, Hkv * G, Dv)


def _rows(mask: torch.Tensor, G: int) -> torch.Tensor:
    """[B, C, N] -> [B, 1, C*G, N] (row c*G + g)."""
    B, C, N = mask.shape
    return mask[:, :, None, :].expand(B, C, G, N).reshape(B, 1, C * G, N)


class SdpaProvider:
    name = "sdpa"

    def __init__(self):
        self.available_override: tuple[bool, str] | None = None

    def availability(self, device, forced):
        if self.available_override is not None:
            return self.available_override
        if not hasattr(F, "scaled_dot_product_attention"):
            return False, f"torch {torch.__version__} has no scaled_dot_product_attention"
        if device.type != "cuda" and not forced:
            return False, "auto uses sdpa on CUDA only (on CPU the torch path serves); backend='sdpa' forces it"
        return True, "torch scaled_dot_product_attention"

    def guard(self, branch: str, ctx: CallContext, toggles: Toggles, forced: bool) -> Failure | None:
        return None  # any float dtype, any head dim, dense or packed

    def cmp(self, q, k_cmp, v_cmp, layout, cfg: NSAConfig, scale: float, ctx: CallContext, toggles: Toggles):
        B, T, Hq, _ = q.shape
        Hkv, Dv = k_cmp.shape[2], v_cmp.shape[3]
        G = Hq // Hkv
        C = _chunk(T, G, layout.n_cmp, toggles)
        outs, lses = [], []
        for c0 in range(0, T, C):
            c1 = min(T, c0 + C)
            n = layout.cmp_visible_bound(c1, cfg)
            if n == 0:
                outs.append(q.new_zeros(B, c1 - c0, Hq, Dv))
                lses.append(q.new_full((B, c1 - c0, Hq), float("-inf"), dtype=torch.float32))
                continue
            t_glob = torch.arange(c0, c1, device=q.device)
            start = layout.cmp_start[:, :n]
            vis = (layout.cmp_valid[:, None, :n] & (start[:, None, :] >= layout.seq_start[:, c0:c1, None])
                   & (start[:, None, :] + (cfg.block_cmp - 1) <= t_glob[None, :, None]))  # [B, C, n]
            has = vis.any(-1)
            first = torch.arange(n, device=q.device) == 0
            safe = vis | (~has[..., None] & first)
            qc = q[:, c0:c1]
            kc, vc = k_cmp[:, :n].transpose(1, 2), v_cmp[:, :n].transpose(1, 2)
            o = F.scaled_dot_product_attention(_fold(qc, Hkv), kc, vc, attn_mask=_rows(safe, G), scale=scale)
            o = _unfold(o, c1 - c0)
            outs.append(torch.where(has[:, :, None, None], o, torch.zeros_like(o)))
            with torch.no_grad():
                ct = torch.float64 if q.dtype == torch.float64 else torch.float32
                logits = torch.einsum("bchgd,bnhd->bchgn", qc.detach().to(ct).unflatten(2, (Hkv, G)),
                                      k_cmp[:, :n].detach().to(ct)) * scale
                logits = logits.masked_fill(~vis[:, :, None, None, :], float("-inf"))
                lses.append(torch.logsumexp(logits, dim=-1).flatten(2).float())
        if not outs:
            return q.new_zeros(B, 0, Hq, Dv), q.new_zeros(B, 0, Hq, dtype=torch.float32)
        return torch.cat(outs, 1), torch.cat(lses, 1)

    def win(self, q, k, v, layout, cfg: NSAConfig, scale: float, ctx: CallContext, toggles: Toggles):
        B, T, Hq, _ = q.shape
        Hkv, Dv = k.shape[2], v.shape[3]
        G = Hq // Hkv
        w = cfg.window
        C = _chunk(T, G, min(T, w) + 1024, toggles)
        outs = []
        for c0 in range(0, T, C):
            c1 = min(T, c0 + C)
            k0 = max(0, c0 - w + 1)
            t_glob = torch.arange(c0, c1, device=q.device)
            kp = torch.arange(k0, c1, device=q.device)
            vis = ((kp[None, None, :] <= t_glob[None, :, None]) & (kp[None, None, :] > t_glob[None, :, None] - w)
                   & (kp[None, None, :] >= layout.seq_start[:, c0:c1, None]))  # every row sees itself
            o = F.scaled_dot_product_attention(_fold(q[:, c0:c1], Hkv), k[:, k0:c1].transpose(1, 2),
                                               v[:, k0:c1].transpose(1, 2), attn_mask=_rows(vis, G), scale=scale)
            outs.append(_unfold(o, c1 - c0))
        if not outs:
            return q.new_zeros(B, 0, Hq, Dv)
        return torch.cat(outs, 1)
