"""Compressed branch on NSA's Triton kernels (nsa.kernels.triton.cmp_attn: Hopper TMA copies; on short
sequences faster than cuDNN's fold of the branch), forward and backward from the saved o and LSE.

    supported(q, k_cmp, v_cmp) -> (ok, why not)              the kernels serve these tensors
    o, lse = forward(q, k_cmp, v_cmp, cfg, scale)            o [B, T, Hq, Dv], lse [B, T, Hq] fp32 (-inf: no block)
    dq, dk_cmp, dv_cmp = backward(do, q, k_cmp, v_cmp, o, lse, cfg, scale)

Dense input only (no packed sequences); only the dense core runs it (nsa.run.dense_core: planning's
"triton_cmp", nsa.plan.rules.cmp_triton_guard), so under torch.compile, which runs the steps separately,
the branch keeps its FA-2 / cuDNN provider. The kernel module (and so triton) is imported on first call.
"""

from __future__ import annotations


def supported(q, k_cmp, v_cmp) -> tuple[bool, str]:
    from ...kernels.triton.cmp_attn import supported as fn

    return fn(q, k_cmp, v_cmp)


def forward(q, k_cmp, v_cmp, cfg, scale):
    from ...kernels.triton.cmp_attn import cmp_forward

    return cmp_forward(q, k_cmp, v_cmp, cfg.block_cmp, cfg.stride_cmp, scale)


def backward(do, q, k_cmp, v_cmp, o, lse, cfg, scale):
    from ...kernels.triton.cmp_attn import cmp_backward

    return cmp_backward(do, q, k_cmp, v_cmp, o, lse, cfg.block_cmp, cfg.stride_cmp, scale)


__all__ = ["backward", "forward", "supported"]
