"""The fused pipeline as ONE autograd node: no copy folds q where it can be viewed, no autograd glue.

Run as separate autograd operations (nsa.run.fused), the fused pipeline moves about 15 ms of
[B, T, Hq, D] tensors per forward+backward at T=64k on an H100 (bf16, Hq=64) that no kernel needs: the
compressed branch's fold and unfold copies of q, o and their gradients, the zero-fill-and-copy of every
slice's backward, and the sums of the three branches' dq by autograd. Here the steps run inside one
torch.autograd.Function:

- compressed branch (`ViewCmp`) folded by VIEW (nsa.branches.compressed.fold, "Folding by view"): the
  FA-2 / cuDNN call reads q in place, writes its rows in token order, and gets its output gradient in the
  same layout; the few tail tokens after the last whole row see every block they can: one unmasked call
  of the sliding branch's FA-2 provider (nsa.branches.compressed.fa2: rows_attention, tail_attention).
  With Dk > Dv the expanded V copy is zero-padded to Dk in the same copy (FA-2 takes one head dim) and the
  output's first Dv columns are read in place;
- where q cannot be viewed as rows (packed input, whose sequences do not start on a common multiple of d;
  Dk < Dv, which pads q; a dtype cast for the kernel; a transposed q; fewer than two rows), the compressed
  branch is the planned provider's whole call (`GraphCmp`: the copying fold, varlen with the sequences'
  offsets for packed input), run on leaves like the FA-2 calls below: the rest of the node is unchanged;
- gate combine reads o_cmp as two token segments and writes their gradients in place
  (nsa.branches.combine.triton.segments); in the forward it runs in the selection kernel's epilogue;
- the selection dq kernel adds its dq and the compressed branch's to the sliding branch's, in fp32 on the
  way out (one buffer, no autograd sum, no extra pass);
- indices from the top-n kernel are unique and ascending already: no deduplication pass;
- the sliding branch is launched first (`start_window`, before the compression): the GPU starts on a
  large kernel while the host prepares the rest, instead of idling through the small steps' launches;
  in the backward, the selection's work plan and the tail tokens' torch backward (many small
  operations) are issued after the selection's dq kernel, for the same reason. It runs on NSA's Triton
  window kernels where they serve (dense input, Hopper, the head dims they take), else on its FA-2
  provider (varlen over the sequences for packed input; zero-padded head dims and casts as planned).

The selection, top-n and combine kernels read each token's sequence start (layout.seq_start_i32), so
packed input needs nothing else of them.

The FA-2 / cuDNN calls keep their own autograd formulas: each runs under enable_grad on leaves made for
it (a view of q, the expanded compressed K/V), and the backward asks autograd for those leaves' gradients,
so the library's backward runs exactly as it would outside (dropout off, the same saved tensors).

Every step is a branch function (nsa.branches); which providers serve them, and whether the core applies
at all (the plan's core step, nsa.plan.rules.dense_core_guard), planning decides: compressed and sliding
branches on an FA-2-family provider (flash_attn, torch_flash, torch_cudnn), selection, top-n (or given
indices) and combine on Triton, dense or packed input. Which form the compressed branch takes is decided here
(`view_fold`) and counted in nsa.telemetry as a ("cmp", provider, "fold_view" / "fold_copy") event.
NSA_DENSE_CORE=0 turns the core off. Not twice differentiable.
"""

from __future__ import annotations

import torch

from .. import telemetry
from ..branches.combine import triton as combine_triton
from ..branches.compressed import triton as cmp_triton
from ..branches.compressed.fa2 import rows_attention, tail_attention, view_fold_applies
from ..branches.compressed.fold import expand_kv, fold_q_view, unfold_view_lse, unfold_view_o, view_foldable, view_rows
from ..branches.fa2_call import pad_last
from ..branches.selected import triton as selected_triton
from ..branches.sliding import triton as sliding_triton


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (retain_graph=True); unknown (an older torch): keep."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_()


def view_fold(plan, q, v_cmp, cfg) -> bool:
    """Whether the compressed branch folds q by view (ViewCmp) rather than by the provider's copy (GraphCmp):
    dense input, kernels in q's dtype (no cast), Dk >= Dv (only V is padded), a q whose tokens can be viewed
    as rows, at least MIN_VIEW_ROWS (nsa.branches.compressed.fa2) of them."""
    cmp_ctx, win_ctx = plan.cmp.impl[1], plan.core.impl[1]  # core: the FA-2 provider of the tail tokens
    return view_fold_applies(cmp_ctx, q, v_cmp, cfg) and win_ctx.kernel_dtype == q.dtype and view_foldable(q)


class ViewCmp:
    """The compressed branch of dense input folded by view: rows of d tokens from t0 as one square causal
    call, the tail tokens after the last row as one unmasked call. `.lse` [B, T, Hq] fp32, `.seg` (o_cmp as
    Segments), `.grad` (before the selection's backward) and `.grad_tail` (after it)."""

    def __init__(self, plan, q, k_cmp, v_cmp, cfg, scale):
        B, T, Hq, Dk = q.shape
        Hkv, Dv = k_cmp.shape[2], v_cmp.shape[3]
        d = cfg.stride_cmp
        t0, n = view_rows(T, cfg)
        ta = t0 + n * d  # first tail token (T when there is none)
        # Rows by view; V zero-padded to Dk in its expanded copy when Dv < Dk (FA-2 takes one head dim; cuDNN
        # from the release with the wide heads takes V as it is).
        v_dim = Dv if plan.cmp.impl[0].takes_narrower_v() else Dk
        with torch.enable_grad():
            self.rows_in = (_leaf(fold_q_view(q, t0, n, d)), _leaf(expand_kv(k_cmp, n, d)),
                            _leaf(expand_kv(v_cmp, n, d, v_dim)))
            o_rows, lse_rows = rows_attention(plan.cmp.impl[0], *self.rows_in, scale)
            self.o_main = unfold_view_o(o_rows, Hq)[..., :Dv]
            lse = torch.empty(B, T, Hq, device=q.device, dtype=torch.float32)
            lse[:, :t0] = float("-inf")  # tokens before the first row see no block
            lse[:, t0:ta] = unfold_view_lse(lse_rows.detach(), Hq, d)
            if ta < T:  # the tail (fewer than d tokens) on the window's FA-2 provider
                self.tail_in = (_leaf(q[:, ta:]), _leaf(k_cmp[:, :n + 1]), _leaf(pad_last(v_cmp[:, :n + 1], Dk)))
                o_tail, lse_tail = tail_attention(plan.core.impl[0], *self.tail_in, scale)
                self.o_tail = o_tail[..., :Dv]
                lse[:, ta:] = lse_tail.detach()
            else:
                self.tail_in, self.o_tail = None, self.o_main.new_zeros(B, 0, Hq, Dv)
        self.lse = lse
        self.seg = combine_triton.segments(self.o_main.detach(), t0, self.o_tail.detach())
        self.dims = (t0, n, ta, d, Hkv, Dv, k_cmp.shape, v_cmp.shape)

    def grad(self, da, keep: bool):
        """(dq_more for the selection dq kernel: (dq of the rows, t0), dk_cmp, dv_cmp) of the rows."""
        t0, n, ta, d, Hkv, Dv, k_shape, v_shape = self.dims
        dq_rows, dk_rows, dv_rows = torch.autograd.grad(self.o_main, self.rows_in, da.main, retain_graph=keep)
        dk_cmp = dk_rows.new_zeros(k_shape)
        dv_cmp = dv_rows.new_zeros(v_shape)
        dk_cmp[:, :n] = dk_rows.unflatten(2, (d, Hkv)).sum(2)
        dv_cmp[:, :n] = dv_rows[..., :Dv].unflatten(2, (d, Hkv)).sum(2)
        # Added to dq by the selection dq kernel in fp32 (a view when written row-major).
        B, _, _, Dk = dq_rows.shape
        return (dq_rows.reshape(B, ta - t0, -1, Dk), t0), dk_cmp, dv_cmp

    def grad_tail(self, da, dq, dk_cmp, dv_cmp, keep: bool) -> None:
        """The tail tokens' gradients, added in place (after the selection kernels: its small torch
        operations queue behind them)."""
        if self.tail_in is None:
            return
        t0, n, ta, d, Hkv, Dv, _, _ = self.dims
        dq_t, dk_t, dv_t = torch.autograd.grad(self.o_tail, self.tail_in, da.tail.to(self.o_tail.dtype),
                                               retain_graph=keep)
        dq[:, ta:] += dq_t
        dk_cmp[:, :n + 1] += dk_t
        dv_cmp[:, :n + 1] += dv_t[..., :Dv]


class GraphCmp:
    """The compressed branch as the planned provider's whole call (nsa.branches.compressed.fa2: the copying
    fold; varlen over the sequences for packed input; casts and head-dim padding as planned), run on its
    own leaves: the provider's autograd formula serves the backward. Same interface as ViewCmp."""

    def __init__(self, plan, q, k_cmp, v_cmp, layout, cfg, scale):
        with torch.enable_grad():
            self.leaves = (_leaf(q), _leaf(k_cmp), _leaf(v_cmp))
            o, self.lse = plan.cmp.fn(*self.leaves, layout, cfg, scale)
        # No block anywhere (every sequence shorter than l): a constant 0, no graph.
        self.o_graph = o if o.requires_grad else None
        o = o.detach()
        self.seg = combine_triton.segments(o, 0, o[:, :0])

    def grad(self, da, keep: bool):
        q, k_cmp, v_cmp = self.leaves
        if self.o_graph is None:
            return None, torch.zeros_like(k_cmp), torch.zeros_like(v_cmp)
        grads = torch.autograd.grad(self.o_graph, self.leaves, da.main, retain_graph=keep, allow_unused=True)
        dq, dk, dv = (torch.zeros_like(x) if g is None else g for g, x in zip(grads, self.leaves))
        return (dq, 0), dk, dv

    def grad_tail(self, da, dq, dk_cmp, dv_cmp, keep: bool) -> None:
        return None


class TritonCmp:
    """The compressed branch on NSA's Triton kernels (nsa.branches.compressed.triton; planning's "triton_cmp"),
    forward now and backward from the saved o and LSE. Same interface as ViewCmp."""

    def __init__(self, q, k_cmp, v_cmp, cfg, scale):
        telemetry.event("cmp", "triton_cmp", "cmp_forward")
        o, self.lse = cmp_triton.forward(q, k_cmp, v_cmp, cfg, scale)
        self.saved = (q, k_cmp, v_cmp, o, self.lse)  # the core drops .lse after the top-n
        self.seg = combine_triton.segments(o, 0, o[:, :0])
        self.cfg, self.scale = cfg, scale

    def grad(self, da, keep: bool):
        q, k_cmp, v_cmp, o, lse = self.saved
        dq, dk, dv = cmp_triton.backward(da.main, q, k_cmp, v_cmp, o, lse, self.cfg, self.scale)
        if not keep:
            self.saved = None
        return (dq, 0), dk, dv

    def grad_tail(self, da, dq, dk_cmp, dv_cmp, keep: bool) -> None:
        return None


def start_cmp(plan, q, k_cmp, v_cmp, layout, cfg, scale):
    """The compressed branch of the core: TritonCmp where planning chose "triton_cmp" and the compressed K/V
    can be read by TMA copies (else counted as a fallback), ViewCmp where `view_fold` holds, else GraphCmp
    (counted)."""
    prov = plan.cmp.provider
    if prov == "triton_cmp":
        ok, why = cmp_triton.supported(q, k_cmp, v_cmp)
        if ok:
            return TritonCmp(q, k_cmp, v_cmp, cfg, scale)
        prov = plan.cmp.impl[0].name
        telemetry.record("cmp", prov, "triton_cmp_unsupported", why=why)
    if view_fold(plan, q, v_cmp, cfg):
        telemetry.event("cmp", prov, "fold_view")
        return ViewCmp(plan, q, k_cmp, v_cmp, cfg, scale)
    telemetry.event("cmp", prov, "fold_copy")
    return GraphCmp(plan, q, k_cmp, v_cmp, layout, cfg, scale)


class DenseCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, kw, vw, gates, run):
        plan, layout, cfg, scale, given = run["plan"], run["layout"], run["cfg"], run["scale"], run["indices"]
        window = run["window"]
        cmp = start_cmp(plan, q, k_cmp, v_cmp, layout, cfg, scale)
        if given is None:
            idx = plan.topn.fn(q, k_cmp, cmp.lse, layout, cfg, scale)  # unique and ascending: no dedupe pass
        else:
            idx = given
        ss = layout.seq_start_i32
        # The gate combine runs in the selection kernel's epilogue.
        out, o_sel, lse_sel = selected_triton.forward(q, k, v, idx, ss, cfg.block_sel, scale,
                                                     combine=(gates, cmp.seg, window.o))
        cmp.lse = None  # read by the top-n kernel only
        ctx.graphs = (cmp, window)
        ctx.save_for_backward(q, k, v, gates, o_sel, lse_sel, window.o, idx, ss)
        ctx.block_sel, ctx.scale = cfg.block_sel, scale
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for idx (a kernel and its host time)
        return out, idx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _didx):
        q, k, v, gates, o_sel, lse_sel, o_win, idx, ss = ctx.saved_tensors
        cmp, window = ctx.graphs
        # The inner graphs live as long as this node: kept when the caller keeps the graph (retain_graph).
        keep = _keep_graph()
        dout = torch.zeros_like(o_win) if dout is None else dout.contiguous()
        dg, da, ds, dw = combine_triton.backward(dout, gates, cmp.seg, o_sel, o_win)
        dq, dkw, dvw = window.grad(dw, keep)
        dq_more, dk_cmp, dv_cmp = cmp.grad(da, keep)
        # The selection dq kernel adds its dq and the compressed branch's to the window's, in fp32.
        _, dk, dv = selected_triton.backward(ds, q, k, v, o_sel, lse_sel, idx, ss, ctx.block_sel, ctx.scale,
                                            dq_into=dq, dq_more=dq_more)
        cmp.grad_tail(da, dq, dk_cmp, dv_cmp, keep)
        if not keep:
            ctx.graphs = None
        return dq, dk, dv, dk_cmp, dv_cmp, dkw, dvw, dg, None


class GraphWindow:
    """The sliding branch on its FA-2 provider, run on its own leaves: the provider's autograd formula
    serves the backward."""

    def __init__(self, plan, q, kw, vw, layout, cfg, scale):
        with torch.enable_grad():
            self.leaves = (_leaf(q), _leaf(kw), _leaf(vw))
            self.o_graph = plan.win.fn(*self.leaves, layout, cfg, scale)
        # Contiguous once here (a padded head dim leaves a strided view): the selection epilogue reads it
        # with its own output's strides.
        self.o = self.o_graph.detach().contiguous()

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
    """(out, indices) of the fused pipeline as one autograd node (see the module doc); `window` is what
    start_window returned for these q, kw, vw."""
    run_args = {"plan": plan, "layout": layout, "cfg": cfg, "scale": scale, "indices": indices, "window": window}
    return DenseCore.apply(q, k, v, k_cmp, v_cmp, kw, vw, gates, run_args)


__all__ = ["DenseCore", "GraphCmp", "GraphWindow", "TritonCmp", "TritonWindow", "ViewCmp", "run", "start_cmp",
           "start_window", "view_fold"]
