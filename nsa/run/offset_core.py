"""The dense core for queries at a stream offset: NSA of queries at the stream positions [offset, offset + Tq)
against the stream's K/V [0, offset + Tq), as one autograd node on the fused kernels (context parallelism's
per-rank compute, nsa.distributed; dense input).

The steps are the dense core's (nsa.run.dense_core), each told where its queries sit in the stream:

- compressed branch: query p sees blocks i <= m where p = l - 1 + m*d + r (nsa.branches.compressed.fold).
  The local queries split into a head (the tokens before the first row boundary at or after `offset`:
  they all see blocks [0, m0), or nothing when m0 = 0), n whole rows of d tokens folded by view (row i
  sees blocks [0, m0 + i]: causal attention of n rows over m0 + n blocks aligned to the bottom-right
  corner, FA-2's convention) and a tail (fewer than d tokens, every block up to m0 + n). Head and tail
  are unmasked calls of the core's FA-2 provider, as the dense core's tail is. torch_cudnn aligns its
  causal mask to the top-left corner: where it is the compressed provider, square rows (m0 = 0) are one
  call, rows after m0 >= 2 blocks calls over pieces of the blocks merged by log-sum-exp
  (TorchCudnnProvider.offset_rows: the FA-2
  alternative ran 1.6x slower there and its GQA backward held [m0 + n, d*Hq, D] gradients, about 32 KB per
  token of the stream at Hq = 64, D = 128), and a single row or m0 = 1 the core's FA-2 provider. The
  three parts are joined into one o_cmp (one copy of [Tq, Hq, Dv]) for the combine;
- top-n, selection forward (with the gate combine in its epilogue) and backward: the Triton kernels with
  q_offset (the stream position of query row 0; K/V rows are stream positions);
- sliding branch: on its FA-2 provider, the band of keys [offset - w + 1, offset + Tq) with the causal
  window aligned to the bottom-right corner; on NSA's Triton window kernels (which index queries and keys
  alike), q is zero-padded at the front to the band's length, and the padded rows' outputs dropped (their
  output gradient is zero, so they add nothing to dK/dV).

Not twice differentiable. Packed input stays on the chunked torch path (nsa.distributed.local).
"""

from __future__ import annotations

import torch

from .. import telemetry
from ..branches.combine import triton as combine_triton
from ..branches.compressed.fa2 import MIN_VIEW_ROWS, rows_attention, tail_attention
from ..branches.compressed.fold import expand_kv, unfold_view_lse, unfold_view_o, view_foldable
from ..branches.fa2_call import pad_last, prep
from ..branches.selected import triton as selected_triton
from ..branches.sliding import triton as sliding_triton
from ..kernels.fa2.torch_cudnn import MIN_KEYS
from .dense_core import _keep_graph, _leaf


def cmp_parts(offset: int, Tq: int, cfg) -> tuple[int, int, int, int]:
    """(m0, hl, n, ta): blocks the head sees, head length, whole rows, first tail row (local rows)."""
    t0, d = cfg.block_cmp - 1, cfg.stride_cmp
    end = offset + Tq
    m0 = 0 if offset <= t0 else -(-(offset - t0) // d)
    row0 = t0 + m0 * d  # stream position of the first whole row
    hl = min(row0, end) - offset
    n = max(0, (end - row0) // d)
    return m0, hl, n, hl + n * d


def _fa2(plan):
    """The FA-2 provider for unmasked calls and non-square rows (the core step's: never torch_cudnn)."""
    return plan.core.impl[0]


class OffsetCmp:
    """The compressed branch of queries at a stream offset (module doc): `.lse` [B, Tq, Hq] fp32, `.seg`
    (o_cmp as one Segments run), `.grad(da, keep)` -> (dq, dk_cmp, dv_cmp)."""

    def __init__(self, plan, q, k_cmp, v_cmp, offset, cfg, scale):
        B, Tq, Hq, Dk = q.shape
        Dv = v_cmp.shape[3]
        d = cfg.stride_cmp
        m0, hl, n, ta = cmp_parts(offset, Tq, cfg)
        prov_rows, ctx = plan.cmp.impl
        # cuDNN (top-left causal) serves square rows directly and rows after m0 >= 2 blocks as merged calls over
        # pieces of the blocks (TorchCudnnProvider.offset_rows); a single row or m0 = 1 go to the FA-2 provider
        split = prov_rows.name == "torch_cudnn" and m0 >= MIN_KEYS and n >= MIN_KEYS
        if prov_rows.name == "torch_cudnn" and not split and (m0 > 0 or n < MIN_VIEW_ROWS):
            prov_rows = _fa2(plan)
        kd = ctx.kernel_dtype
        D = max(Dk, Dv)
        with torch.enable_grad():
            self.leaves = (_leaf(q), _leaf(k_cmp), _leaf(v_cmp))
            ql, kl, vl = self.leaves
            kc, vc = kl.to(kd), pad_last(vl.to(kd), D)
            qk = pad_last(ql.to(kd), D)
            outs, lses = [], []
            if hl and m0:  # the head sees blocks [0, m0)
                o, lse = tail_attention(_fa2(plan), qk[:, :hl], pad_last(kc[:, :m0], D), vc[:, :m0], scale)
                outs.append(o)
                lses.append(lse.detach().float())
            elif hl:  # before the first block ends: nothing visible
                outs.append(qk.new_zeros(B, hl, Hq, D))
                lses.append(q.new_full((B, hl, Hq), float("-inf"), dtype=torch.float32))
            if n:
                rows = qk[:, hl:ta]
                rows = rows.view(B, n, d * Hq, D) if view_foldable(rows) else rows.reshape(B, n, d * Hq, D)
                kr, vr = expand_kv(kc, m0 + n, d, D), expand_kv(vc, m0 + n, d, D)
                if split:
                    telemetry.event("cmp", "torch_cudnn", "offset_rows_split")
                    o, lse = prov_rows.offset_rows(rows, kr, vr, m0, scale)
                else:
                    o, lse = rows_attention(prov_rows, rows, kr, vr, scale)
                outs.append(unfold_view_o(o, Hq))
                lses.append(unfold_view_lse(lse.detach(), Hq, d))
            if ta < Tq:  # the tail sees blocks [0, m0 + n]
                o, lse = tail_attention(_fa2(plan), qk[:, ta:], pad_last(kc[:, :m0 + n + 1], D),
                                        vc[:, :m0 + n + 1], scale)
                outs.append(o)
                lses.append(lse.detach().float())
            o = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
            self.o_graph = o[..., :Dv].to(q.dtype)
        self.lse = torch.cat(lses, 1) if len(lses) > 1 else lses[0]
        o = self.o_graph.detach()
        self.seg = combine_triton.segments(o, 0, o[:, :0])

    def grad(self, da, keep: bool):
        if not self.o_graph.requires_grad:  # no block visible anywhere: a constant 0
            return tuple(torch.zeros_like(x) for x in self.leaves)
        grads = torch.autograd.grad(self.o_graph, self.leaves, da.main, retain_graph=keep, allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, self.leaves))


class OffsetWindow:
    """The sliding branch of queries at a stream offset over the band kw, vw of keys [w0, offset + Tq)
    (module doc): `.o` [B, Tq, Hq, Dv], `.grad(dw, keep)` -> (dq, dkw, dvw)."""

    def __init__(self, plan, q, kw, vw, offset, w0, cfg, scale):
        self.shift = offset - w0  # keys of the band before the first query
        if plan.win.provider == "triton_window":
            telemetry.event("win", "triton", "window_forward_offset")
            B, Tq, Hq, D = q.shape
            qp = q.new_zeros(B, self.shift + Tq, Hq, D)
            qp[:, self.shift:] = q
            o, self.lse = sliding_triton.forward(qp, kw, vw, cfg, scale)
            self.inputs, self.o_pad, self.cfg, self.scale = (qp, kw, vw), o, cfg, scale
            self.o, self.o_graph = o[:, self.shift:].contiguous(), None
            return
        prov, ctx = plan.win.impl
        left = cfg.window - 1
        causal = left >= kw.shape[1] - 1  # the window covers the whole band: plain causal
        with torch.enable_grad():
            self.leaves = (_leaf(q), _leaf(kw), _leaf(vw))
            qf, kf, vf = prep(prov, self.leaves, ctx, "win")
            o, _ = prov.attn(qf, kf, vf, causal=causal, left=-1 if causal else left, scale=scale, varlen=None,
                             need_lse=False)
            self.o_graph = o[..., :vw.shape[-1]].to(q.dtype)
        self.o = self.o_graph.detach().contiguous()

    def grad(self, dw, keep: bool):
        if self.o_graph is None:
            do = torch.zeros_like(self.o_pad)
            do[:, self.shift:] = dw
            dq, dk, dv = sliding_triton.backward(do, *self.inputs, self.o_pad, self.lse, self.cfg, self.scale)
            return dq[:, self.shift:], dk, dv
        return torch.autograd.grad(self.o_graph, self.leaves, dw, retain_graph=keep)


class OffsetCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, kw, vw, gates, run):
        plan, cfg, scale, given, offset = run["plan"], run["cfg"], run["scale"], run["indices"], run["offset"]
        B, Tq = q.shape[:2]
        window = OffsetWindow(plan, q, kw, vw, offset, run["w0"], cfg, scale)
        cmp = OffsetCmp(plan, q, k_cmp, v_cmp, offset, cfg, scale)
        ss = torch.zeros(B, Tq, dtype=torch.int32, device=q.device)  # dense: every sequence starts at 0
        if given is None:
            idx = selected_triton.top_n_at(q, k_cmp, cmp.lse, ss, ss, cfg, scale, offset)
        else:
            idx = given
        out, o_sel, lse_sel = selected_triton.forward(q, k, v, idx, ss, cfg.block_sel, scale,
                                                     combine=(gates, cmp.seg, window.o), q_offset=offset)
        cmp.lse = None
        ctx.graphs = (cmp, window)
        ctx.save_for_backward(q, k, v, gates, o_sel, lse_sel, window.o, idx, ss)
        ctx.block_sel, ctx.scale, ctx.offset = cfg.block_sel, scale, offset
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)
        return out, idx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _didx):
        q, k, v, gates, o_sel, lse_sel, o_win, idx, ss = ctx.saved_tensors
        cmp, window = ctx.graphs
        keep = _keep_graph()
        dout = torch.zeros_like(o_win) if dout is None else dout.contiguous()
        dg, da, ds, dw = combine_triton.backward(dout, gates, cmp.seg, o_sel, o_win)
        dq, dkw, dvw = window.grad(dw, keep)
        dq_cmp, dk_cmp, dv_cmp = cmp.grad(da, keep)
        kv_ss = torch.zeros(k.shape[0], k.shape[1], dtype=torch.int32, device=k.device)
        _, dk, dv = selected_triton.backward(ds, q, k, v, o_sel, lse_sel, idx, ss, ctx.block_sel, ctx.scale,
                                            dq_into=dq, dq_more=(dq_cmp, 0), q_offset=ctx.offset,
                                            kv_seq_start=kv_ss)
        if not keep:
            ctx.graphs = None
        return dq, dk, dv, dk_cmp, dv_cmp, dkw, dvw, dg, None


def run_offset(plan, q, k, v, gates, cfg, offset: int, k_cmp, v_cmp, kw, vw, indices=None):
    """(out [B, Tq, Hq, Dv], int32 indices [B, Tq, Hkv, n_sel]) of the queries q [B, Tq, Hq, Dk] at the stream
    positions [offset, offset + Tq). k, v, kw, vw hold at least the stream's first offset + Tq tokens;
    k_cmp, v_cmp its compressed blocks (at least those the queries see); indices: given blocks (unique per
    row, -1 padded) or None for the top-n kernel's. `plan` is a fused dense-core plan (nsa.plan)."""
    Tq = q.shape[1]
    end = offset + Tq
    w0 = max(0, offset - cfg.window + 1)
    telemetry.event("pipeline", "fused", "dense_core_offset")
    run = {"plan": plan, "cfg": cfg, "scale": cfg.softmax_scale(q.shape[-1]), "indices": indices,
           "offset": offset, "w0": w0}
    return OffsetCore.apply(q, k[:, :end], v[:, :end], k_cmp, v_cmp, kw[:, w0:end], vw[:, w0:end], gates, run)


__all__ = ["OffsetCmp", "OffsetCore", "OffsetWindow", "cmp_parts", "run_offset"]
