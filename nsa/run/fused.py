"""The fused executor: every step on its whole-T implementation, a fixed sequence of GPU operations (no
Python loop over queries, no host synchronisation for dense input). The backward is each operation's own
(FA-2 for cmp and win, the Triton selection backward, the compression's and the combine's); where the plan's
core step is "dense_core" (cmp and win on FA-2-family providers, the rest on Triton, dense or packed input)
the steps run as one autograd node instead (nsa.run.dense_core)."""

from __future__ import annotations

import torch

from .. import telemetry
from ..branches.combine.naive import combine_torch
from ..branches.compressed.fa2 import compressed_view, view_fold_applies
from ..branches.selected import triton as selected_triton
from ..branches.selected.naive import dedupe_indices
from ..compiling import compiling
from ..compress import compress_kv
from . import dense_core
from .common import branch_kv


def run_fused(plan, q, k, v, gates, cfg, layout, *, kv_cmp=None, kv_win=None, compress_fn=None,
              block_indices=None, need_indices=False, chunk=None):
    scale = cfg.softmax_scale(q.shape[-1])
    kc, vc, kw, vw = branch_kv(k, v, kv_cmp, kv_win)
    window = dense_core.start_window(plan, q, kw, vw, layout, cfg, scale) if plan.dense_core else None
    k_cmp, v_cmp = compress_kv(kc, vc, layout, cfg, compress_fn)
    given = dedupe_indices(block_indices).to(torch.int32) if block_indices is not None else None
    if plan.dense_core:
        telemetry.event("pipeline", "fused", "dense_core")
        out, indices = dense_core.run(plan, q, k, v, gates, cfg, layout, k_cmp, v_cmp, kw, vw, scale, given,
                                      window)
        return out, (indices if need_indices else None)
    combined = compiling() and plan.sel.provider == plan.combine.provider == "triton"
    if combined and plan.cmp.impl is not None and view_fold_applies(plan.cmp.impl[1], q, v_cmp, cfg):
        # The dense core's fold by view, traced: no copy of q into folded rows, of the output out of them or of
        # their gradients (eager mode's dense core does the same inside its one node); the combining operators
        # take o_cmp as the rows' and the tail's segments and give their gradients back so.
        telemetry.event("cmp", plan.cmp.provider, "fold_view")
        segments, lse = compressed_view(plan.cmp.impl[0], q, k_cmp, v_cmp, cfg, scale)
    else:
        o_cmp, lse = plan.cmp.fn(q, k_cmp, v_cmp, layout, cfg, scale)
        segments = (o_cmp, 0, None)
    indices = given if given is not None else plan.topn.fn(q, k_cmp, lse, layout, cfg, scale)
    o_win = plan.win.fn(q, kw, vw, layout, cfg, scale)
    if combined:
        # Under torch.compile (where the dense core does not run) the gate combine still runs in the selection
        # kernel's epilogue, as the dense core runs it: one operator, no separate combine pass over o_sel.
        telemetry.event("pipeline", "fused", "sel_combine")
        out = selected_triton.selected_attention_combined(q, k, v, indices, layout, cfg, scale, gates, segments[0],
                                                          o_win, segments[1], segments[2])
    else:
        o_sel = plan.sel.fn(q, k, v, indices, layout, cfg, scale)
        out = (plan.combine.fn or combine_torch)(gates, o_cmp, o_sel, o_win)
    return out, (indices if need_indices else None)


__all__ = ["run_fused"]
