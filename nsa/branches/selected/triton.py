"""Selected branch on NSA's Triton kernels, with the branch signatures (nsa.branches):

    indices = top_n(q, k_cmp, lse, layout, cfg, scale)                 fused score + top-n
    o_sel = selected_attention(q, k, v, indices, layout, cfg, scale)     forward + backward (autograd)

Importing this module imports triton; nsa.plan reaches it only after the provider says triton runs here.
"""

from __future__ import annotations

from ...kernels.triton.selection import selected_attention_triton
from ...kernels.triton.topn import topn_triton


def top_n(q, k_cmp, lse, layout, cfg, scale):
    return topn_triton(q.detach(), k_cmp.detach(), lse.detach(), layout.seq_start, layout.cmp_slot0, cfg, scale)


def selected_attention(q, k, v, indices, layout, cfg, scale):
    return selected_attention_triton(q, k, v, indices, layout.seq_start, cfg, scale)
