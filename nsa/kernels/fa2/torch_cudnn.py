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
86.7), fp16/bf16 inputs and at least two compressed blocks (packed sequences of one length included: they
run as the dense batch they are; H200, bf16, Hq=64, Hkv=4, D=128, the whole forward+backward with cuDNN
against FA-2 for this branch: 16 x 4k 67.9 against 71.1 ms, 8 x 8k 72.6 against 77.9, 8k 10.9 against 11.3,
64k 103.5 against 123.5), and nowhere else: elsewhere it is not a
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


def offset_parts(m0: int, n: int) -> list[tuple[int, int, bool]]:
    """The key ranges (start, end, causal) of rows after m0 blocks: [0, m0) in m0 // n unmasked pieces of n to
    2n - 1 blocks (at least MIN_KEYS), then the square causal [m0, m0 + n). Pieces no longer than the rows keep
    each backward's GQA gradient buffers (cuDNN holds dK/dV per query head in fp32: 32 KB per block per folded
    head group at D = 128) in proportion to the rows, not to the stream before them."""
    size = max(n, MIN_KEYS)
    count = max(1, m0 // size)
    bounds = [m0 * i // count for i in range(count + 1)]
    return [(a, b, False) for a, b in zip(bounds, bounds[1:])] + [(m0, m0 + n, True)]


class _OffsetRows(torch.autograd.Function):
    """Rows folded by view that start after m0 >= 2 compressed blocks (context parallelism's later segments):
    row i sees blocks [0, m0 + i], a bottom-right causal mask cuDNN's top-left one cannot express. Instead,
    cuDNN calls over the pieces of offset_parts (the rows against pieces of [0, m0) unmasked, then against
    [m0, m0 + n) square causal), merged by their log-sum-exps. Backward: each piece's cuDNN backward with the
    MERGED output and log-sum-exp (each piece's softmax probabilities are then those of the whole row, ring
    attention's rule), the q gradients summed, the K/V gradients of the pieces joined."""

    @staticmethod
    def forward(ctx, q, k, v, m0, scale, fwd, bwd):
        qt = q.transpose(1, 2)
        parts = offset_parts(m0, q.shape[1])
        acc = lse = None
        ctx.rest = []
        for a, b, causal in parts:
            o, l_p, *rest = fwd(qt, k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2), None, True, 0.0, causal,
                                False, scale=scale)
            ctx.rest.append(rest[:6])  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, philox offset
            if acc is None:  # the first piece: its output and LSE as cuDNN gives them set the merged ones' form
                out_dtype, lse_dtype, lse_shape = o.dtype, l_p.dtype, l_p.shape
                w = l_p.shape if l_p.dim() == o.dim() else (*l_p.shape, 1)
                acc, lse = o.float(), l_p.float()
                continue
            l_p = l_p.float()
            new = torch.logaddexp(lse, l_p)
            acc = acc * torch.exp(lse - new).view(w) + o.float() * torch.exp(l_p - new).view(w)
            lse = new
        out = acc.to(out_dtype)
        lse_c = lse.to(lse_dtype).reshape(lse_shape)
        ctx.save_for_backward(q, k, v, out, lse_c)
        ctx.parts, ctx.scale, ctx.bwd = parts, scale, bwd
        B, H, n = out.shape[:3]
        lse_rows = lse.reshape(B, H, n)
        ctx.mark_non_differentiable(lse_rows)
        return out.transpose(1, 2), lse_rows

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        qt = q.transpose(1, 2)
        dot = torch.empty_like(out)  # the layout of the forward's output, as cuDNN's backward reads dO with it
        dot.copy_(do.transpose(1, 2))
        dq, dks, dvs = None, [], []
        for (a, b, causal), (cq, ck, mq, mk, seed, off) in zip(ctx.parts, ctx.rest):
            g = ctx.bwd(dot, qt, k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2), out, lse, seed, off, None,
                        cq, ck, mq, mk, 0.0, causal, scale=ctx.scale)
            dq = g[0] if dq is None else dq + g[0]
            dks.append(g[1])
            dvs.append(g[2])
        return (dq.transpose(1, 2), torch.cat(dks, 2).transpose(1, 2), torch.cat(dvs, 2).transpose(1, 2),
                None, None, None, None)


class TorchCudnnProvider(Fa2Provider):
    name = "torch_cudnn"

    def __init__(self, kernel=None, kernel_bwd=None):
        super().__init__()
        self.kernel = kernel  # None: torch.ops.aten._scaled_dot_product_cudnn_attention; tests pass an emulation
        self.kernel_bwd = kernel_bwd  # None: torch.ops.aten._scaled_dot_product_cudnn_attention_backward
        self.cudnn_version: int | None = None  # None: torch.backends.cudnn.version(); tests pretend one

    def max_head_dim(self) -> int:
        return cudnn_max_head_dim(self.cudnn_version)

    def takes_narrower_v(self) -> bool:
        """cuDNN attention takes Dv < Dk (the paper's 192 / 128) unpadded: measured with the release that has the
        wide heads, so from that release on. On an H200 at 64k that saves the zero-padded V copy, the padded
        output and its gradient (three [T, Hq, Dk]-sized passes) and a third of the P.V work."""
        return cudnn_max_head_dim(self.cudnn_version) == MAX_HEAD_DIM_WIDE

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

    def offset_rows(self, q, k, v, m0: int, scale: float):
        """Rows folded by view q [B, n, H, D] that see blocks [0, m0 + i] of k, v [B, m0 + n, Hkv, D] (row i;
        m0 >= MIN_KEYS, n >= MIN_KEYS): (out [B, n, H, Dv], lse [B, H, n] fp32), differentiable in q, k, v
        (_OffsetRows: cuDNN calls over offset_parts, merged)."""
        if m0 < MIN_KEYS or q.shape[1] < MIN_KEYS or k.shape[1] != m0 + q.shape[1]:
            raise ValueError(f"offset_rows needs m0 >= {MIN_KEYS}, n >= {MIN_KEYS} rows and m0 + n blocks; got "
                             f"m0={m0}, n={q.shape[1]}, {k.shape[1]} blocks")
        fwd = self.kernel or torch.ops.aten._scaled_dot_product_cudnn_attention
        bwd = self.kernel_bwd or torch.ops.aten._scaled_dot_product_cudnn_attention_backward
        return _OffsetRows.apply(q, k, v, m0, scale, fwd, bwd)


__all__ = ["MAX_HEAD_DIM", "MAX_HEAD_DIM_WIDE", "MIN_CAPABILITY", "MIN_KEYS", "WIDE_HEADS_CUDNN", "TorchCudnnProvider",
           "torch_cudnn_status"]
