"""`torch_flash`: PyTorch's built-in FlashAttention-2 kernels through torch.ops.aten._flash_attention_forward.

Why the aten op and not torch.nn.attention.varlen.varlen_attn: the op is the kernel entry point that
varlen_attn itself calls; it takes dense [B, T, H, D] as well as varlen [total, H, D] input, a
(left, right) window, returns the LSE (dense [B, H, Tq], varlen [H, total_q]) and supports GQA natively
(Hq a multiple of Hkv: query head h reads KV head h // (Hq/Hkv), no K/V copy), and it has an autograd
formula (aten._flash_attention_backward) in every torch >= 2.5. varlen_attn's Python signature moved
between releases (GQA flag, KV-cache arguments); the op's leading arguments did not.
"""

from __future__ import annotations

import torch

from .. import flash_wrappers
from .base import Fa2Provider


class TorchFlashProvider(Fa2Provider):
    name = "torch_flash"

    def __init__(self, kernel=None):
        super().__init__()
        self.kernel = kernel  # None: torch.ops.aten._flash_attention_forward; tests pass an emulation

    def availability(self, device, forced):
        return self._settled(device, self.kernel, "kernel") or flash_wrappers.torch_flash_status()

    def attn(self, q, k, v, *, causal, left, scale, varlen, need_lse):
        op = self.kernel or torch.ops.aten._flash_attention_forward
        right = -1 if causal or left < 0 else 0
        if varlen is None:
            out, lse, *_ = op(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale,
                              window_size_left=left, window_size_right=right)
        else:
            cu_q, cu_k, max_q, max_k = varlen
            out, lse, *_ = op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
                              window_size_left=left, window_size_right=right)
        return out, lse
