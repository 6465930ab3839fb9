"""`torch_cudnn`: PyTorch's cuDNN attention (torch.ops.aten._scaled_dot_product_cudnn_attention) for the
compressed branch of dense input on Hopper.

Why: the folded compressed attention (nsa.branches.compressed.fold) is one causal attention of Ng query
groups over T_cmp = Ng - l/d compressed blocks with GQA group d*G. On an H100 (bf16, 1024 folded query
heads over 4 KV heads, D=128) cuDNN runs it in 8.1 ms forward and 33.2 ms forward+backward at T=64k where
FA-2 takes 13.2 and 51.8 ms; it returns the log-sum-exp the top-n step needs and has an autograd formula.

What it cannot do, and why it is only tried where it applies (nsa.plan.rules.cudnn_applies): its causal
mask is aligned to the top-left corner and it has no sliding window, no varlen entry point in every torch,
and the head dims its backward supports depend on the cuDNN release. So planning tries it first for the
compressed branch of dense input on sm 9.0 with head dims <= 128 (<= 256 from cuDNN 9.19, the release
measured with them: 64k, D=192: 10.0 ms forward and 66.0 ms forward+backward against FA-2's 21.5 and
86.7), fp16/bf16 inputs and at least two compressed blocks, and nowhere else: elsewhere it is not a
candidate (no fallback is counted), and the FA-2 providers serve as before. NSA_USE_CUDNN=0 turns it off.

Bottom-right alignment from top-left: with Tq >= Tk, rows i < Tq - Tk see no key and rows i >= Tq - Tk see
keys j <= i - (Tq - Tk): the last Tk rows are a square top-left causal attention. Those rows go to cuDNN;
the first Tq - Tk rows get output 0 and LSE +inf, what the FA-2 kernels write for an empty row.
"""

from __future__ import annotations

import torch

from ...compiling import trace_constant
from .base import Fa2Provider

MAX_HEAD_DIM = 128  # any cuDNN 9
MAX_HEAD_DIM_WIDE = 256  # from WIDE_HEADS_CUDNN on (measured: forward and backward, D = 192 and 256)
WIDE_HEADS_CUDNN = 91900
MIN_KEYS = 2  # cuDNN's backward: "s_q = s_kv = 1 is not supported"
MIN_CAPABILITY = (9, 0)


@trace_constant  # reads cuDNN's version: under torch.compile, once when the caller is traced (constants only)
def cudnn_max_head_dim(version: int | None = None) -> int:
    """The widest head dim cuDNN attention takes here (version: a test's pretended cuDNN version)."""
    version = version or torch.backends.cudnn.version() or 0
    return MAX_HEAD_DIM_WIDE if version >= WIDE_HEADS_CUDNN else MAX_HEAD_DIM


def torch_cudnn_status() -> tuple[bool, str]:
    """(the cuDNN attention entry point exists and cuDNN is usable, reason)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not torch.backends.cudnn.is_available():
        return False, f"torch {torch.__version__} was built without cuDNN"
    try:
        torch.ops.aten._scaled_dot_product_cudnn_attention  # noqa: B018 - resolving the op is the probe
    except (AttributeError, RuntimeError) as e:
        return False, f"torch {torch.__version__} has no aten._scaled_dot_product_cudnn_attention ({e})"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False, "torch.backends.cuda.enable_cudnn_sdp(False) is in effect"
    return True, "ok"


class TorchCudnnProvider(Fa2Provider):
    name = "torch_cudnn"

    def __init__(self, kernel=None):
        super().__init__()
        self.kernel = kernel  # None: torch.ops.aten._scaled_dot_product_cudnn_attention; tests pass an emulation
        self.cudnn_version: int | None = None  # None: torch.backends.cudnn.version(); tests pretend one

    def max_head_dim(self) -> int:
        return cudnn_max_head_dim(self.cudnn_version)

    def availability(self, device, forced):
        return self._settled(device, self.kernel, "kernel") or torch_cudnn_status()

    def attn(self, q, k, v, *, causal, left, scale, varlen, need_lse):
        if not causal or left >= 0 or varlen is not None:
            raise ValueError("torch_cudnn serves dense bottom-right causal attention only (the compressed branch)")
        B, Tq, H, D = q.shape
        Tk = k.shape[1]
        off = Tq - Tk
        if off < 0:
            raise ValueError(f"torch_cudnn needs seqlen_q >= seqlen_k for bottom-right causal, got {Tq} < {Tk}")
        op = self.kernel or torch.ops.aten._scaled_dot_product_cudnn_attention
        out, lse, *_ = op(q[:, off:].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, True,
                          False, scale=scale)
        out, lse = out.transpose(1, 2), lse.reshape(B, H, Tk).float()  # [B, Tk, H, Dv], [B, H, Tk]
        if off:  # the compressed branch calls it square (nsa.branches.compressed.fa2): no copy there
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, off, 0))
            lse = torch.nn.functional.pad(lse, (off, 0), value=float("inf"))
        return out, lse


__all__ = ["MAX_HEAD_DIM", "MAX_HEAD_DIM_WIDE", "MIN_CAPABILITY", "MIN_KEYS", "WIDE_HEADS_CUDNN", "TorchCudnnProvider",
           "torch_cudnn_status"]
