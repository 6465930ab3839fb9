"""Selected branch on NSA's Triton kernels, with the branch signatures (nsa.branches):

    indices = top_n(q, k_cmp, lse, layout, cfg, scale)                 fused score + top-n
    o_sel = selected_attention(q, k, v, indices, layout, cfg, scale)     forward + backward (autograd)

and the two halves the dense core (nsa.run.dense_core) calls inside its own autograd node:

    out, o_sel, lse_sel = forward(q, k, v, indices, seq_start, block_sel, scale, combine=...)
    dq, dk, dv = backward(do, q, k, v, o_sel, lse_sel, indices, seq_start, block_sel, scale, ...)

The kernel modules (and so triton) are imported on first call: planning refers to these functions
without importing triton. Under torch.compile top_n and selected_attention call the custom operators of
nsa.kernels.ops (traced as graph nodes); in eager mode the launchers, directly.
"""

from __future__ import annotations

from ...compiling import compiling
from ...kernels import ops


def top_n(q, k_cmp, lse, layout, cfg, scale):
    if compiling():
        return ops.top_n(q, k_cmp, lse, layout.seq_start, layout.cmp_slot0, cfg, scale)
    from ...kernels.triton.topn import topn_triton

    return topn_triton(q.detach(), k_cmp.detach(), lse.detach(), layout.seq_start, layout.cmp_slot0, cfg, scale)


def selected_attention(q, k, v, indices, layout, cfg, scale):
    if compiling():
        return ops.selected_attention(q, k, v, indices, layout.seq_start, cfg.block_sel, scale)
    from ...kernels.triton.selection import selected_attention_triton

    return selected_attention_triton(q, k, v, indices, layout.seq_start, cfg, scale)


def forward(q, k, v, indices, seq_start, block_sel: int, scale: float, combine=None):
    """The selection forward on int32 indices and seq_start; with combine=(gates, o_cmp Segments, o_win)
    the gate combine runs in its epilogue: (out, o_sel, lse_sel)."""
    from ...kernels.triton.selection import sel_forward

    return sel_forward(q, k, v, indices, seq_start, block_sel, scale, combine=combine)


def backward(do, q, k, v, o, lse, indices, seq_start, block_sel: int, scale: float, dq_into=None, dq_more=None):
    """(dq, dk, dv) of `forward`; dq_into / dq_more add the selection's dq into a buffer (module doc of
    nsa.kernels.triton.selection)."""
    from ...kernels.triton.selection import sel_backward

    return sel_backward(do, q, k, v, o, lse, indices, seq_start, block_sel, scale, dq_into=dq_into, dq_more=dq_more)


__all__ = ["backward", "forward", "selected_attention", "top_n"]
