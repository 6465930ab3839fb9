"""Triton kernels of NSA. `selection`: the selected-attention branch (forward + backward, autograd).

Importing this package does not import triton; `available()` says whether the kernels can run here.
    from nsa.kernels.triton import selected_attention_triton   # imports triton on first use
"""

from __future__ import annotations


def available() -> tuple[bool, str]:
    """(the Triton selection kernel imports, why not)."""
    try:
        from . import selection  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available", with the reason
        return False, f"nsa.kernels.triton.selection does not import: {type(e).__name__}: {e}"
    return True, "ok"


def selected_attention_triton(*args, **kwargs):
    from .selection import selected_attention_triton as fn

    return fn(*args, **kwargs)


__all__ = ["available", "selected_attention_triton"]


# --- routing: the provider the router asks (availability, guards, the branch hook) ----------------------

DEFAULT_MIN_L = 1024  # NSA_SEL_TRITON_MIN_L default until a GPU sweep measures the break-even
KERNEL_DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256


class TritonSelProvider:
    """The `triton_sel` provider of the selection branch (nsa.backends.router asks it).

    availability(): the kernel imports, and the tensors are on CUDA (or, forced only, on CPU under
    TRITON_INTERPRET=1: Triton's interpreter, for tests). guard(): reason codes disabled, sm_unsupported,
    ada_policy, dtype, head_dim, grad, cu_seqlens, below_min_len (docs/backends.md).
    Test hooks: `capability` (pretend sm), `allow_cpu` (skip the CUDA requirement).
    """

    name = "triton_sel"

    def __init__(self):
        self.capability = None
        self.allow_cpu = False

    def availability(self, device, forced: bool) -> tuple[bool, str]:
        import os

        ok, why = available()
        if not ok:
            return False, why
        if device.type == "cuda" or self.allow_cpu:
            return True, "ok"
        if forced and os.environ.get("TRITON_INTERPRET") == "1":
            return True, "Triton interpreter on CPU (TRITON_INTERPRET=1)"
        return False, f"the Triton selection kernel runs on CUDA tensors, got {device}" + (
            " (forcing it on CPU needs TRITON_INTERPRET=1)" if forced else "")

    def guard(self, ctx, tg, forced: bool):
        import torch

        from ...backends import guards
        from ...backends.guards import Failure

        if not tg.use_triton_sel:
            return Failure("disabled", "NSA_USE_TRITON_SEL=0")
        cap = self.capability
        if cap is None and ctx.device.type == "cuda":
            cap = guards.device_capability(ctx.device)
        if cap is not None:
            if tuple(cap) < (8, 0):
                return Failure("sm_unsupported", f"sm {cap[0]}.{cap[1]}: the Triton selection kernel needs sm >= 8.0")
            if tuple(cap) == guards.ADA and not tg.triton_sel_force:
                return Failure("ada_policy", "Ada (sm 8.9): the Triton selection kernel is off by default; "
                               "NSA_TRITON_SEL_FORCE=1 overrides")
        if ctx.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return Failure("dtype", f"the Triton selection kernel takes fp16/bf16/fp32, got {ctx.dtype}")
        if max(ctx.Dk, ctx.Dv) > MAX_HEAD_DIM:
            return Failure("head_dim", f"head dim {max(ctx.Dk, ctx.Dv)} > {MAX_HEAD_DIM} (Dk={ctx.Dk}, Dv={ctx.Dv})")
        if ctx.needs_grad and not tg.sel_allow_grad:
            return Failure("grad", "gradients needed and NSA_SEL_TRITON_ALLOW_GRAD=0")
        if ctx.packed and ctx.T >= 2**31:
            return Failure("cu_seqlens", f"{ctx.T} packed tokens do not fit the kernel's int32 positions")
        if not forced:
            thr = tg.sel_min_len if tg.sel_min_len is not None else DEFAULT_MIN_L
            if ctx.max_len < thr:
                src = "NSA_SEL_TRITON_MIN_L" if tg.sel_min_len is not None else "default"
                return Failure("below_min_len", f"sel length {ctx.max_len} < {thr} ({src})")
        return None

    def sel(self, q, k, v, indices, layout, cfg, scale):
        """Hook for nsa_forward_torch: o_sel [B, T, Hq, Dv] in q's dtype over the whole T."""
        from .selection import selected_attention_triton as fn

        k = k if k.dtype == q.dtype else k.to(q.dtype)
        v = v if v.dtype == q.dtype else v.to(q.dtype)
        return fn(q, k, v, indices, layout.seq_start, cfg, scale)


__all__ += ["TritonSelProvider", "DEFAULT_MIN_L"]
