"""Running one planned decode step (nsa.plan.plan_decode): the branch implementation the plan chose, then
the cache's host-side commit."""

from __future__ import annotations

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


__all__ = ["run_decode"]
