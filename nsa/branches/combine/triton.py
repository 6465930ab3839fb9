"""Gate combine on NSA's Triton kernels (nsa.kernels.triton.combine), with the combine signature, and the
segmented form the dense core uses (o_cmp as rows by view plus a short tail: `Segments`).

    out = gate_combine(gates, o_cmp, o_sel, o_win)                         forward + backward (autograd)
    segments(main, lo, tail)                                               o_cmp in two token ranges
    dg, d_cmp, d_sel, d_win = backward(dout, gates, o_cmp_segments, o_sel, o_win)

The kernel module (and so triton) is imported on first call: planning refers to these functions without
importing triton. Under torch.compile gate_combine calls the custom operator nsa::combine_fwd
(nsa.kernels.ops); in eager mode the launcher, directly.
"""

from __future__ import annotations

from ...compiling import compiling
from ...kernels import ops


def gate_combine(gates, o_cmp, o_sel, o_win):
    if compiling():
        return ops.gate_combine(gates, o_cmp, o_sel, o_win)
    from ...kernels.triton.combine import gate_combine as fn

    return fn(gates, o_cmp, o_sel, o_win)


def segments(main, lo: int, tail):
    """o_cmp whose rows are tokens [lo, lo + len(main)) and then `tail`; other tokens are 0."""
    from ...kernels.triton.combine import Segments

    return Segments(main, lo, tail)


def backward(dout, gates, o_cmp, o_sel, o_win):
    """(dgates, do_cmp as Segments, do_sel, do_win) of the combine, o_cmp given as Segments."""
    from ...kernels.triton.combine import combine_backward

    return combine_backward(dout, gates, o_cmp, o_sel, o_win)


__all__ = ["backward", "gate_combine", "segments"]
