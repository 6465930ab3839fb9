"""A decode step on NSA's Triton decode kernels (nsa.kernels.triton.decode), with the decode signature
(nsa.branches.decode). The kernel module (and so triton) is imported on first call."""

from __future__ import annotations


def decode_step(q, gates, cache, tokens, compress_fn=None, *, out=None, want_indices=False):
    """Append the tokens and attend: (out [B, 1, Hq, Dv], indices or None). The last kernel publishes the
    new lengths on the device; the caller commits the step on the host (cache.commit_step(on_device=False))."""
    from ...kernels.triton.decode import decode_step_triton

    return decode_step_triton(q, gates, cache, tokens, compress_fn, out=out, want_indices=want_indices)


__all__ = ["decode_step"]
