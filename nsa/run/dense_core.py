"""The fused pipeline for dense input as ONE autograd node: no copy folds q, no autograd glue.

Run as separate autograd operations (nsa.run.fused), the fused pipeline moves about 15 ms of
[B, T, Hq, D] tensors per forward+backward at T=64k on an H100 (bf16, Hq=64) that no kernel needs: the
compressed branch's fold and unfold copies of q, o and their gradients, the zero-fill-and-copy of every
slice's backward, and the sums of the three branches' dq by autograd. Here the steps run inside one
torch.autograd.Function:

- compressed branch folded by VIEW (nsa.branches.compressed.fold, "Folding by view"): the FA-2 / cuDNN
  call reads q in place, writes its rows in token order, and gets its output gradient in the same
  layout; the few tail tokens after the last whole row see every block they can: one unmasked call of
  the sliding branch's FA-2 provider (nsa.branches.compressed.fa2: rows_attention, tail_attention);
- gate combine reads o_cmp as two token segments and writes their gradients in place
  (nsa.branches.combine.triton.segments); in the forward it runs in the selection kernel's epilogue;
- the selection dq kernel adds its dq and the compressed branch's to the sliding branch's, in fp32 on the
  way out (one buffer, no autograd sum, no extra pass);
- indices from the top-n kernel are unique and ascending already: no deduplication pass;
- the sliding branch is launched first (`start_window`, before the compression): the GPU starts on a
  large kernel while the host prepares the rest, instead of idling through the small steps' launches;
  in the backward, the selection's work plan and the tail tokens' torch backward (many small
  operations) are issued after the selection's dq kernel, for the same reason.

The FA-2 / cuDNN calls keep their own autograd formulas: each runs under enable_grad on leaves made for
it (a view of q, the expanded compressed K/V), and the backward asks autograd for those leaves' gradients,
so the library's backward runs exactly as it would outside (dropout off, the same saved tensors).

Every step is a branch function (nsa.branches); which providers serve them, and whether the core applies
at all (the plan's core step, nsa.plan.rules.dense_core_guard), planning decides: dense input, compressed
and sliding branches on an FA-2-family provider (flash_attn, torch_flash, torch_cudnn) with no dtype cast
or head-dim padding, selection, top-n (or given indices) and combine on Triton, a q whose tokens can be
viewed as rows, at least two rows. NSA_DENSE_CORE=0 turns it off. Not twice differentiable.
"""

from __future__ import annotations

import torch

from .. import telemetry
from ..branches.combine import triton as combine_triton
from ..branches.compressed.fa2 import rows_attention, tail_attention
from ..branches.compressed.fold import expand_kv, fold_q_view, unfold_view_lse, unfold_view_o, view_rows
from ..branches.selected import triton as selected_triton
from ..branches.sliding import triton as sliding_triton


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (retain_graph=True); unknown (an older torch): keep."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_()


class DenseCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, kw, vw, gates, run):
        plan, layout, cfg, scale, given = run["plan"], run["layout"], run["cfg"], run["scale"], run["indices"]
        B, T, Hq, D = q.shape
        Hkv = k.shape[2]
        d = cfg.stride_cmp
        t0, n = view_rows(T, cfg)
        ta = t0 + n * d  # first tail token (T when there is none)
        prov_cmp = plan.cmp.impl[0]

        window = run["window"]
        with torch.enable_grad():
            # Compressed branch: rows by view, then the tail (fewer than d tokens) on the window's FA-2 provider.
            cmp_in = (_leaf(fold_q_view(q, t0, n, d)), _leaf(expand_kv(k_cmp, n, d)), _leaf(expand_kv(v_cmp, n, d)))
            o_rows, lse_rows = rows_attention(prov_cmp, *cmp_in, scale)
            o_main = unfold_view_o(o_rows, Hq)
            lse = torch.empty(B, T, Hq, device=q.device, dtype=torch.float32)
            lse[:, :t0] = float("-inf")  # tokens before the first row see no block
            lse[:, t0:ta] = unfold_view_lse(lse_rows.detach(), Hq, d)
            if ta < T:
                tail_in = (_leaf(q[:, ta:]), _leaf(k_cmp[:, :n + 1]), _leaf(v_cmp[:, :n + 1]))
                o_tail, lse_tail = tail_attention(plan.core.impl[0], *tail_in, scale)
                lse[:, ta:] = lse_tail.detach()
            else:
                tail_in, o_tail = None, o_main.new_zeros(B, 0, Hq, o_main.shape[-1])

        if given is None:
            idx = plan.topn.fn(q, k_cmp, lse, layout, cfg, scale)  # unique and ascending: no dedupe pass
        else:
            idx = given
        ss = layout.seq_start_i32
        seg = combine_triton.segments(o_main.detach(), t0, o_tail.detach())
        # The gate combine runs in the selection kernel's epilogue.
        out, o_sel, lse_sel = selected_triton.forward(q, k, v, idx, ss, cfg.block_sel, scale,
                                                     combine=(gates, seg, window.o))

        ctx.graphs = ((o_main, cmp_in), (o_tail, tail_in), window)
        ctx.seg, ctx.shape = seg, (t0, n, ta, d, Hkv)
        ctx.save_for_backward(q, k, v, gates, o_sel, lse_sel, window.o, idx, ss)
        ctx.block_sel, ctx.scale, ctx.k_cmp_shape = cfg.block_sel, scale, (k_cmp.shape, v_cmp.shape)
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for idx (a kernel and its host time)
        return out, idx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _didx):
        q, k, v, gates, o_sel, lse_sel, o_win, idx, ss = ctx.saved_tensors
        (o_main, cmp_in), (o_tail, tail_in), window = ctx.graphs
        t0, n, ta, d, Hkv = ctx.shape
        B = q.shape[0]
        # The inner graphs live as long as this node: kept when the caller keeps the graph (retain_graph).
        keep = _keep_graph()
        dout = torch.zeros_like(o_win) if dout is None else dout.contiguous()
        dg, da, ds, dw = combine_triton.backward(dout, gates, ctx.seg, o_sel, o_win)
        dq, dkw, dvw = window.grad(dw, keep)
        dq_rows, dk_rows, dv_rows = torch.autograd.grad(o_main, cmp_in, da.main, retain_graph=keep)
        dk_cmp = dk_rows.new_zeros(ctx.k_cmp_shape[0])
        dv_cmp = dv_rows.new_zeros(ctx.k_cmp_shape[1])
        dk_cmp[:, :n] = dk_rows.unflatten(2, (d, Hkv)).sum(2)
        dv_cmp[:, :n] = dv_rows.unflatten(2, (d, Hkv)).sum(2)
        # The selection dq kernel adds its dq and the compressed rows' (a view when written row-major) in fp32.
        dq_rows = dq_rows.reshape(B, ta - t0, *dq.shape[2:])
        _, dk, dv = selected_triton.backward(ds, q, k, v, o_sel, lse_sel, idx, ss, ctx.block_sel, ctx.scale,
                                            dq_into=dq, dq_more=(dq_rows, t0))
        if ta < q.shape[1]:  # after the selection kernels: its small torch operations queue behind them
            dq_t, dk_t, dv_t = torch.autograd.grad(o_tail, tail_in, da.tail.to(o_tail.dtype), retain_graph=keep)
            dq[:, ta:] += dq_t
            dk_cmp[:, :n + 1] += dk_t
            dv_cmp[:, :n + 1] += dv_t
        if not keep:
            ctx.graphs = ctx.seg = None
        return dq, dk, dv, dk_cmp, dv_cmp, dkw, dvw, dg, None


class GraphWindow:
    """The sliding branch on its FA-2 provider, run on its own leaves: the provider's autograd formula
    serves the backward."""

    def __init__(self, plan, q, kw, vw, layout, cfg, scale):
        with torch.enable_grad():
            self.leaves = (_leaf(q), _leaf(kw), _leaf(vw))
            self.o_graph = plan.win.fn(*self.leaves, layout, cfg, scale)
        self.o = self.o_graph.detach()

    def grad(self, dw, keep: bool):
        return torch.autograd.grad(self.o_graph, self.leaves, dw, retain_graph=keep)


class TritonWindow:
    """The sliding branch on NSA's Triton kernels (nsa.branches.sliding.triton: faster than FA-2's on Hopper),
    forward now and backward from the saved o and LSE."""

    def __init__(self, q, kw, vw, cfg, scale):
        telemetry.event("win", "triton", "window_forward")
        self.o, self.lse = sliding_triton.forward(q, kw, vw, cfg, scale)
        self.inputs, self.cfg, self.scale = (q, kw, vw), cfg, scale

    def grad(self, dw, keep: bool):
        return sliding_triton.backward(dw, *self.inputs, self.o, self.lse, self.cfg, self.scale)


def start_window(plan, q, kw, vw, layout, cfg, scale):
    """The sliding branch (a GraphWindow or, where planning chose "triton_window" for the win step, a
    TritonWindow: `.o`, `.grad(dw, keep)`). It needs nothing else of the pipeline, so the pipeline launches it
    first, before the compression and its own host work: the GPU starts on a large kernel as early as it can."""
    if plan.win.provider == "triton_window":
        return TritonWindow(q, kw, vw, cfg, scale)
    return GraphWindow(plan, q, kw, vw, layout, cfg, scale)


def run(plan, q, k, v, gates, cfg, layout, k_cmp, v_cmp, kw, vw, scale, indices, window):
    """(out, indices) of the fused pipeline for dense input (see the module doc); `window` is what
    start_window returned for these q, kw, vw."""
    run_args = {"plan": plan, "layout": layout, "cfg": cfg, "scale": scale, "indices": indices, "window": window}
    return DenseCore.apply(q, k, v, k_cmp, v_cmp, kw, vw, gates, run_args)


__all__ = ["DenseCore", "GraphWindow", "TritonWindow", "run", "start_window"]
