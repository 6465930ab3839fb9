"""Selected branch on NSA's Triton kernels, with the branch signatures (nsa.branches):

    indices = top_n(q, k_cmp, lse, layout, cfg, scale)                 fused score + top-n
    o_sel = selected_attention(q, k, v, indices, layout, cfg, scale)     forward + backward (autograd)
    out = selected_attention_combined(q, k, v, indices, layout, cfg, scale, gates, o_cmp, o_win)
                                                                       the same, gate combine in the epilogue

and the two halves the dense core (nsa.run.dense_core) calls inside its own autograd node:

    out, o_sel, lse_sel = forward(q, k, v, indices, seq_start, block_sel, scale, combine=...)
    dq, dk, dv = backward(do, q, k, v, o_sel, lse_sel, indices, seq_start, block_sel, scale, ...)

Both take q_offset (queries at a stream offset, context parallelism: nsa.run.offset_core), as does
top_n_at, the top-n kernel's entry for such queries.

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


def selected_attention_combined(q, k, v, indices, layout, cfg, scale, gates, o_cmp, o_win, cmp_lo=0, cmp_tail=None):
    """The gate combine's out = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win with o_sel from the selection kernel,
    whose epilogue applies the gates (one custom operator: the graph torch.compile traces gets the dense core's
    forward fusion; its backward is the combine's, then the selection's). o_cmp whole, or with cmp_tail as two
    token segments (nsa.kernels.ops)."""
    return ops.selected_attention_combined(q, k, v, indices, layout.seq_start, cfg.block_sel, scale, gates,
                                           o_cmp, o_win, cmp_lo, cmp_tail)


def top_n_at(q, k_cmp, lse, seq_start, cmp_slot0, cfg, scale, q_offset: int):
    """top_n for queries at the stream positions [q_offset, q_offset + T) (seq_start, cmp_slot0 [B, T] of
    those queries; k_cmp: the compressed blocks of the stream from position 0 on)."""
    from ...kernels.triton.topn import topn_triton

    return topn_triton(q.detach(), k_cmp.detach(), lse.detach(), seq_start, cmp_slot0, cfg, scale,
                       q_offset=q_offset)


def forward(q, k, v, indices, seq_start, block_sel: int, scale: float, combine=None, q_offset: int = 0):
    """The selection forward on int32 indices and seq_start; with combine=(gates, o_cmp Segments, o_win)
    the gate combine runs in its epilogue: (out, o_sel, lse_sel). q_offset: q's rows are the stream
    positions [q_offset, q_offset + T) of k, v's rows."""
    from ...kernels.triton.selection import sel_forward

    return sel_forward(q, k, v, indices, seq_start, block_sel, scale, combine=combine, q_offset=q_offset)


def backward(do, q, k, v, o, lse, indices, seq_start, block_sel: int, scale: float, dq_into=None, dq_more=None,
             q_offset: int = 0, kv_seq_start=None):
    """(dq, dk, dv) of `forward`; dq_into / dq_more add the selection's dq into a buffer (module doc of
    nsa.kernels.triton.selection); q_offset with kv_seq_start [B, Tk] (the keys' sequence starts) for
    queries at a stream offset."""
    from ...kernels.triton.selection import sel_backward

    return sel_backward(do, q, k, v, o, lse, indices, seq_start, block_sel, scale, dq_into=dq_into, dq_more=dq_more,
                        q_offset=q_offset, kv_seq_start=kv_seq_start)


__all__ = ["backward", "forward", "selected_attention", "top_n", "top_n_at"]
