"""Running a Plan (nsa.plan): the fused GPU pipeline (fused.py, and its one-autograd-node
form, dense_core.py), the chunked torch path (chunked.py) and the decode step (decode_step.py). Every step
is a branch function (nsa.branches) that planning bound into the Plan; nothing here decides.

Fused (every step has a whole-T implementation): compress K/V (phi) -> compressed attention and its
LSE -> fused score + top-n -> selected attention -> sliding window -> gate combine. A fixed sequence
of kernels over the whole T: no Python loop over queries, no host synchronisation for dense input,
nothing of size [T, N_cmp] or [T, N_sel] in memory.

Chunked (the torch backend, CPU, and any call where a step has no fast implementation): queries are
processed a chunk at a time (chunked.py says how), with whatever whole-T implementations exist as hooks.
"""

from __future__ import annotations

import torch

from .. import telemetry
from ..config import NSAConfig
from ..layout import SeqLayout
from .chunked import run_chunked
from .fused import run_fused


def run(plan, q, k, v, gates, cfg: NSAConfig, layout: SeqLayout, *, kv_cmp=None, kv_win=None,
        compress_fn=None, block_indices=None, need_indices=False, chunk=None):
    """Out [B, T, Hq, Dv] in q's dtype, and the int32 block indices when need_indices (else None)."""
    B, T, Hq, _ = q.shape
    if T == 0:
        return q.new_zeros(B, 0, Hq, v.shape[3]), q.new_zeros(B, 0, k.shape[2], cfg.n_sel, dtype=torch.int32)
    runner = run_fused if plan.executor == "fused" else run_chunked
    if not telemetry.timing_on():
        return runner(plan, q, k, v, gates, cfg, layout, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn,
                      block_indices=block_indices, need_indices=need_indices, chunk=chunk)
    # NSA_DEBUG_TIMING=1: one log line per call (path, shapes, dtypes, total and per-branch times)
    before = telemetry.times_now()
    with telemetry.stopwatch(q) as sw:
        res = runner(plan, q, k, v, gates, cfg, layout, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn,
                     block_indices=block_indices, need_indices=need_indices, chunk=chunk)
    telemetry.log_call(plan.executor, plan.steps, {"q": q, "k": k, "v": v, "gates": gates}, sw.ms, before)
    return res


__all__ = ["run", "run_chunked", "run_fused"]
