"""Running one planned decode step (nsa.plan.plan_decode): the branch implementation the plan chose, then
the cache's host-side commit; and k of them in a row, the append nsa.plan.plan_append routes to the decode
kernels (`run_decode_steps`)."""

from __future__ import annotations

import torch

from ..branches.decode import naive as decode_naive
from ..branches.decode import triton as decode_triton


def run_decode(plan, q, gates, cache, tokens, compress_fn, *, out=None, want_indices=False):
    """(out [B, 1, Hq, Dv], indices int32 [B, 1, Hkv, n] or None) of the step; the cache holds the token."""
    if plan.backend == "triton":
        res, indices = decode_triton.decode_step(q, gates, cache, tokens, compress_fn, out=out,
                                                 want_indices=want_indices)
        cache.commit_step(on_device=False)  # the last kernel published the new lengths
        return res, indices
    res, indices = decode_naive.decode_step(q, gates, cache, tokens, compress_fn)
    if out is not None:
        out.copy_(res)
        res = out
    cache.commit_step()
    return res, indices


def run_decode_steps(plan, q, gates, cache, tokens, compress_fn):
    """k decode steps: step j appends token j of every row (q, gates [B, k, ...]; tokens the validated
    (k, v, kc, vc, kw, vw) [B, k, ...]) and writes its output into row j of out [B, k, Hq, Dv]. A token's
    decode output is its row in a prefill of the whole sequence, so this is the append's output."""
    B, T, Hq, _ = q.shape
    out = torch.empty(B, T, Hq, cache.d_v, dtype=q.dtype, device=q.device)
    for j in range(T):
        one = slice(j, j + 1)
        run_decode(plan, q[:, one], gates[:, one], cache, tuple(x[:, one] for x in tokens), compress_fn,
                   out=out[:, one])
    return out


__all__ = ["run_decode", "run_decode_steps"]
