"""Triton kernels of NSA: selected attention (selection.py: forward, backward, autograd), the fused
score + top-n (topn.py), the gate combine (combine.py), the sliding window (window.py) and the decode
step (decode.py), with the helpers they share (common.py, tma.py). Mechanism only: when each may serve a
call is planning's (nsa.plan.providers, nsa.plan.rules).

Importing this package does not import triton; `available()` says whether the kernels can run here.
    from nsa.kernels.triton import selected_attention_triton   # imports triton on first use
"""

from __future__ import annotations


def available() -> tuple[bool, str]:
    """(the Triton kernels import, why not)."""
    try:
        from . import selection  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available", with the reason
        return False, f"nsa.kernels.triton.selection does not import: {type(e).__name__}: {e}"
    return True, "ok"


def selected_attention_triton(*args, **kwargs):
    from .selection import selected_attention_triton as fn

    return fn(*args, **kwargs)


__all__ = ["available", "selected_attention_triton"]
