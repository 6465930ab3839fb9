"""The fused pipeline for dense input as ONE autograd node: no copy folds q, no autograd glue.

Run as separate autograd operations (nsa.pipeline.run_fused), the fused pipeline moves about 15 ms of
[B, T, Hq, D] tensors per forward+backward at T=64k on an H100 (bf16, Hq=64) that no kernel needs: the
compressed branch's fold and unfold copies of q, o and their gradients, the zero-fill-and-copy of every
slice's backward, and the sums of the three branches' dq by autograd. Here the steps run inside one
torch.autograd.Function:

- compressed branch folded by VIEW (nsa.branches.compressed.fold, "Folding by view"): the FA-2 / cuDNN
  call reads q in place, writes its rows in token order, and gets its output gradient in the same
  layout; the few tail tokens after the last whole row see every block they can: one unmasked call of
  the sliding branch's FA-2 provider;
- gate combine reads o_cmp as two token segments and writes their gradients in place
  (nsa.kernels.triton.combine.Segments); in the forward it runs in the selection kernel's epilogue;
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

Applies (planning decides, `applies`): dense input, compressed and sliding branches on an FA-2-family
provider (flash_attn, torch_flash, torch_cudnn) with no dtype cast or head-dim padding, selection, top-n
(or given indices) and combine on Triton, a q whose tokens can be viewed as rows, at least two rows.
NSA_DENSE_CORE=0 turns it off. Not twice differentiable.
"""

from __future__ import annotations

import torch

from . import telemetry
from .branches.compressed.fold import expand_kv, fold_q_view, unfold_view_lse, unfold_view_o, view_foldable, view_rows
from .kernels.fa2 import guards

MIN_ROWS = 2  # cuDNN's backward refuses a 1 x 1 attention


def applies(plan_steps, ctx, toggles, q, cfg, given_indices: bool) -> tuple[bool, str]:
    """(whether the dense core serves this call, why not)."""
    if not toggles.dense_core:
        return False, "NSA_DENSE_CORE=0"
    if ctx.packed or toggles.force_varlen:
        return False, "packed input (cu_seqlens) or NSA_FA2_FORCE_VARLEN=1"
    for step in ("cmp", "win"):
        if plan_steps[step].impl is None:
            return False, f"the {step} step is not on an FA-2-family provider"
        prov = plan_steps[step].impl[0]
        if ctx.dtype not in prov.kernel_dtypes:
            return False, f"{ctx.dtype} is cast for {prov.name}"
    if plan_steps["sel"].provider != "triton" or plan_steps["combine"].provider != "triton" or not (
            given_indices or plan_steps["topn"].provider == "triton"):
        return False, "sel, top-n and combine are not all on Triton"
    if not (ctx.Dk == ctx.Dv == guards.padded_head_dim(ctx.Dk, ctx.Dv)):
        return False, f"head dims Dk={ctx.Dk}, Dv={ctx.Dv} are padded for FA-2"
    if not view_foldable(q):
        return False, "q's token stride is not Hq times its head stride"
    if view_rows(ctx.T, cfg)[1] < MIN_ROWS:
        return False, f"T={ctx.T} has fewer than {MIN_ROWS} rows of {cfg.stride_cmp} tokens after the first block"
    return True, ""


def _tail_attention(prov, q, k_cmp, v_cmp, scale):
    """The tail tokens (fewer than d after the last whole row) all see every block of k_cmp [B, n+1, Hkv, D]:
    one call of the sliding branch's FA-2 provider with no mask (one kernel, and its backward one more,
    where attention in torch took about 25 small operations each way). (o [B, C, Hq, Dv], lse [B, C, Hq])."""
    C = q.shape[1]
    o, lse = prov.attn(q, k_cmp, v_cmp, causal=False, left=-1, scale=scale, varlen=None, need_lse=True)
    return o, lse[..., :C].transpose(1, 2)


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (retain_graph=True); unknown (an older torch): keep."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_()


class DenseCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, kw, vw, gates, run):
        from .kernels.triton.combine import Segments
        from .kernels.triton.selection import sel_forward

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
            o_rows, lse_rows = prov_cmp.attn(*cmp_in, causal=True, left=-1, scale=scale, varlen=None, need_lse=True)
            o_main = unfold_view_o(o_rows, Hq)
            lse = torch.empty(B, T, Hq, device=q.device, dtype=torch.float32)
            lse[:, :t0] = float("-inf")  # tokens before the first row see no block
            lse[:, t0:ta] = unfold_view_lse(lse_rows.detach(), Hq, d)
            if ta < T:
                tail_in = (_leaf(q[:, ta:]), _leaf(k_cmp[:, :n + 1]), _leaf(v_cmp[:, :n + 1]))
                o_tail, lse_tail = _tail_attention(plan.win.impl[0], *tail_in, scale)
                lse[:, ta:] = lse_tail.detach()
            else:
                tail_in, o_tail = None, o_main.new_zeros(B, 0, Hq, o_main.shape[-1])

        if given is None:
            idx = plan.topn.fn(q, k_cmp, lse, layout, cfg, scale)  # unique and ascending: no dedupe pass
        else:
            idx = given
        ss = layout.seq_start_i32
        seg = Segments(o_main.detach(), t0, o_tail.detach())
        # The gate combine runs in the selection kernel's epilogue.
        out, o_sel, lse_sel = sel_forward(q, k, v, idx, ss, cfg.block_sel, scale, combine=(gates, seg, window.o))

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
        from .kernels.triton.combine import combine_backward
        from .kernels.triton.selection import sel_backward

        q, k, v, gates, o_sel, lse_sel, o_win, idx, ss = ctx.saved_tensors
        (o_main, cmp_in), (o_tail, tail_in), window = ctx.graphs
        t0, n, ta, d, Hkv = ctx.shape
        B = q.shape[0]
        # The inner graphs live as long as this node: kept when the caller keeps the graph (retain_graph).
        keep = _keep_graph()
        dout = torch.zeros_like(o_win) if dout is None else dout.contiguous()
        dg, da, ds, dw = combine_backward(dout, gates, ctx.seg, o_sel, o_win)
        dq, dkw, dvw = window.grad(dw, keep)
        dq_rows, dk_rows, dv_rows = torch.autograd.grad(o_main, cmp_in, da.main, retain_graph=keep)
        dk_cmp = dk_rows.new_zeros(ctx.k_cmp_shape[0])
        dv_cmp = dv_rows.new_zeros(ctx.k_cmp_shape[1])
        dk_cmp[:, :n] = dk_rows.unflatten(2, (d, Hkv)).sum(2)
        dv_cmp[:, :n] = dv_rows.unflatten(2, (d, Hkv)).sum(2)
        # The selection dq kernel adds its dq and the compressed rows' (a view when written row-major) in fp32.
        dq_rows = dq_rows.reshape(B, ta - t0, *dq.shape[2:])
        _, dk, dv = sel_backward(ds, q, k, v, o_sel, lse_sel, idx, ss, ctx.block_sel, ctx.scale, dq_into=dq,
                                 dq_more=(dq_rows, t0))
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
    """The sliding branch on NSA's Triton kernels (nsa.kernels.triton.window: faster than FA-2's on Hopper),
    forward now and backward from the saved o and LSE."""

    def __init__(self, q, kw, vw, cfg, scale):
        from .kernels.triton.window import window_forward

        telemetry.event("win", "triton", "window_forward")
        self.o, self.lse = window_forward(q, kw, vw, cfg.window, scale)
        self.inputs, self.window, self.scale = (q, kw, vw), cfg.window, scale

    def grad(self, dw, keep: bool):
        from .kernels.triton.window import window_backward

        return window_backward(dw, *self.inputs, self.o, self.lse, self.window, self.scale)


def start_window(plan, q, kw, vw, layout, cfg, scale):
    """The sliding branch (a GraphWindow or, where planning chose it, a TritonWindow: `.o`, `.grad(dw, keep)`).
    It needs nothing else of the pipeline, so the pipeline launches it first, before the compression and its
    own host work: the GPU starts on a large kernel as early as it can."""
    if plan.window_triton:
        return TritonWindow(q, kw, vw, cfg, scale)
    return GraphWindow(plan, q, kw, vw, layout, cfg, scale)


def run(plan, q, k, v, gates, cfg, layout, k_cmp, v_cmp, kw, vw, scale, indices, window):
    """(out, indices) of the fused pipeline for dense input (see the module doc); `window` is what
    start_window returned for these q, kw, vw."""
    run_args = {"plan": plan, "layout": layout, "cfg": cfg, "scale": scale, "indices": indices, "window": window}
    return DenseCore.apply(q, k, v, k_cmp, v_cmp, kw, vw, gates, run_args)


__all__ = ["DenseCore", "GraphWindow", "MIN_ROWS", "TritonWindow", "applies", "run", "start_window"]
