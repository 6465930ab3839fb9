"""What every provider sees of one call (CallContext) and the FlashAttention-2 provider logic shared by
`flash_attn` and `torch_flash`: guards, dtype policy, head-dim padding, the compressed-branch folding
(nsa.backends.fold) and the sliding window. Subclasses only implement `_attn`, one kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import telemetry
from ..config import NSAConfig
from . import guards
from .fold import FoldPlan, fold_q, plan_dense, plan_varlen, unfold_lse, unfold_o
from .guards import Failure
from .toggles import Toggles


@dataclass
class CallContext:
    """The facts of one nsa_attention call that routing and the providers need (host values only)."""

    B: int
    T: int
    Hq: int
    Hkv: int
    Dk: int
    Dv: int
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool
    cu_seqlens: torch.Tensor | None = None  # packed input: int32 offsets on the device
    host_cu: list[int] | None = None  # and their host copy (read once by validation)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def max_len(self) -> int:
        """Longest sequence: T for dense input, max(cu[i+1] - cu[i]) for packed input."""
        if self.host_cu is None:
            return self.T
        return max((b - a for a, b in zip(self.host_cu, self.host_cu[1:])), default=0)


def last_dim_contiguous(x: torch.Tensor, branch: str, backend: str) -> torch.Tensor:
    """FA-2 kernels need stride 1 in the last dim (any other strides are fine). Copies are counted."""
    if x.stride(-1) == 1:
        return x
    telemetry.event(branch, backend, "contiguous_copy")
    return x.contiguous()


def pad_last(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


class Fa2Provider:
    """Shared FA-2 provider. Test hooks: `capability` (pretend sm), `allow_cpu` (skip the CUDA check),
    `kernel_dtypes` (dtypes passed to the kernel unchanged; fp64 in CPU tests with an emulated kernel)."""

    name = "fa2"

    def __init__(self):
        self.capability: tuple[int, int] | None = None
        self.allow_cpu = False
        self.kernel_dtypes = guards.FA2_DTYPES

    # --- availability and guards ------------------------------------------------------------------
    def availability(self, device: torch.device, forced: bool) -> tuple[bool, str]:
        raise NotImplementedError

    def _cap(self, device):
        return self.capability or guards.device_capability(device)

    def kernel_dtype(self, dtype: torch.dtype, toggles: Toggles):
        if dtype in self.kernel_dtypes:
            return dtype, None
        return guards.kernel_dtype(dtype, toggles)

    def guard(self, branch: str, ctx: CallContext, toggles: Toggles, forced: bool) -> Failure | None:
        if not toggles.fa2_enabled(branch):
            var = "NSA_USE_FA2" if not toggles.use_fa2 else f"NSA_USE_FA2_{branch.upper()}"
            return Failure("disabled", f"{var}=0")
        cap = self._cap(ctx.device) if ctx.device.type == "cuda" else self.capability
        if not self.allow_cpu:
            fail = guards.check_device(ctx.device, toggles, cap)
            if fail:
                return fail
        elif cap is not None and tuple(cap) == guards.ADA and not toggles.force:
            return Failure("ada_policy", "Ada (sm 8.9): FA-2 is off by default for NSA; NSA_FA2_FORCE=1 overrides")
        _, fail = self.kernel_dtype(ctx.dtype, toggles)
        if fail:
            return fail
        fail = guards.check_head_dim(ctx.Dk, ctx.Dv, cap, ctx.needs_grad, toggles)
        if fail:
            return fail
        if ctx.packed:
            fail = guards.check_cu_seqlens(ctx.cu_seqlens, ctx.host_cu, ctx.T, ctx.device)
            if fail:
                return fail
            if toggles.force_dense:
                return Failure("force_dense_packed", "NSA_FA2_FORCE_DENSE=1 but the input is packed (cu_seqlens)")
        if not forced:
            return guards.check_min_len(branch, ctx.max_len, guards.padded_head_dim(ctx.Dk, ctx.Dv), cap, toggles)
        return None

    # --- the kernel ---------------------------------------------------------------------------------
    def _attn(self, q, k, v, *, causal: bool, left: int, scale: float, varlen, need_lse: bool):
        """One FA-2 call. Dense q [B, Tq, H, D] or varlen q [total, H, D] with varlen = (cu_q, cu_k, max_q,
        max_k). causal: bottom-right causal; else left >= 0 is a window (w-1, 0). Returns (out, lse or None)
        with lse dense [B, H, Tq] / varlen [H, total_q]."""
        raise NotImplementedError

    def _prep(self, tensors, ctx, toggles, branch):
        kd, fail = self.kernel_dtype(ctx.dtype, toggles)
        if fail:  # guard() ran first; reaching this is a routing bug
            raise RuntimeError(f"{self.name}: {fail}")
        D = guards.padded_head_dim(ctx.Dk, ctx.Dv)
        return [last_dim_contiguous(pad_last(x.to(kd), D), branch, self.name) for x in tensors]

    # --- branches ---------------------------------------------------------------------------------------
    def cmp(self, q, k_cmp, v_cmp, layout, cfg: NSAConfig, scale: float, ctx: CallContext, toggles: Toggles):
        B, T, Hq, _ = q.shape
        Hkv, Dv = k_cmp.shape[2], v_cmp.shape[3]
        G = Hq // Hkv
        varlen = ctx.packed or toggles.force_varlen
        if varlen:
            host = ctx.host_cu if ctx.packed else [b * T for b in range(B + 1)]
            plan = plan_varlen(host, B * T, Hkv, G, cfg, q.device)
            q_in = q.reshape(1, B * T, Hq, q.shape[-1])
            k_in = k_cmp.reshape(1, -1, Hkv, k_cmp.shape[-1])[:, :plan.n_cmp]
            v_in = v_cmp.reshape(1, -1, Hkv, Dv)[:, :plan.n_cmp]
        else:
            plan = plan_dense(B, T, Hkv, G, cfg)
            q_in, k_in, v_in = q, k_cmp, v_cmp
        if plan.n_cmp == 0 or T == 0:  # no block anywhere: every row is empty
            return q.new_zeros(B, T, Hq, Dv), q.new_full((B, T, Hq), float("-inf"), dtype=torch.float32)
        qf, kf, vf = self._prep((fold_q(q_in, plan), k_in, v_in), ctx, toggles, "cmp")
        if varlen:
            kf, vf = kf[0], vf[0]
            o, lse = self._attn(qf, kf, vf, causal=True, left=-1, scale=scale,
                                varlen=(plan.cu_q, plan.cu_k, plan.max_q, plan.max_k), need_lse=True)
        else:
            o, lse = self._attn(qf, kf, vf, causal=True, left=-1, scale=scale, varlen=None, need_lse=True)
        o = unfold_o(o[..., :Dv], plan).to(q.dtype)
        lse = unfold_lse(lse, plan)
        if varlen and not ctx.packed:
            o, lse = o.reshape(B, T, Hq, Dv), lse.reshape(B, T, Hq)
        return o, lse

    def win(self, q, k, v, layout, cfg: NSAConfig, scale: float, ctx: CallContext, toggles: Toggles):
        B, T, Hq, _ = q.shape
        Hkv, Dv = k.shape[2], v.shape[3]
        if T == 0:
            return q.new_zeros(B, 0, Hq, Dv)
        varlen = ctx.packed or toggles.force_varlen
        max_len = ctx.max_len if ctx.packed else T
        left = cfg.window - 1
        causal = left >= max_len - 1  # the window covers every key: plain causal attention
        qf, kf, vf = self._prep((q, k, v), ctx, toggles, "win")
        if varlen:
            cu = ctx.cu_seqlens if ctx.packed else torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
            D = qf.shape[-1]
            o, _ = self._attn(qf.reshape(B * T, Hq, D), kf.reshape(B * T, Hkv, D), vf.reshape(B * T, Hkv, D),
                              causal=causal, left=-1 if causal else left, scale=scale,
                              varlen=(cu, cu, max_len, max_len), need_lse=False)
            o = o.reshape(B, T, Hq, -1)
        else:
            o, _ = self._attn(qf, kf, vf, causal=causal, left=-1 if causal else left, scale=scale, varlen=None,
                              need_lse=False)
        return o[..., :Dv].to(q.dtype)


__all__ = ["CallContext", "Fa2Provider", "FoldPlan", "last_dim_contiguous"]
