"""NSA's Triton kernels as PyTorch custom operators (namespace `nsa`), so torch.compile traces calls to them
as single graph nodes instead of entering Triton's launchers (docs/compile.md).

    torch.ops.nsa.sel_fwd(q, k, v, indices, seq_start, block_sel, scale) -> (o, lse)        selected attention
    torch.ops.nsa.sel_bwd(do, q, k, v, o, lse, indices, seq_start, block_sel, scale) -> (dq, dk, dv)
    torch.ops.nsa.sel_combine_fwd(q, k, v, indices, seq_start, block_sel, scale, gates, o_cmp, cmp_lo, cmp_tail,
                                  o_win) -> (out, o, lse)  selected attention with the gate combine in its epilogue
    torch.ops.nsa.topn(q, k_cmp, lse, seq_start, cmp_slot0, block_cmp, stride_cmp, block_sel, n_sel, n_init,
                       n_local, scale) -> indices                                          fused score + top-n
    torch.ops.nsa.combine_fwd(gates, o_cmp, o_sel, o_win) -> out                            gate combine
    torch.ops.nsa.combine_bwd(dout, gates, o_cmp, cmp_lo, cmp_tail, o_sel, o_win)
        -> (dgates, do_cmp, do_cmp_tail, do_sel, do_win)
    torch.ops.nsa.window_fwd(q, k, v, window, scale) -> (o, lse)                            sliding window
    torch.ops.nsa.window_bwd(do, q, k, v, o, lse, window, scale) -> (dq, dk, dv)
    torch.ops.nsa.rope(x, positions, freqs, inverse) -> y                                   rotary embedding

o_cmp of the combining operators comes as two token segments (nsa.kernels.triton.combine.Segments): o_cmp holds
tokens [cmp_lo, cmp_lo + len(o_cmp)), cmp_tail the tokens after them, every other token's o_cmp is 0; the whole
o_cmp is (o_cmp, 0, an empty tail). The compressed branch folded by view gives its rows and its tail tokens so,
and their gradients come back the same way (no copy joining them, none splitting their gradient).

The forward operators carry their backward (register_autograd); every fake (meta) implementation gives the
exact shapes, dtypes and (contiguous) strides of the kernels' outputs, none data-dependent. The launchers run
inside the operators, so their host-side choices (launch tables, the capability, TMA) are made at run time,
never traced. Eager calls keep calling the launchers directly (the branch functions in nsa.branches take an
operator only under torch.compile), so the operators add no host time there.

Importing this module registers the operators and imports no triton (the kernels load on first run).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import NSAConfig
from .indices import dedupe_blocks

# --- selected attention ------------------------------------------------------------------------------------


@torch.library.custom_op("nsa::sel_fwd", mutates_args=())
def sel_fwd(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, seq_start: Tensor, block_sel: int,
            scale: float) -> tuple[Tensor, Tensor]:
    from .triton.selection import sel_forward

    return sel_forward(q, k, v, indices, seq_start, block_sel, scale)


@sel_fwd.register_fake
def _sel_fwd_fake(q, k, v, indices, seq_start, block_sel, scale):
    B, T, Hq, _ = q.shape
    return q.new_empty(B, T, Hq, v.shape[3]), q.new_empty(B, T, Hq, dtype=torch.float32)


@torch.library.custom_op("nsa::sel_bwd", mutates_args=())
def sel_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, indices: Tensor,
            seq_start: Tensor, block_sel: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from .triton.selection import sel_backward

    return sel_backward(do, q, k, v, o, lse, indices, seq_start, block_sel, scale)


@sel_bwd.register_fake
def _sel_bwd_fake(do, q, k, v, o, lse, indices, seq_start, block_sel, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)


def _sel_setup(ctx, inputs, output):
    q, k, v, indices, seq_start, block_sel, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, indices, seq_start)
    ctx.block_sel, ctx.scale = block_sel, scale


def _sel_backward(ctx, do, _dlse):
    q, k, v, o, lse, indices, seq_start = ctx.saved_tensors
    dq, dk, dv = sel_bwd(do, q, k, v, o, lse, indices, seq_start, ctx.block_sel, ctx.scale)
    return dq, dk, dv, None, None, None, None


sel_fwd.register_autograd(_sel_backward, setup_context=_sel_setup)


@torch.library.custom_op("nsa::sel_combine_fwd", mutates_args=())
def sel_combine_fwd(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, seq_start: Tensor, block_sel: int,
                    scale: float, gates: Tensor, o_cmp: Tensor, cmp_lo: int, cmp_tail: Tensor,
                    o_win: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    from .triton.combine import Segments
    from .triton.selection import sel_forward

    return sel_forward(q, k, v, indices, seq_start, block_sel, scale,
                       combine=(gates, Segments(o_cmp, cmp_lo, cmp_tail), o_win))


@sel_combine_fwd.register_fake
def _sel_combine_fwd_fake(q, k, v, indices, seq_start, block_sel, scale, gates, o_cmp, cmp_lo, cmp_tail, o_win):
    B, T, Hq, _ = q.shape
    Dv = v.shape[3]
    return q.new_empty(B, T, Hq, Dv), q.new_empty(B, T, Hq, Dv), q.new_empty(B, T, Hq, dtype=torch.float32)


def _sel_combine_setup(ctx, inputs, output):
    q, k, v, indices, seq_start, block_sel, scale, gates, o_cmp, cmp_lo, cmp_tail, o_win = inputs
    _, o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, indices, seq_start, gates, o_cmp, cmp_tail, o_win)
    ctx.block_sel, ctx.scale, ctx.cmp_lo = block_sel, scale, cmp_lo
    ctx.set_materialize_grads(False)  # o's gradient stays None when only out is used: no pass adding zeros


def _sel_combine_backward(ctx, dout, do_sel, _dlse):
    q, k, v, o, lse, indices, seq_start, gates, o_cmp, cmp_tail, o_win = ctx.saved_tensors
    dout = torch.zeros_like(o) if dout is None else dout
    dg, d_cmp, d_tail, d_sel, d_win = combine_bwd(dout, gates, o_cmp, ctx.cmp_lo, cmp_tail, o, o_win)
    if do_sel is not None:  # o_sel itself used downstream (the library returns only out)
        d_sel = d_sel + do_sel
    dq, dk, dv = sel_bwd(d_sel, q, k, v, o, lse, indices, seq_start, ctx.block_sel, ctx.scale)
    return dq, dk, dv, None, None, None, None, dg, d_cmp, None, d_tail, d_win


sel_combine_fwd.register_autograd(_sel_combine_backward, setup_context=_sel_combine_setup)


def _dedupe(indices: Tensor) -> Tensor:
    """int32 indices as nsa.kernels.triton.selection's entry point takes them (dedupe_blocks), traced here."""
    return dedupe_blocks(indices.to(torch.int32))


def selected_attention(q, k, v, indices, seq_start, block_sel: int, scale: float) -> Tensor:
    """o [B, T, Hq, Dv] of the selected branch through the operators (differentiable in q, k, v)."""
    ss = seq_start.to(torch.int32)
    return torch.ops.nsa.sel_fwd(q, k, v, _dedupe(indices), ss, int(block_sel), float(scale))[0]


def selected_attention_combined(q, k, v, indices, seq_start, block_sel: int, scale: float, gates, o_cmp,
                                o_win, cmp_lo: int = 0, cmp_tail: Tensor | None = None) -> Tensor:
    """out = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win through one operator: the selection forward with the
    gate combine in its epilogue, as the dense core runs it in eager mode (differentiable in q, k, v, gates,
    o_cmp, cmp_tail, o_win). o_cmp is the whole branch output, or with cmp_tail its two segments (module doc)."""
    ss = seq_start.to(torch.int32)
    tail = o_cmp[:, :0] if cmp_tail is None else cmp_tail.to(o_cmp.dtype)
    return torch.ops.nsa.sel_combine_fwd(q, k, v, _dedupe(indices), ss, int(block_sel), float(scale), gates,
                                         o_cmp, int(cmp_lo), tail, o_win.contiguous())[0]


# --- fused score + top-n -------------------------------------------------------------------------------------


@torch.library.custom_op("nsa::topn", mutates_args=())
def topn(q: Tensor, k_cmp: Tensor, lse: Tensor, seq_start: Tensor, cmp_slot0: Tensor, block_cmp: int,
         stride_cmp: int, block_sel: int, n_sel: int, n_init: int, n_local: int, scale: float) -> Tensor:
    from .triton.topn import topn_triton

    # The kernel reads only these fields (window is not one of them: any valid value).
    cfg = NSAConfig(block_cmp=block_cmp, stride_cmp=stride_cmp, block_sel=block_sel, n_sel=n_sel, n_init=n_init,
                    n_local=n_local, window=1)
    return topn_triton(q, k_cmp, lse, seq_start, cmp_slot0, cfg, scale)


@topn.register_fake
def _topn_fake(q, k_cmp, lse, seq_start, cmp_slot0, block_cmp, stride_cmp, block_sel, n_sel, n_init, n_local,
               scale):
    B, T = q.shape[:2]
    return q.new_empty(B, T, k_cmp.shape[2], n_sel, dtype=torch.int32)


def top_n(q, k_cmp, lse, seq_start, cmp_slot0, cfg: NSAConfig, scale: float) -> Tensor:
    """int32 [B, T, Hkv, n_sel] selection blocks through the operator (no gradient flows through them)."""
    return torch.ops.nsa.topn(q.detach(), k_cmp.detach(), lse.detach(), seq_start, cmp_slot0, cfg.block_cmp,
                              cfg.stride_cmp, cfg.block_sel, cfg.n_sel, cfg.n_init, cfg.n_local, float(scale))


# --- gate combine ----------------------------------------------------------------------------------------------


@torch.library.custom_op("nsa::combine_fwd", mutates_args=())
def combine_fwd(gates: Tensor, o_cmp: Tensor, o_sel: Tensor, o_win: Tensor) -> Tensor:
    from .triton.combine import Segments, combine_forward

    return combine_forward(gates, Segments.whole(o_cmp), o_sel, o_win)


@combine_fwd.register_fake
def _combine_fwd_fake(gates, o_cmp, o_sel, o_win):
    return torch.empty_like(o_sel, memory_format=torch.contiguous_format)


@torch.library.custom_op("nsa::combine_bwd", mutates_args=())
def combine_bwd(dout: Tensor, gates: Tensor, o_cmp: Tensor, cmp_lo: int, cmp_tail: Tensor, o_sel: Tensor,
                o_win: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from .triton.combine import Segments, combine_backward

    dg, da, ds, dw = combine_backward(dout, gates, Segments(o_cmp, cmp_lo, cmp_tail), o_sel, o_win)
    return dg, da.main, da.tail, ds, dw


@combine_bwd.register_fake
def _combine_bwd_fake(dout, gates, o_cmp, cmp_lo, cmp_tail, o_sel, o_win):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format)
                 for x in (gates, o_cmp, cmp_tail, o_sel, o_win))


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, dout):
    gates, o_cmp, o_sel, o_win = ctx.saved_tensors
    dg, da, _, ds, dw = combine_bwd(dout, gates, o_cmp, 0, o_cmp[:, :0], o_sel, o_win)
    return dg, da, ds, dw


combine_fwd.register_autograd(_combine_backward, setup_context=_combine_setup)


def gate_combine(gates, o_cmp, o_sel, o_win) -> Tensor:
    if not (o_cmp.shape == o_sel.shape == o_win.shape) or gates.shape != (*o_cmp.shape[:3], 3):
        raise ValueError(f"gate_combine: shapes gates {tuple(gates.shape)}, o_cmp {tuple(o_cmp.shape)}, "
                         f"o_sel {tuple(o_sel.shape)}, o_win {tuple(o_win.shape)} do not match")
    return torch.ops.nsa.combine_fwd(gates, o_cmp, o_sel, o_win)


# --- sliding window (the Triton window kernels: Hopper TMA copies) ---------------------------------------------


def aligned(*tensors: Tensor) -> list[Tensor]:
    """The tensors with a 16-byte aligned base, as TMA descriptors need (a copy of any that is not): a compiled
    graph decided on TMA before its buffers existed (nsa.kernels.triton.tma.supported)."""
    return [t.clone() if t.data_ptr() % 16 else t for t in tensors]


@torch.library.custom_op("nsa::window_fwd", mutates_args=())
def window_fwd(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> tuple[Tensor, Tensor]:
    from .triton.window import window_forward

    return window_forward(*aligned(q, k, v), window, scale)


@window_fwd.register_fake
def _window_fwd_fake(q, k, v, window, scale):
    B, T, Hq, _ = q.shape
    return q.new_empty(B, T, Hq, v.shape[-1]), q.new_empty(B, Hq, T, dtype=torch.float32)


@torch.library.custom_op("nsa::window_bwd", mutates_args=())
def window_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, window: int,
               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from .triton.window import window_backward

    return window_backward(*aligned(do, q, k, v, o), lse, window, scale)


@window_bwd.register_fake
def _window_bwd_fake(do, q, k, v, o, lse, window, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _window_setup(ctx, inputs, output):
    q, k, v, window, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.window, ctx.scale = window, scale


def _window_backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = window_bwd(do, q, k, v, o, lse, ctx.window, ctx.scale)
    return dq, dk, dv, None, None


window_fwd.register_autograd(_window_backward, setup_context=_window_setup)

# --- rotary embedding (one pass: cos/sin once per token and frequency, every head) --------------------------


@torch.library.custom_op("nsa::rope", mutates_args=())
def rope(x: Tensor, positions: Tensor, freqs: Tensor, inverse: bool) -> Tensor:
    from .triton.rope import rope_apply

    return rope_apply(x, positions, freqs, inverse)


@rope.register_fake
def _rope_fake(x, positions, freqs, inverse):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rope_setup(ctx, inputs, output):
    _, positions, freqs, inverse = inputs
    ctx.save_for_backward(positions, freqs)
    ctx.inverse = inverse


def _rope_backward(ctx, dy):
    positions, freqs = ctx.saved_tensors
    return rope(dy, positions, freqs, not ctx.inverse), None, None, None  # a rotation's transpose: minus the angle


rope.register_autograd(_rope_backward, setup_context=_rope_setup)

OPS = ("sel_fwd", "sel_bwd", "sel_combine_fwd", "topn", "combine_fwd", "combine_bwd", "window_fwd", "window_bwd",
       "rope")

__all__ = ["OPS", "combine_bwd", "combine_fwd", "gate_combine", "rope", "sel_bwd", "sel_combine_fwd", "sel_fwd",
           "selected_attention", "selected_attention_combined", "top_n", "topn", "window_bwd", "window_fwd"]
