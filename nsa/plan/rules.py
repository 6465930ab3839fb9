"""Every rule that chooses an implementation, as data and small pure checks: guards (each failure a short
reason code plus a message), thresholds and the toggles they read. nsa.plan.providers composes them per
provider; nothing under nsa.kernels decides.

A failed guard never crashes a kernel: planning (nsa.plan) either raises NSAInputError (the implementation
was forced) or falls back to the next one and counts (branch, served backend, reason) in nsa.telemetry.

Reason codes (docs/backends.md):
    FA-2 family (flash_attn, torch_flash, torch_cudnn)  disabled, not_cuda, sm_unsupported, ada_policy,
                                                        dtype, head_dim, head_dim_sm, cu_seqlens,
                                                        force_dense_packed, below_min_len
    Triton sel / topn / combine                         disabled, sm_unsupported, ada_policy, dtype,
                                                        head_dim, grad, cu_seqlens, below_min_len, config
    Triton decode                                       disabled, sm_unsupported, dtype, head_dim,
                                                        group_size, grad
    dense core (the core step; never a fallback)        disabled, packed, provider, dtype, steps,
                                                        head_dim, q_stride, short
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from ..branches.fa2_call import padded_head_dim
from ..compiling import compiling, trace_constant
from ..kernels.device import ADA, Failure, device_capability, sm_count
from ..kernels.fa2.base import FA2_DTYPES
from ..toggles import Toggles, env_bool

# --- FlashAttention-2 family ---------------------------------------------------------------------------------

FA2_MAX_HEAD_DIM = 256
# flash-attn / PyTorch FA-2: the backward for head dim > 192 needs the shared memory of sm80 / sm90
# (A100, H100); sm86 / sm87 / sm89 run the forward up to 256 but the backward only up to 192.
SM8X_SMALL_SMEM_BWD_MAX = 192
THRESHOLDS_FILE = Path(__file__).resolve().parents[1] / "fa2_thresholds.json"
_THRESHOLDS_PATH = str(THRESHOLDS_FILE)  # a string: Dynamo passes only constants to _table_min_len
DEFAULT_MIN_LEN = 16

def check_device(device: torch.device, toggles: Toggles, capability=None) -> Failure | None:
    """CUDA, sm >= 8.0; Ada (sm 8.9) off unless NSA_FA2_FORCE=1. `capability` overrides (tests)."""
    if device.type != "cuda":
        return Failure("not_cuda", f"FlashAttention-2 runs on CUDA tensors, got {device}")
    cap = capability or device_capability(device)
    if cap < (8, 0):
        return Failure("sm_unsupported", f"sm {cap[0]}.{cap[1]}: FlashAttention-2 needs sm >= 8.0")
    if tuple(cap) == ADA and not toggles.force:
        return Failure("ada_policy", "Ada (sm 8.9): FA-2 is off by default for NSA; NSA_FA2_FORCE=1 overrides")
    return None


def kernel_dtype(dtype: torch.dtype, toggles: Toggles) -> tuple[torch.dtype | None, Failure | None]:
    """The dtype the kernel runs in: fp16/bf16 as given; fp32 cast per NSA_FA2_PREF_FP16; fp64 never."""
    if dtype in FA2_DTYPES:
        return dtype, None
    if dtype == torch.float32 and toggles.pref_fp16 is not None:
        return (torch.float16 if toggles.pref_fp16 else torch.bfloat16), None
    hint = " (NSA_FA2_PREF_FP16=1 casts fp32 to fp16, =0 to bf16)" if dtype == torch.float32 else ""
    return None, Failure("dtype", f"FlashAttention-2 takes fp16/bf16, got {dtype}{hint}")


def check_head_dim(dk: int, dv: int, capability, needs_grad: bool, toggles: Toggles) -> Failure | None:
    d = padded_head_dim(dk, dv)
    if d % 8:
        return Failure("head_dim", f"head dim {d} (Dk={dk}, Dv={dv}) is not a multiple of 8")
    if d > FA2_MAX_HEAD_DIM:
        return Failure("head_dim", f"head dim {d} > {FA2_MAX_HEAD_DIM}: no FlashAttention-2 kernel")
    if (capability is not None and capability[0] == 8 and capability[1] != 0 and needs_grad
            and d > SM8X_SMALL_SMEM_BWD_MAX and not toggles.force):
        return Failure("head_dim_sm", f"sm {capability[0]}.{capability[1]}: the FA-2 backward supports head "
                       f"dim <= {SM8X_SMALL_SMEM_BWD_MAX}, got {d} (NSA_FA2_FORCE=1 tries anyway)")
    return None


def check_cu_seqlens(cu: torch.Tensor | None, host: list[int] | None, total: int,
                     device: torch.device) -> Failure | None:
    """The varlen contract: int32, on q's device, 1-D, starts at 0, non-decreasing, ends at the total."""
    if cu is None:
        return None
    if cu.dtype != torch.int32:
        return Failure("cu_seqlens", f"cu_seqlens must be int32, got {cu.dtype}")
    if cu.device != device:
        return Failure("cu_seqlens", f"cu_seqlens is on {cu.device}, q on {device}")
    if cu.dim() != 1 or cu.numel() < 2:
        return Failure("cu_seqlens", f"cu_seqlens must be 1-D with >= 2 entries, got {tuple(cu.shape)}")
    if not cu.is_contiguous():
        return Failure("cu_seqlens", "cu_seqlens must be contiguous")
    if host is None:
        return Failure("cu_seqlens", "the host copy of cu_seqlens is missing (internal)")
    if len(host) != cu.numel():
        return Failure("cu_seqlens", f"host copy has {len(host)} entries, tensor {cu.numel()}")
    if host[0] != 0:
        return Failure("cu_seqlens", f"cu_seqlens must start at 0, got {host[0]}")
    if any(b < a for a, b in zip(host, host[1:])):
        return Failure("cu_seqlens", "cu_seqlens must be non-decreasing")
    if host[-1] != total:
        return Failure("cu_seqlens", f"cu_seqlens must end at {total}, got {host[-1]}")
    if total >= 2**31:
        return Failure("cu_seqlens", f"{total} packed tokens do not fit the kernels' int32 offsets")
    return None


@lru_cache(maxsize=4)
def _load_thresholds(path: str, mtime: float) -> dict:
    with open(path) as fh:
        return json.load(fh)


def thresholds(path: Path | None = None) -> dict:
    p = Path(path or THRESHOLDS_FILE)
    if not p.exists():
        return {}
    return _load_thresholds(str(p), p.stat().st_mtime)


def gpu_class(capability) -> str | None:
    return None if capability is None else f"sm{capability[0]}{capability[1]}"


def min_len(branch: str, head_dim: int, capability, toggles: Toggles, path: Path | None = None) -> tuple[int, str]:
    """(threshold, where it came from): env NSA_FA2_MIN_LEN_* > fa2_thresholds.json entry > its default."""
    env = toggles.min_len(branch)
    if env is not None:
        return env, f"NSA_FA2_MIN_LEN_{branch.upper()}"
    return _table_min_len(branch, head_dim, gpu_class(capability), _THRESHOLDS_PATH if path is None else str(path))


@trace_constant  # reads a file: under torch.compile, once when the caller is traced (constant arguments only)
def _table_min_len(branch: str, head_dim: int, cls: str | None, path: str) -> tuple[int, str]:
    table = thresholds(path)
    for e in table.get("entries", []):
        if e.get("gpu_class") == cls and int(e.get("head_dim", -1)) == head_dim and branch in e:
            return int(e[branch]), f"fa2_thresholds.json {cls} D={head_dim}"
    default = table.get("default", {})
    return int(default.get(branch, DEFAULT_MIN_LEN)), "fa2_thresholds.json default"


def check_min_len(branch: str, length: int, head_dim: int, capability, toggles: Toggles,
                  path: Path | None = None) -> Failure | None:
    thr, src = min_len(branch, head_dim, capability, toggles, path)
    if length < thr:
        return Failure("below_min_len", f"{branch} length {length} < {thr} ({src})")
    return None


def fa2_kernel_dtype(prov, dtype: torch.dtype, toggles: Toggles) -> tuple[torch.dtype | None, Failure | None]:
    """The dtype `prov`'s kernel runs in: the input's when the kernel takes it, else kernel_dtype's cast."""
    if dtype in prov.kernel_dtypes:
        return dtype, None
    return kernel_dtype(dtype, toggles)


def fa2_guard(prov, branch: str, ctx, toggles: Toggles, forced: bool) -> Failure | None:
    """The first failed guard of an FA-2-family provider for the cmp or win branch of this call, or None."""
    if not toggles.fa2_enabled(branch):
        var = "NSA_USE_FA2" if not toggles.use_fa2 else f"NSA_USE_FA2_{branch.upper()}"
        return Failure("disabled", f"{var}=0")
    cap = prov._cap(ctx.device)
    if not prov.allow_cpu:
        fail = check_device(ctx.device, toggles, cap)
        if fail:
            return fail
    elif cap is not None and tuple(cap) == ADA and not toggles.force:
        return Failure("ada_policy", "Ada (sm 8.9): FA-2 is off by default for NSA; NSA_FA2_FORCE=1 overrides")
    _, fail = fa2_kernel_dtype(prov, ctx.dtype, toggles)
    if fail:
        return fail
    fail = check_head_dim(ctx.Dk, ctx.Dv, cap, ctx.needs_grad, toggles)
    if fail:
        return fail
    if ctx.packed:
        if ctx.host_cu is None and compiling():
            # In a compiled graph the offsets stay on the device (nsa.validation checks them there), and the
            # compressed branch's varlen fold is planned from their host copy (compressed.fold.plan_varlen).
            if branch == "cmp":
                return Failure("compile_packed", "torch.compile: packed input's offsets are not on the host in "
                               "a compiled graph; the compressed branch's varlen FA-2 call is planned from them")
        else:
            fail = check_cu_seqlens(ctx.cu_seqlens, ctx.host_cu, ctx.T, ctx.device)
            if fail:
                return fail
        if toggles.force_dense:
            return Failure("force_dense_packed", "NSA_FA2_FORCE_DENSE=1 but the input is packed (cu_seqlens)")
    fail = check_splitkv(prov, branch, ctx)
    if fail:
        return fail
    if not forced:
        return check_min_len(branch, ctx.max_len, padded_head_dim(ctx.Dk, ctx.Dv), cap, toggles)
    return None


# torch's built-in FA-2 (torch 2.11, H200) writes past the end of softmax_lse in its split-KV combine kernel at
# head dim 192: compute-sanitizer reports 4-byte writes just after the [1, 1, 65] LSE of the sliding branch's call
# at T=65, Dk=192 / Dv=128 (the combine kernel's rows past seqlen_q are not masked). Split-KV runs where batch x
# heads x ceil(Tq / 64) is below 0.8 x twice the SM count (flash-attn's heuristic); such calls are small, and the
# next provider serves them. Varlen calls never split, nor calls whose keys fit one 64-key block.
SPLITKV_UNSAFE_HEAD_DIMS = {"torch_flash": (192,)}


def check_splitkv(prov, branch: str, ctx) -> Failure | None:
    """The sliding branch's dense call on a provider whose split-KV path is unsafe at this head dim."""
    d = padded_head_dim(ctx.Dk, ctx.Dv)
    if branch != "win" or ctx.packed or d not in SPLITKV_UNSAFE_HEAD_DIMS.get(prov.name, ()):
        return None
    sms = sm_count(ctx.device)
    rows = ctx.B * ctx.Hq * -(-ctx.T // 64)
    if sms and ctx.T > 64 and rows < 2 * sms:  # keys in one block of 64 (head dim 192's tile): never split
        return Failure("splitkv_lse", f"{prov.name}'s split-KV path at head dim {d} writes past its LSE "
                       f"(B x Hq x ceil(T/64) = {rows} < {2 * sms}, twice the SM count): the next provider serves")
    return None


# --- torch_cudnn: where it is tried at all (nsa.kernels.fa2.torch_cudnn says why) ----------------------------


def cudnn_applies(prov, branch: str, ctx, toggles: Toggles, n_keys: int) -> bool:
    """Whether to try cuDNN attention at all; when False the FA-2 order decides alone. n_keys: the keys of
    the (square) call, the compressed blocks of a sequence: cuDNN refuses a 1 x 1 one."""
    from ..kernels.fa2.torch_cudnn import MIN_CAPABILITY, MIN_KEYS

    cap = prov._cap(ctx.device)
    return (toggles.use_cudnn and branch == "cmp" and n_keys >= MIN_KEYS and not ctx.packed
            and not toggles.force_varlen
            and ctx.dtype in prov.kernel_dtypes and cap is not None
            and tuple(cap) >= MIN_CAPABILITY and padded_head_dim(ctx.Dk, ctx.Dv) <= prov.max_head_dim())


# --- NSA's Triton kernels: selected attention, fused score + top-n, gate combine -----------------------------

TRITON_MIN_L = 0  # NSA_SEL_TRITON_MIN_L default: the fused pipeline serves every length
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256


def triton_device_policy(kind: str, capability, toggles: Toggles) -> Failure | None:
    if capability is None:
        return None
    if tuple(capability) < (8, 0):
        return Failure("sm_unsupported", f"sm {capability[0]}.{capability[1]}: the Triton {kind} kernel needs "
                       "sm >= 8.0")
    if tuple(capability) == ADA and not toggles.triton_sel_force:
        return Failure("ada_policy", f"Ada (sm 8.9): the Triton {kind} kernel is off by default; "
                       "NSA_TRITON_SEL_FORCE=1 overrides")
    return None


def triton_guard(kind: str, capability, ctx, toggles: Toggles, forced: bool, cfg=None) -> Failure | None:
    """The first failed guard of the Triton `kind` kernel ("sel", "topn", "combine") for this call."""
    if ctx.dtype not in TRITON_DTYPES:
        return Failure("dtype", f"the Triton {kind} kernel takes fp16/bf16/fp32, got {ctx.dtype}")
    if kind == "combine":
        return None
    if kind == "sel" and not toggles.use_triton_sel:
        return Failure("disabled", "NSA_USE_TRITON_SEL=0")
    if kind == "topn" and not toggles.use_triton_topn:
        return Failure("disabled", "NSA_USE_TRITON_TOPN=0")
    fail = triton_device_policy(kind, capability, toggles)
    if fail:
        return fail
    if max(ctx.Dk, ctx.Dv) > TRITON_MAX_HEAD_DIM:
        return Failure("head_dim", f"head dim {max(ctx.Dk, ctx.Dv)} > {TRITON_MAX_HEAD_DIM} (Dk={ctx.Dk}, "
                       f"Dv={ctx.Dv})")
    if ctx.packed and ctx.T >= 2**31:
        return Failure("cu_seqlens", f"{ctx.T} packed tokens do not fit the kernel's int32 positions")
    if kind == "topn":
        return topn_config(cfg)
    if ctx.needs_grad and not toggles.sel_allow_grad:
        return Failure("grad", "gradients needed and NSA_SEL_TRITON_ALLOW_GRAD=0")
    if not forced:
        thr = toggles.sel_min_len if toggles.sel_min_len is not None else TRITON_MIN_L
        if ctx.max_len < thr:
            src = "NSA_SEL_TRITON_MIN_L" if toggles.sel_min_len is not None else "default"
            return Failure("below_min_len", f"sel length {ctx.max_len} < {thr} ({src})")
    return None


def topn_config(cfg) -> Failure | None:
    """The configurations the top-n kernel supports (it imports triton: asked only where triton imports)."""
    if cfg is None:
        return None
    from ..kernels.triton.topn import unsupported

    why = unsupported(cfg)
    return Failure("config", why) if why else None


# --- Triton decode kernels -----------------------------------------------------------------------------------

DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_MAX_HEAD_DIM = 256
DECODE_MAX_GROUP = 64


def decode_guard(capability, q, cache, needs_grad: bool) -> Failure | None:
    """The first failed guard of the Triton decode kernels for this step, or None."""
    if not env_bool("NSA_USE_TRITON_DECODE", True):
        return Failure("disabled", "NSA_USE_TRITON_DECODE=0")
    if capability is not None and tuple(capability) < (8, 0):
        return Failure("sm_unsupported",
                       f"sm {capability[0]}.{capability[1]}: the Triton decode kernels need sm >= 8.0")
    if q.dtype not in DECODE_DTYPES:
        return Failure("dtype", f"the Triton decode kernels take fp16/bf16/fp32, got {q.dtype}")
    if max(cache.d_k, cache.d_v) > DECODE_MAX_HEAD_DIM:
        return Failure("head_dim", f"head dim {max(cache.d_k, cache.d_v)} > {DECODE_MAX_HEAD_DIM}")
    G = q.shape[2] // cache.n_kv_heads
    if G > DECODE_MAX_GROUP:
        return Failure("group_size", f"{G} query heads per KV head > {DECODE_MAX_GROUP}")
    if needs_grad:
        return Failure("grad", "inputs need gradients and the Triton decode kernels have no backward")
    return None


# --- the chunked executor's chunk size ---------------------------------------------------------------------

# Elements of the chunked path's largest per-chunk intermediate: a few hundred MB on CPU, a few GB on a GPU,
# where larger chunks mean fewer kernel launches. NSA_TORCH_CHUNK_BUDGET overrides both.
CHUNK_BUDGET = {"cpu": 1 << 26, "cuda": 1 << 28}


def chunk_budget(device_type: str, toggles: Toggles) -> int:
    """The per-chunk element budget of the chunked path (nsa.run.chunked.choose_chunk) on this device type."""
    if toggles.chunk_budget is not None:
        return toggles.chunk_budget
    return CHUNK_BUDGET.get(device_type, CHUNK_BUDGET["cpu"])


# --- the dense core and its sliding branch on the Triton window kernels -----------------------------------

# Under torch.compile the fused pipeline runs as separate operators (each Triton kernel a custom operator,
# nsa.kernels.ops), which Dynamo traces; the plan's core step records this reason ("compile").
COMPILE_NO_DENSE_CORE = ("torch.compile: the dense core's backward calls torch.autograd.grad on inner graphs, "
                         "which Dynamo cannot trace; its steps run as separate custom operators")


def dense_core_guard(steps, ctx, toggles: Toggles, q, cfg, given_indices: bool) -> Failure | None:
    """Why the dense core (nsa.run.dense_core) does not serve this fused call, or None where it does: cmp and
    win on an FA-2-family provider, sel, top-n (or given indices) and combine on Triton. Dense or packed input,
    any head dims and dtypes those providers serve: the core folds the compressed branch by view where it can
    and runs the provider's own call elsewhere (nsa.run.dense_core.view_fold). NSA_DENSE_CORE=0 turns it off;
    NSA_FA2_FORCE_VARLEN=1 (varlen kernels for dense input, a check of those kernels) keeps the separate
    operations; under torch.compile it never applies (COMPILE_NO_DENSE_CORE). Reasons: disabled, compile,
    force_varlen, provider, steps (never a fallback: the same steps run as separate operations,
    nsa.telemetry)."""
    if not toggles.dense_core:
        return Failure("disabled", "NSA_DENSE_CORE=0")
    if compiling():
        return Failure("compile", COMPILE_NO_DENSE_CORE)
    if toggles.force_varlen:
        return Failure("force_varlen", "NSA_FA2_FORCE_VARLEN=1")
    for step in ("cmp", "win"):
        if steps[step].impl is None:
            return Failure("provider", f"the {step} step is not on an FA-2-family provider")
    if steps["sel"].provider != "triton" or steps["combine"].provider != "triton" or not (
            given_indices or steps["topn"].provider == "triton"):
        return Failure("steps", "sel, top-n and combine are not all on Triton")
    return None


def cmp_triton_guard(toggles: Toggles, q, kc, vc) -> Failure | None:
    """Why the dense core's compressed branch does not run on NSA's Triton kernels, or None where it does: for
    sequences up to NSA_TRITON_CMP_MAX_LEN tokens (default 0: never; measured they save memory and gain 2% on
    short packed batches, and are slower on single sequences: nsa.kernels.triton.cmp_attn), where the kernels
    run (Hopper TMA copies, the window kernels' head dims). Elsewhere the planned FA-2 / cuDNN provider serves
    the branch, as it would without them (not a fallback: the cmp step keeps that provider and its reason)."""
    limit = toggles.triton_cmp_max_len
    if limit <= 0:
        return Failure("disabled", "NSA_TRITON_CMP_MAX_LEN=0")
    if q.shape[1] > limit:
        return Failure("long", f"T={q.shape[1]} > NSA_TRITON_CMP_MAX_LEN={limit}")
    from ..branches.compressed.triton import supported

    ok, why = supported(q, kc, vc)
    return None if ok else Failure("unsupported", why)


def window_triton_guard(toggles: Toggles, q, kw, vw) -> Failure | None:
    """Why the dense core's sliding branch does not run on NSA's Triton kernels, or None where it does: on by
    default where they run (Hopper TMA copies, the head dims window.supported takes); elsewhere its FA-2
    provider serves both directions, as it would without them (not a fallback: the win step keeps that
    provider and its reason). NSA_TRITON_WINDOW=0 turns it off."""
    if not toggles.triton_window:
        return Failure("disabled", "NSA_TRITON_WINDOW=0")
    from ..branches.sliding.triton import supported

    ok, why = supported(q, kw, vw)
    return None if ok else Failure("unsupported", why)
