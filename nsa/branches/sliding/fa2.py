"""Sliding branch on a FlashAttention-2 kernel: causal attention with window_size = (w - 1, 0) (plain
causal when the window covers every key), native GQA, dense or varlen with the caller's cu_seqlens.
Signature after binding the provider: `(q, k, v, layout, cfg, scale) -> o_win`."""

from __future__ import annotations

import torch

from ...config import NSAConfig
from ...kernels.fa2.base import Fa2Provider
from ...toggles import Toggles
from ..context import CallContext
from ..fa2_call import prep


def sliding_fa2(prov: Fa2Provider, ctx: CallContext, toggles: Toggles, q, k, v, layout, cfg: NSAConfig,
                scale: float):
    B, T, Hq, _ = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    if T == 0:
        return q.new_zeros(B, 0, Hq, Dv)
    varlen = ctx.packed or toggles.force_varlen
    max_len = ctx.max_len if ctx.packed else T
    left = cfg.window - 1
    causal = left >= max_len - 1  # the window covers every key: plain causal attention
    qf, kf, vf = prep(prov, (q, k, v), ctx, "win")
    if varlen:
        cu = ctx.cu_seqlens if ctx.packed else torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
        D = qf.shape[-1]
        o, _ = prov.attn(qf.reshape(B * T, Hq, D), kf.reshape(B * T, Hkv, D), vf.reshape(B * T, Hkv, D),
                         causal=causal, left=-1 if causal else left, scale=scale,
                         varlen=(cu, cu, max_len, max_len), need_lse=False)
        o = o.reshape(B, T, Hq, -1)
    else:
        o, _ = prov.attn(qf, kf, vf, causal=causal, left=-1 if causal else left, scale=scale, varlen=None,
                         need_lse=False)
    return o[..., :Dv].to(q.dtype)
