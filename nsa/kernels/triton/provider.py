"""Whether NSA's Triton kernels can serve a call: availability (triton imports; CUDA tensors, or on CPU
only when forced under TRITON_INTERPRET=1, Triton's interpreter, for tests) and the guards of each
kernel. nsa.plan asks these; reason codes are in docs/backends.md.

    sel      selected attention (selection.py): disabled, sm_unsupported, ada_policy, dtype, head_dim,
             grad, cu_seqlens, below_min_len
    topn     fused score + top-n (topn.py): disabled, sm_unsupported, ada_policy, dtype, head_dim,
             config, cu_seqlens
    combine  gate combine (combine.py): dtype

Test hooks: `capability` (pretend sm), `allow_cpu` (skip the CUDA requirement).
"""

from __future__ import annotations

import os

import torch

from ..device import ADA, Failure, device_capability
from . import available

DEFAULT_MIN_L = 0  # NSA_SEL_TRITON_MIN_L default: the fused pipeline serves every length
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


class TritonProvider:
    def __init__(self, kind: str):
        if kind not in ("sel", "topn", "combine"):
            raise ValueError(f"unknown Triton kernel kind {kind!r}")
        self.kind = kind
        self.name = {"sel": "triton_sel", "topn": "triton_topn", "combine": "triton_combine"}[kind]
        self.capability = None
        self.allow_cpu = False

    def availability(self, device, forced: bool) -> tuple[bool, str]:
        ok, why = available()
        if not ok:
            return False, why
        if device.type == "cuda" or self.allow_cpu:
            return True, "ok"
        if forced and os.environ.get("TRITON_INTERPRET") == "1":
            return True, "Triton interpreter on CPU (TRITON_INTERPRET=1)"
        return False, f"the Triton {self.kind} kernel runs on CUDA tensors, got {device}" + (
            " (forcing it on CPU needs TRITON_INTERPRET=1)" if forced else "")

    def _device_policy(self, ctx, tg) -> Failure | None:
        cap = self.capability
        if cap is None and ctx.device.type == "cuda":
            cap = device_capability(ctx.device)
        if cap is None:
            return None
        if tuple(cap) < (8, 0):
            return Failure("sm_unsupported", f"sm {cap[0]}.{cap[1]}: the Triton {self.kind} kernel needs sm >= 8.0")
        if tuple(cap) == ADA and not tg.triton_sel_force:
            return Failure("ada_policy", f"Ada (sm 8.9): the Triton {self.kind} kernel is off by default; "
                           "NSA_TRITON_SEL_FORCE=1 overrides")
        return None

    def guard(self, ctx, tg, forced: bool, cfg=None) -> Failure | None:
        if ctx.dtype not in KERNEL_DTYPES:
            return Failure("dtype", f"the Triton {self.kind} kernel takes fp16/bf16/fp32, got {ctx.dtype}")
        if self.kind == "combine":
            return None
        if self.kind == "sel" and not tg.use_triton_sel:
            return Failure("disabled", "NSA_USE_TRITON_SEL=0")
        if self.kind == "topn" and not tg.use_triton_topn:
            return Failure("disabled", "NSA_USE_TRITON_TOPN=0")
        fail = self._device_policy(ctx, tg)
        if fail:
            return fail
        if max(ctx.Dk, ctx.Dv) > MAX_HEAD_DIM:
            return Failure("head_dim", f"head dim {max(ctx.Dk, ctx.Dv)} > {MAX_HEAD_DIM} (Dk={ctx.Dk}, Dv={ctx.Dv})")
        if ctx.packed and ctx.T >= 2**31:
            return Failure("cu_seqlens", f"{ctx.T} packed tokens do not fit the kernel's int32 positions")
        if self.kind == "topn":
            return self._topn_config(cfg)
        if ctx.needs_grad and not tg.sel_allow_grad:
            return Failure("grad", "gradients needed and NSA_SEL_TRITON_ALLOW_GRAD=0")
        if not forced:
            thr = tg.sel_min_len if tg.sel_min_len is not None else DEFAULT_MIN_L
            if ctx.max_len < thr:
                src = "NSA_SEL_TRITON_MIN_L" if tg.sel_min_len is not None else "default"
                return Failure("below_min_len", f"sel length {ctx.max_len} < {thr} ({src})")
        return None

    @staticmethod
    def _topn_config(cfg) -> Failure | None:
        if cfg is None:
            return None
        from .topn import unsupported

        why = unsupported(cfg)
        return Failure("config", why) if why else None
