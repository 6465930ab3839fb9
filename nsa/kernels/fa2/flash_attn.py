"""`flash_attn`: the flash-attn package (FlashAttention-2): flash_attn_func / flash_attn_varlen_func.

Native GQA, window_size=(left, right), causal aligned bottom-right (flash-attn >= 2.1), LSE through
return_attn_probs=True (dense [B, H, Tq]; varlen [H, total_q], or [n_seq, H, max_q] in flash-attn < 2.4,
normalized by varlen_lse_2d below). Where a build lacks flash_attn_varlen_func, the kvpacked variant is
used: it needs K and V stacked ([total, 2, Hkv, D]: one copy of K/V, never one per head).
"""

from __future__ import annotations

import torch

from ...layout import sequence_of
from .. import flash_wrappers
from .base import Fa2Provider


class FlashAttnProvider(Fa2Provider):
    name = "flash_attn"

    def __init__(self, module=None):
        super().__init__()
        self.module = module  # None: import flash_attn; tests pass an emulation of the module

    def _mod(self):
        if self.module is not None:
            return self.module
        mod, why = flash_wrappers._import("flash_attn")
        if mod is None:
            raise RuntimeError(f"flash_attn provider used while unavailable: {why}")
        return mod

    def availability(self, device, forced):
        settled = self._settled(device, self.module, "module")
        if settled:
            return settled
        ok, why = flash_wrappers.flash_attn_status(varlen=False)
        if not ok:
            return ok, why
        mod = self._mod()
        if not (hasattr(mod, "flash_attn_varlen_func") or hasattr(mod, "flash_attn_varlen_kvpacked_func")):
            return False, "flash_attn has no varlen entry point"
        return True, why

    def attn(self, q, k, v, *, causal, left, scale, varlen, need_lse):
        mod = self._mod()
        window = (-1, -1) if causal or left < 0 else (left, 0)
        kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=window,
                  return_attn_probs=need_lse)
        if varlen is None:
            res = mod.flash_attn_func(q, k, v, **kw)
        else:
            cu_q, cu_k, max_q, max_k = varlen
            if hasattr(mod, "flash_attn_varlen_func"):
                res = mod.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
            else:
                kv = torch.stack([k, v], dim=1)
                res = mod.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k, **kw)
        if not need_lse:
            return (res[0] if isinstance(res, tuple) else res), None
        out, lse = res[0], res[1]
        if varlen is not None:
            lse = varlen_lse_2d(lse, varlen[0], q.shape[0])
        return out, lse


def varlen_lse_2d(lse: torch.Tensor, cu_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """Normalize a varlen LSE to [H, total_q]: older flash-attn returned [n_seq, H, max_q] padded."""
    if lse.dim() == 2:
        return lse
    n_seq, H, max_q = lse.shape
    cu = cu_q.long()
    tok = torch.arange(total_q, device=lse.device)
    seq = sequence_of(cu, tok).clamp_(max=n_seq - 1)
    pos = (tok - cu[seq]).clamp_(max=max_q - 1)
    return lse[seq, :, pos].transpose(0, 1)
