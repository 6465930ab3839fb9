"""Per-branch routing: which provider serves the compressed (cmp) and sliding (win) branches.

Order for backend="auto": flash_attn -> torch_flash -> sdpa -> torch (the vectorized PyTorch path). A
provider that is not available here (not installed, no GPU) is skipped silently: that is the
environment, reported by `python -m nsa.env`. A provider that is available but whose guard fails
(a toggle, dtype, head dim, cu_seqlens, min length) is a *fallback*: the branch is counted in
nsa.telemetry as (branch, served backend, reason of the first failed guard). A forced backend
(backend="flash_attn" | "torch_flash" | "sdpa") raises NSAInputError with the reason instead, and
skips only the min-length threshold (a speed hint, not a correctness guard).

The selection branch (sel) has its own choice, `sel_backend` (argument of route(), else the toggle
NSA_SEL_BACKEND, default "auto"): "auto" runs the Triton selection kernel (nsa.kernels.triton) when it
is available here (triton imports, CUDA tensors) and its guards pass, recorded ("sel", "triton", "ok"),
else torch with the reason of the failed guard; "torch" keeps sel on torch; "triton_sel" forces the
kernel (NSAInputError when impossible; on CPU only under TRITON_INTERPRET=1). backend="torch" and
"reference" never reach the router, so everything stays on torch / the oracle there.
"""

from __future__ import annotations

import time

import torch

from .. import telemetry
from ..kernels.triton import TritonSelProvider
from ..ops.forward import BranchProviders
from ..validation import NSAInputError
from . import toggles as _toggles
from .base import CallContext
from .flash_attn_provider import FlashAttnProvider
from .sdpa import SdpaProvider
from .torch_flash import TorchFlashProvider

ORDER = ("flash_attn", "torch_flash", "sdpa")
PROVIDERS = {"flash_attn": FlashAttnProvider(), "torch_flash": TorchFlashProvider(), "sdpa": SdpaProvider()}
FAST_BRANCHES = ("cmp", "win")
SEL_PROVIDER = TritonSelProvider()
SEL_BACKENDS = _toggles.SEL_BACKENDS


def choose_sel(sel_backend: str, ctx: CallContext, tg) -> tuple[str, str, str]:
    """("triton" or "torch", telemetry reason, detail) for the selection branch. Raises when forced and impossible."""
    if sel_backend not in SEL_BACKENDS:
        raise NSAInputError(f"sel_backend must be one of {SEL_BACKENDS}, got {sel_backend!r}")
    if sel_backend == "torch":
        return "torch", "forced", ""
    forced = sel_backend == "triton_sel"
    ok, why = SEL_PROVIDER.availability(ctx.device, forced=forced)
    if not ok:
        if forced:
            raise NSAInputError(f"sel_backend='triton_sel' is not available here: {why}")
        return "torch", "ok", ""  # not available in this environment: not a fallback (python -m nsa.env)
    fail = SEL_PROVIDER.guard(ctx, tg, forced=forced)
    if fail:
        if forced:
            raise NSAInputError(f"sel_backend='triton_sel' cannot serve the sel branch: {fail}")
        return "torch", fail.reason, str(fail)
    return "triton", "forced" if forced else "ok", ""


def choose(branch: str, backend: str, ctx: CallContext, tg) -> tuple[str, str, str]:
    """(provider name or "torch", telemetry reason, detail) for one branch. Raises when forced and impossible."""
    if backend in PROVIDERS:
        prov = PROVIDERS[backend]
        ok, why = prov.availability(ctx.device, forced=True)
        if not ok:
            raise NSAInputError(f"backend={backend!r} is not available here: {why}")
        fail = prov.guard(branch, ctx, tg, forced=True)
        if fail:
            raise NSAInputError(f"backend={backend!r} cannot serve the {branch} branch: {fail}")
        return backend, "forced", ""
    first_fail = None
    for name in ORDER:
        prov = PROVIDERS[name]
        ok, _ = prov.availability(ctx.device, forced=False)
        if not ok:
            continue
        fail = prov.guard(branch, ctx, tg, forced=False)
        if fail is None:
            return name, (first_fail.reason if first_fail else "ok"), (str(first_fail) if first_fail else "")
        if first_fail is None:
            first_fail = fail
    return "torch", (first_fail.reason if first_fail else "ok"), (str(first_fail) if first_fail else "")


def _bound(prov, branch: str, ctx: CallContext, tg):
    fn = getattr(prov, branch)
    if not tg.debug_timing:
        return lambda q, k, v, layout, cfg, scale: fn(q, k, v, layout, cfg, scale, ctx, tg)

    def timed(q, k, v, layout, cfg, scale):
        sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        res = fn(q, k, v, layout, cfg, scale, ctx, tg)
        sync()
        telemetry.add_time(f"{branch}.{prov.name}", (time.perf_counter() - t0) * 1e3)
        return res

    return timed


def route(backend: str, q, k, v, *, kv_cmp=None, kv_win=None, cu_seqlens=None, host_cu=None,
          sel_backend: str | None = None) -> BranchProviders:
    """Decide cmp, win and sel for one call; returns the hooks for nsa_forward_torch."""
    tg = _toggles.read()
    B, T, Hq, Dk = q.shape
    tensors = [q, k, v] + list(kv_cmp or ()) + list(kv_win or ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    hooks = {}
    for branch in FAST_BRANCHES:
        kb, vb = (kv_cmp if branch == "cmp" else kv_win) or (k, v)
        ctx = CallContext(B, T, Hq, kb.shape[2], Dk, vb.shape[3], q.dtype, q.device, needs_grad,
                          cu_seqlens=cu_seqlens, host_cu=host_cu)
        name, reason, detail = choose(branch, backend, ctx, tg)
        telemetry.record(branch, name, reason, detail=detail) if detail else telemetry.record(branch, name, reason)
        hooks[branch] = None if name == "torch" or T == 0 else _bound(PROVIDERS[name], branch, ctx, tg)
    sel_needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    ctx = CallContext(B, T, Hq, k.shape[2], Dk, v.shape[3], q.dtype, q.device, sel_needs_grad,
                      cu_seqlens=cu_seqlens, host_cu=host_cu)
    name, reason, detail = choose_sel(sel_backend or tg.sel_backend, ctx, tg)
    telemetry.record("sel", name, reason, detail=detail) if detail else telemetry.record("sel", name, reason)
    sel_hook = None
    if name == "triton" and T > 0:
        sel_hook = SEL_PROVIDER.sel
        if tg.debug_timing:
            def sel_hook(q, k, v, indices, layout, cfg, scale):
                sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
                sync()
                t0 = time.perf_counter()
                res = SEL_PROVIDER.sel(q, k, v, indices, layout, cfg, scale)
                sync()
                telemetry.add_time("sel.triton_sel", (time.perf_counter() - t0) * 1e3)
                return res
    return BranchProviders(cmp=hooks["cmp"], win=hooks["win"], sel=sel_hook)
