"""Planning: which implementation serves each step of one nsa_attention call or one decode step, decided
once per call (`make_plan`, `plan_decode`). The rules are data in nsa.plan.rules; the providers and their
availability in nsa.plan.providers.

Steps: cmp (compressed attention + its LSE), topn (the selection blocks), sel (selected attention), win
(sliding window) and, in the fused executor, combine (the gated sum). `make_plan` reads the toggles
(nsa.toggles) once, asks every candidate provider for availability and guards, records each decision
in nsa.telemetry as (step, provider, reason), and returns a Plan whose steps carry callables with the
branch signatures of nsa.branches (provider context already bound).

cmp and win, backend="auto": flash_attn -> torch_flash -> sdpa -> torch, and before them, for the compressed
branch of dense fp16/bf16 input on sm 9.0 with head dims <= 128 (256 from cuDNN 9.19), torch_cudnn (cuDNN
attention, faster there; nsa.kernels.fa2.torch_cudnn says why it is tried nowhere else; NSA_USE_CUDNN=0
skips it). A provider that is not available here (not installed, no GPU) is skipped silently: that is the
environment, reported by `python -m nsa.env`. One that is available but whose guard fails is a fallback:
counted with the reason of the first failed guard. backend="flash_attn" | "torch_flash" | "sdpa" forces
that provider for cmp and win (NSAInputError with the reason when it cannot run; forcing skips only the
min-length threshold).
sel follows `sel_backend` (argument, else NSA_SEL_BACKEND, default "auto"): auto runs the Triton kernel
when available and its guards pass, "torch" keeps it on torch, "triton_sel" forces it. topn runs on its
Triton kernel when available and its guards pass (NSA_USE_TRITON_TOPN=0 or sel_backend="torch" keep
it on torch); it needs the whole-T LSE of a fast cmp provider, so with cmp on torch it runs in the
chunked loop.

Executors: "fused" when cmp, sel and win all have whole-T implementations and the blocks come from the
top-n kernel (or are given): a fixed sequence of GPU operations, no Python loop over queries
(nsa.run.fused). A fused plan has one more step, core: provider "dense_core" where the steps run as one
autograd node (nsa.run.dense_core: cmp and win on FA-2-family providers and the rest on Triton, dense and
packed input, rules.dense_core_guard), else "separate" with the reason it does not apply (never a fallback:
the same steps run as separate operations). In the dense core of backend="auto" the win step's provider is
"triton_window" where NSA's Triton window kernels serve the sliding branch (dense input only;
rules.window_triton_guard; elsewhere, and with a forced backend, its FA-2 provider serves it); the core step
holds that FA-2 provider for the compressed branch's tail tokens. Otherwise "chunked": the
torch path over query chunks, with whatever whole-T implementations exist as hooks (nsa.run.chunked).
backend="torch" is always chunked; backend="reference" is the fp64 oracle.

Decode (`plan_decode`, backend= "auto" | "torch" | "triton"): a forced backend that cannot run raises
NSAInputError with the reason; "auto" takes the Triton decode kernels on CUDA when their guards pass, else
torch, and the decision is counted in nsa.telemetry for cmp, sel and win: reason "ok" / "forced" when the
chosen path ran as asked, "decode" when torch ran because the kernels are not available here (CPU, no
triton: the environment, not a fallback), or the failed guard's reason (a fallback). Guards: disabled
(NSA_USE_TRITON_DECODE=0), sm_unsupported (< 8.0), dtype (fp16/bf16/fp32), head_dim (> 256), group_size
(Hq/Hkv > 64), grad (inputs that need gradients: the kernels have no backward).

Appends (`plan_append`: nsa_prefill into a non-empty cache): k decode steps on those kernels when every row
gets the same k >= 1 tokens and plan_decode would take them, else the torch append; the route is the
telemetry event ("pipeline", "append", route).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import telemetry
from .. import toggles as _toggles
from ..branches.combine import triton as combine_triton
from ..branches.compressed.fa2 import compressed_fa2
from ..branches.compressed.sdpa import compressed_sdpa
from ..branches.context import CallContext
from ..branches.selected import triton as selected_triton
from ..branches.sliding import triton as sliding_triton
from ..branches.sliding.fa2 import sliding_fa2
from ..branches.sliding.sdpa import sliding_sdpa
from ..compiling import compiling, inductor_compat
from ..hooks import HOOKS
from ..validation import NSAInputError, Shapes
from . import providers as _providers
from . import rules
from .providers import CUDNN, ORDER, PROVIDERS, TRITON  # noqa: F401 - the registry, as nsa.plan.*

BACKENDS = ("auto", "torch", "reference", "flash_attn", "torch_flash", "sdpa")
SEL_BACKENDS = _toggles.SEL_BACKENDS
STEPS = ("cmp", "topn", "sel", "win", "combine", "core")


@dataclass
class Step:
    # what serves the step: torch, torch_cudnn, flash_attn, torch_flash, sdpa, triton, triton_window (win in
    # the dense core), triton_cmp (cmp in the dense core), reference, given; the core step: dense_core or
    # separate
    provider: str
    reason: str  # telemetry reason: ok, forced, or the first failed guard of a faster provider
    # whole-T implementation (branch signature); None: the chunked torch path, or a step the dense core runs
    # itself (triton_window: forward and backward kernels; core)
    fn: Callable | None = None
    detail: str = ""
    # cmp / win on an FA-2-family provider, and the dense core's step (the provider of the compressed branch's
    # tail tokens): (provider, CallContext)
    impl: tuple | None = None


@dataclass
class Plan:
    executor: str  # "fused" | "chunked" | "reference"
    steps: dict[str, Step] = field(default_factory=dict)
    # chunked executor: elements of its largest per-chunk intermediate (rules.chunk_budget)
    chunk_budget: int = rules.CHUNK_BUDGET["cpu"]

    def __getattr__(self, name):
        steps = self.__dict__.get("steps", {})
        if name in steps:
            return steps[name]
        raise AttributeError(name)

    @property
    def dense_core(self) -> bool:
        """Whether the fused steps run as one autograd node (the core step's provider is "dense_core")."""
        core = self.steps.get("core")
        return core is not None and core.provider == "dense_core"

    def describe(self) -> dict:
        """{"executor": ..., "cmp": "torch_flash", ..., "core": "dense_core"}: what served each step (reports,
        benches)."""
        return {"executor": self.executor, **{k: s.provider for k, s in self.steps.items()}}


def _fa2_choice(branch: str, backend: str, ctx: CallContext, tg, n_cmp: int = 0) -> tuple[str, str, str]:
    """(provider name or "torch", reason, detail) for cmp or win (n_cmp: compressed blocks of the longest
    sequence). Raises when forced and impossible."""
    provs, cudnn = _providers.providers(), _providers.cudnn()
    if backend in provs:
        prov = provs[backend]
        ok, why = _providers.available(prov, ctx.device, True)
        if not ok:
            raise NSAInputError(f"backend={backend!r} is not available here: {why}")
        fail = _providers.guard(prov, branch, ctx, tg, forced=True)
        if fail:
            raise NSAInputError(f"backend={backend!r} cannot serve the {branch} branch: {fail}")
        return backend, "forced", ""
    if rules.cudnn_applies(cudnn, branch, ctx, tg, n_cmp) and _providers.available(cudnn, ctx.device, False)[0] and (
            _providers.guard(cudnn, branch, ctx, tg, forced=False) is None):
        return cudnn.name, "ok", ""  # where its guards fail, the FA-2 order below decides (and records why)
    first_fail = None
    for name in ORDER:
        prov = provs[name]
        ok, _ = _providers.available(prov, ctx.device, False)
        if not ok:
            continue
        fail = _providers.guard(prov, branch, ctx, tg, forced=False)
        if fail is None:
            return name, (first_fail.reason if first_fail else "ok"), (str(first_fail) if first_fail else "")
        if first_fail is None:
            first_fail = fail
    return "torch", (first_fail.reason if first_fail else "ok"), (str(first_fail) if first_fail else "")


def _triton_choice(kind: str, sel_backend: str, ctx: CallContext, tg, cfg) -> tuple[str, str, str]:
    """("triton" or "torch", reason, detail) for sel or topn. Raises when forced and impossible."""
    if sel_backend == "torch":
        return "torch", "forced", ""
    forced = sel_backend == "triton_sel"
    prov = TRITON[kind]
    ok, why = _providers.available(prov, ctx.device, forced)
    if not ok:
        if forced:
            raise NSAInputError(f"sel_backend='triton_sel' is not available here ({kind}): {why}")
        return "torch", "ok", ""  # not available in this environment: not a fallback (python -m nsa.env)
    fail = prov.guard(ctx, tg, forced=forced, cfg=cfg)
    if fail:
        if forced:
            raise NSAInputError(f"sel_backend='triton_sel' cannot serve the {kind} step: {fail}")
        return "torch", fail.reason, str(fail)
    return "triton", "forced" if forced else "ok", ""


def _timed(step: str, provider: str, fn: Callable) -> Callable:
    """NSA_DEBUG_TIMING=1: synchronized wall time per (step, provider) call into telemetry."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        sync = torch.cuda.synchronize if dev is not None and dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        res = fn(*args, **kwargs)
        sync()
        telemetry.add_time(f"{step}.{provider}", (time.perf_counter() - t0) * 1e3)
        return res

    return timed


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _record(step: str, s: Step) -> None:
    if s.detail:
        telemetry.record(step, s.provider, s.reason, detail=s.detail)
    else:
        telemetry.record(step, s.provider, s.reason)


# Plans of dense CUDA calls by everything their decisions read (CACHE_SIZE at most). Planning costs about
# 0.16 ms of host time per call (H200 host, Python 3.12), and the GPU waits for it: the sliding branch's
# kernel cannot start before the plan exists, so at T=8k it is a twentieth of the forward.
CACHE_SIZE = 64
_cache: dict = {}


def clear_cache() -> None:
    """Forget cached plans (after changing a provider object in place; toggles need no clearing)."""
    _cache.clear()


def _tensor_key(t):
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16 == 0, t.requires_grad)


def _cache_key(backend, q, k, v, cfg, kv_cmp, kv_win, given_indices, sel_backend, tg):
    """The key of a call whose plan may be cached, or None: dense CUDA input (packed input's plan reads the
    offsets' values). It holds what planning reads: the toggles, shapes, strides, 16-byte alignment,
    dtypes, the device, whether gradients are needed, and the provider objects (CPU tests swap and
    modify them, so CPU calls are not cached unless nsa.hooks.HOOKS.cache_cpu_plans)."""
    if not (q.is_cuda or HOOKS.cache_cpu_plans):
        return None
    pairs = tuple(_tensor_key(t) for pair in (kv_cmp, kv_win) for t in (pair or (None, None)))
    return (backend, sel_backend, given_indices, tg, cfg, q.device, torch.is_grad_enabled(), _tensor_key(q),
            _tensor_key(k), _tensor_key(v), pairs, HOOKS.tma, HOOKS.tma_force, id(_providers.providers()),
            id(_providers.cudnn()), id(TRITON))


def make_plan(backend: str, q, k, v, cfg, *, kv_cmp=None, kv_win=None, cu_seqlens=None, host_cu=None,
              given_indices: bool = False, sel_backend: str | None = None) -> Plan:
    """Decide every step of one call, record the decisions in telemetry, return the Plan (cached for dense
    CUDA input: the same decisions, recorded again for this call)."""
    if backend not in BACKENDS:
        raise NSAInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if compiling():
        inductor_compat()
    if backend in ("auto", "flash_attn", "torch_flash", "sdpa") and cu_seqlens is None:
        tg = _toggles.read()
        # Under torch.compile planning runs once, when the caller is traced: nothing to cache (and fake
        # tensors have no data pointer for the key).
        key = None if compiling() else _cache_key(backend, q, k, v, cfg, kv_cmp, kv_win, given_indices,
                                                         sel_backend, tg)
        if key is not None:
            cached = _cache.get(key)
            if cached is None:
                cached = _make_plan(backend, q, k, v, cfg, kv_cmp=kv_cmp, kv_win=kv_win, cu_seqlens=None,
                                    host_cu=None, given_indices=given_indices, sel_backend=sel_backend, tg=tg)
                if len(_cache) >= CACHE_SIZE:
                    _cache.clear()
                _cache[key] = cached
            else:
                for name, st in cached.steps.items():
                    _record(name, st)
            return cached
    return _make_plan(backend, q, k, v, cfg, kv_cmp=kv_cmp, kv_win=kv_win, cu_seqlens=cu_seqlens, host_cu=host_cu,
                      given_indices=given_indices, sel_backend=sel_backend)


def _make_plan(backend: str, q, k, v, cfg, *, kv_cmp=None, kv_win=None, cu_seqlens=None, host_cu=None,
               given_indices: bool = False, sel_backend: str | None = None, tg=None) -> Plan:
    if backend in ("torch", "reference"):
        steps = {s: Step(backend, "forced") for s in STEPS[:4]}
        if given_indices:
            steps["topn"] = Step("given", "forced")
        for name, s in steps.items():
            _record(name, s)
        return Plan("chunked" if backend == "torch" else "reference", steps,
                    rules.chunk_budget(q.device.type, tg or _toggles.read()))

    tg = tg or _toggles.read()
    sel_backend = sel_backend or tg.sel_backend
    if sel_backend not in SEL_BACKENDS:
        raise NSAInputError(f"sel_backend must be one of {SEL_BACKENDS}, got {sel_backend!r}")
    B, T, Hq, Dk = q.shape
    timing = tg.debug_timing and not compiling()  # no synchronized timers inside a compiled graph

    def ctx_for(kb, vb, grad_tensors):
        shapes = Shapes(B, T, Hq, kb.shape[2], Dk, vb.shape[3])
        return CallContext(shapes, q.dtype, q.device, _needs_grad(grad_tensors), cu_seqlens=cu_seqlens,
                           host_cu=host_cu)

    steps: dict[str, Step] = {}
    for branch, pair, impl_fa2, impl_sdpa in (("cmp", kv_cmp, compressed_fa2, compressed_sdpa),
                                              ("win", kv_win, sliding_fa2, sliding_sdpa)):
        kb, vb = pair or (k, v)
        ctx = ctx_for(kb, vb, [q, kb, vb])
        name, reason, detail = _fa2_choice(branch, backend, ctx, tg, cfg.n_cmp_blocks(ctx.max_len))
        fn = impl = None
        if name == "sdpa":
            fn = functools.partial(impl_sdpa, tg)
        elif name != "torch":
            prov = _providers.cudnn() if name == CUDNN.name else _providers.providers()[name]
            ctx.kernel_dtype = rules.fa2_kernel_dtype(prov, ctx.dtype, tg)[0]
            impl = (prov, ctx)
            fn = functools.partial(impl_fa2, prov, ctx, tg)
        steps[branch] = Step(name, reason, fn, detail, impl)

    sel_ctx = ctx_for(k, v, [q, k, v])
    name, reason, detail = _triton_choice("sel", sel_backend, sel_ctx, tg, cfg)
    steps["sel"] = Step(name, reason, selected_triton.selected_attention if name == "triton" else None, detail)

    if given_indices:
        steps["topn"] = Step("given", "forced")
    elif steps["cmp"].fn is None:
        # The top-n kernel reads the whole-T LSE of a fast cmp provider; torch cmp computes it per chunk.
        # Not a fallback of its own: it follows the cmp decision (environment, forced, or cmp's fallback).
        why = "the compressed branch runs on torch (no whole-T LSE for the top-n kernel)"
        if sel_backend == "torch" or telemetry.is_normal(steps["cmp"].reason):
            steps["topn"] = Step("torch", "forced" if sel_backend == "torch" else steps["cmp"].reason)
        else:
            steps["topn"] = Step("torch", "cmp_on_torch", None, why)
    else:
        # "triton_sel" forces the selected attention kernel; the top-n kernel then runs where it can.
        topn_choice = "torch" if sel_backend == "torch" else "auto"
        name, reason, detail = _triton_choice("topn", topn_choice, ctx_for(k, v, []), tg, cfg)
        steps["topn"] = Step(name, reason, selected_triton.top_n if name == "triton" else None, detail)

    fused = all(steps[s].fn is not None for s in ("cmp", "sel", "win")) and (
        given_indices or steps["topn"].fn is not None)
    if fused:
        ok, _ = _providers.available(TRITON["combine"], q.device, False)
        fail = TRITON["combine"].guard(sel_ctx, tg, forced=False) if ok else None
        if ok and fail is None:
            steps["combine"] = Step("triton", "ok", combine_triton.gate_combine)
        else:
            steps["combine"] = Step("torch", fail.reason if fail else "ok", None, str(fail) if fail else "")
        fail = rules.dense_core_guard(steps, sel_ctx, tg, q, cfg, given_indices)
        if fail:
            steps["core"] = Step("separate", fail.reason, None, fail.message)
            # Under torch.compile the steps run separately (rules.COMPILE_NO_DENSE_CORE); the sliding branch
            # still takes NSA's Triton window kernels where the dense core would: their operator carries its
            # backward, so the compiled graph runs the kernels eager mode runs.
            if (fail.reason == "compile" and backend == "auto" and cu_seqlens is None
                    and rules.window_triton_guard(tg, q, *(kv_win or (k, v))) is None):
                steps["win"] = Step("triton_window", "ok", sliding_triton.window_step)
        else:
            # The compressed branch's tail tokens run on the sliding branch's FA-2 provider (nsa.run.dense_core).
            steps["core"] = Step("dense_core", "ok", impl=steps["win"].impl)
            # A forced backend serves win on the provider asked for; auto takes the Triton window where it runs.
            # The Triton window kernels take dense input only: packed input keeps the provider's varlen call.
            if (backend == "auto" and cu_seqlens is None
                    and rules.window_triton_guard(tg, q, *(kv_win or (k, v))) is None):
                steps["win"] = Step("triton_window", "ok")
            # Likewise the compressed branch on NSA's Triton kernels, for sequences up to NSA_TRITON_CMP_MAX_LEN.
            if backend == "auto" and cu_seqlens is None and rules.cmp_triton_guard(tg, q, *(kv_cmp or (k, v))) is None:
                prev = steps["cmp"]
                steps["cmp"] = Step("triton_cmp", "ok", prev.fn, prev.detail, prev.impl)
    for name, s in steps.items():
        if timing and s.fn is not None:
            s.fn = _timed(name, s.provider, s.fn)
        _record(name, s)
    # T == 0 never runs either executor (nsa.run.run)
    return Plan("fused" if fused else "chunked", steps, rules.chunk_budget(q.device.type, tg))


def chunk_budget(device) -> int:
    """The chunked path's per-chunk element budget on `device` as the environment says now (for callers that
    run the per-chunk functions without a Plan: nsa.distributed.local)."""
    return rules.chunk_budget(torch.device(device).type, _toggles.read())


# --- decode steps ---------------------------------------------------------------------------------------------

DECODE_BACKENDS = ("auto", "torch", "triton")
DECODE_BRANCHES = ("cmp", "sel", "win")


@dataclass(frozen=True)
class DecodePlan:
    backend: str  # "torch" or "triton"
    reason: str  # telemetry reason
    detail: str = ""

    @property
    def served(self) -> str:
        """The backend name telemetry records for the step's branches."""
        return "triton_decode" if self.backend == "triton" else "torch"


def plan_decode(backend: str, q, cache, *, needs_grad: bool = False, record: bool = False) -> DecodePlan:
    """Which implementation runs this decode step, and the telemetry reason (recorded for cmp, sel and win
    when `record`). Raises when forced and impossible."""
    plan = _plan_decode(backend, q, cache, needs_grad)
    if record:
        for branch in DECODE_BRANCHES:
            telemetry.record(branch, plan.served, plan.reason, **({"detail": plan.detail} if plan.detail else {}))
    return plan


def _plan_decode(backend: str, q, cache, needs_grad: bool) -> DecodePlan:
    if backend not in DECODE_BACKENDS:
        raise NSAInputError(f"backend must be one of {DECODE_BACKENDS} for a decode step, got {backend!r}"
                            + (" (that backend has no decode step of its own: NSAAttention takes decode_backend=)"
                               if isinstance(backend, str) else ""))
    if backend == "torch":
        return DecodePlan("torch", "forced")
    forced = backend == "triton"
    prov = TRITON["decode"]
    ok, why = _providers.available(prov, q.device, forced)
    if not ok:
        if forced:
            raise NSAInputError(f"backend='triton' is not available here: {why}")
        return DecodePlan("torch", "decode", why)  # the environment, not a fallback
    fail = prov.decode_guard(q, cache, needs_grad)
    if fail:
        if forced:
            raise NSAInputError(f"backend='triton' cannot run this decode step: {fail}")
        return DecodePlan("torch", fail.reason, fail.message)
    return DecodePlan("triton", "forced" if forced else "ok")


# --- appends: several new tokens per row into a non-empty cache (nsa_prefill) ---------------------------------

APPEND_BACKENDS = BACKENDS + ("triton",)


@dataclass(frozen=True)
class AppendPlan:
    route: str  # "decode_steps" (k steps on the Triton decode kernels) or "torch_ragged" | "torch_backend" |
    #             "torch_planned" (the torch append: nsa.branches.decode.extend)
    step: DecodePlan  # backend, telemetry reason and detail recorded for cmp, sel and win

    @property
    def steps(self) -> bool:
        return self.route == "decode_steps"


def plan_append(backend: str, q, cache, news: list[int]) -> AppendPlan:
    """How nsa_prefill appends news[b] tokens to row b of a non-empty cache. When every row gets the same
    number k >= 1 and a decode step would run on the Triton decode kernels (plan_decode decides, with its
    guards and reasons), as k decode steps on them; otherwise the torch append. backend: nsa_prefill's
    ("auto", "torch" or a prefill provider, which has no decode step: the torch append) or "triton" (the
    kernels forced: NSAInputError when they cannot run or the rows get different numbers of tokens)."""
    if backend not in APPEND_BACKENDS:
        raise NSAInputError(f"backend must be one of {APPEND_BACKENDS} for tokens appended to a non-empty cache, "
                            f"got {backend!r}")
    if backend not in DECODE_BACKENDS:
        return AppendPlan("torch_backend", DecodePlan(
            "torch", "forced", f"backend={backend!r} has no decode step: tokens appended on the torch path"))
    k = news[0]
    if max(news) == 0:  # nothing to run (nsa_prefill returns an empty output)
        return AppendPlan("torch_ragged", DecodePlan("torch", "decode", "no new tokens"))
    if min(news) != max(news):
        why = (f"rows get {min(news)} to {max(news)} new tokens: decode steps append the same number to every "
               "row")
        if backend == "triton":
            raise NSAInputError(f"backend='triton' cannot run this append: {why}")
        # the torch append is the implementation of ragged appends (like a torch decode step: reason "decode")
        return AppendPlan("torch_ragged", DecodePlan("torch", "decode", why + "; tokens appended on the torch path"))
    # No gradient on either path (nsa_prefill appends under torch.no_grad), so the grad guard does not apply
    step = _plan_decode(backend, q, cache, needs_grad=False)
    if step.backend == "triton":
        return AppendPlan("decode_steps", DecodePlan(
            "triton", step.reason, f"{k} new token(s) per row appended as {k} decode step(s)"))
    return AppendPlan("torch_planned", DecodePlan("torch", step.reason, "; ".join(
        x for x in (step.detail, "tokens appended on the torch path") if x)))
