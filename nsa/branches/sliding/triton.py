"""Sliding branch on NSA's Triton window kernels (nsa.kernels.triton.window: Hopper TMA copies, faster
than FA-2's on a band of w keys), forward and backward from the saved o and LSE.

    supported(q, k, v) -> (ok, why not)                    the kernels serve these tensors
    o, lse = forward(q, k, v, cfg, scale)                  o [B, T, Hq, D], lse [B, Hq, T] fp32
    dq, dk, dv = backward(do, q, k, v, o, lse, cfg, scale)

Dense input only (no packed sequences); the dense core runs it (nsa.run.dense_core), and under torch.compile
the separate executor (window_step). The kernel module
(and so triton) is imported on first call. Under torch.compile forward and backward run as the custom
operators nsa::window_fwd / nsa::window_bwd (nsa.kernels.ops).
"""

from __future__ import annotations

from ...compiling import compiling
from ...kernels import ops


def supported(q, k, v) -> tuple[bool, str]:
    from ...kernels.triton.window import supported as fn

    return fn(q, k, v)


def forward(q, k, v, cfg, scale):
    if compiling():
        return ops.window_fwd(q, k, v, cfg.window, float(scale))
    from ...kernels.triton.window import window_forward

    return window_forward(q, k, v, cfg.window, scale)


def backward(do, q, k, v, o, lse, cfg, scale):
    if compiling():
        return ops.window_bwd(do, q, k, v, o, lse, cfg.window, float(scale))
    from ...kernels.triton.window import window_backward

    return window_backward(do, q, k, v, o, lse, cfg.window, scale)


def window_step(q, k, v, layout, cfg, scale):
    """The sliding branch as a step of the separate executor (the plan's win step "triton_window" outside the
    dense core, under torch.compile): the forward operator, whose registered backward is the Triton one."""
    return ops.window_fwd(q, k, v, cfg.window, float(scale))[0]


__all__ = ["backward", "forward", "supported", "window_step"]
