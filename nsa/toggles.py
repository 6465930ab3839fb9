"""Environment toggles of NSA's planning (nsa.plan), read at CALL time (never cached at construction).

Every plan calls `read()`, so `os.environ[...] = ...` between two calls of the same module
takes effect on the next call. A malformed value is an error naming the variable, never silently
ignored. docs/backends.md has the table of every toggle with its default and meaning.

This is the one module of the library that reads the environment (tests/cpu/test_layers.py keeps it so):
besides `read()`, the telemetry's log switches (`debug_log`, `log_limit`), Triton's interpreter
(`triton_interpret`) and the NSA_* variables a report records (`nsa_variables`) are read here.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass

from .compiling import trace_constant
from .validation import NSAInputError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    val = raw.strip().lower()
    if val in _TRUE:
        return True
    if val in _FALSE:
        return False
    raise NSAInputError(f"{name}={raw!r}: expected 1/0 (or true/false, yes/no, on/off)")


def env_int(name: str, default: int | None, minimum: int = 0) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        val = int(raw.strip())
    except ValueError:
        raise NSAInputError(f"{name}={raw!r}: expected an integer >= {minimum}") from None
    if val < minimum:
        raise NSAInputError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return val


SEL_BACKENDS = ("auto", "torch", "triton_sel")

# The longest sequence whose compressed branch the dense core runs on NSA's Triton kernels by default: 0, off
# (measured on an H100 they are faster only on short packed batches, by 2%, and slower on single sequences:
# nsa.kernels.triton.cmp_attn has the figures).
TRITON_CMP_MAX_LEN = 0


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    val = raw.strip().lower()
    if val not in choices:
        raise NSAInputError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return val


@dataclass(frozen=True)
class Toggles:
    use_fa2: bool = True  # NSA_USE_FA2: 0 turns off both FA-2 providers (flash_attn, torch_flash)
    use_fa2_win: bool = True  # NSA_USE_FA2_WIN
    use_fa2_cmp: bool = True  # NSA_USE_FA2_CMP
    use_cudnn: bool = True  # NSA_USE_CUDNN: 0 keeps the compressed branch off cuDNN attention (torch_cudnn)
    dense_core: bool = True  # NSA_DENSE_CORE: 0 runs the fused dense pipeline as separate autograd ops
    triton_window: bool = True  # NSA_TRITON_WINDOW: 0 keeps the dense core's sliding branch on FA-2
    # NSA_TRITON_CMP_MAX_LEN: the dense core's compressed branch on NSA's Triton kernels for sequences up to
    # this length (0: never; longer sequences keep the planned FA-2 / cuDNN provider)
    triton_cmp_max_len: int = TRITON_CMP_MAX_LEN
    min_len_win: int | None = None  # NSA_FA2_MIN_LEN_WIN (None: nsa/fa2_thresholds.json)
    min_len_cmp: int | None = None  # NSA_FA2_MIN_LEN_CMP
    force: bool = False  # NSA_FA2_FORCE: override the SM policy (Ada, sm8x backward head-dim cap)
    force_varlen: bool = False  # NSA_FA2_FORCE_VARLEN: dense input through the varlen kernels
    force_dense: bool = False  # NSA_FA2_FORCE_DENSE: never the varlen kernels (packed input: guard fails)
    pref_fp16: bool | None = None  # NSA_FA2_PREF_FP16: None = fp32 falls back; 1 = cast to fp16; 0 = to bf16
    debug_timing: bool = False  # NSA_DEBUG_TIMING: synchronized per-(branch, backend) time buckets
    sdpa_chunk: int | None = None  # NSA_SDPA_CHUNK: queries per chunk of the sdpa provider
    use_triton_sel: bool = True  # NSA_USE_TRITON_SEL: 0 keeps the selection branch on torch
    triton_sel_force: bool = False  # NSA_TRITON_SEL_FORCE: override the Ada (sm 8.9) default-off policy
    sel_allow_grad: bool = True  # NSA_SEL_TRITON_ALLOW_GRAD: 0 keeps sel on torch when gradients are needed
    sel_min_len: int | None = None  # NSA_SEL_TRITON_MIN_L (None: nsa.plan.rules.TRITON_MIN_L)
    use_triton_topn: bool = True  # NSA_USE_TRITON_TOPN: 0 keeps the top-n step on torch
    sel_backend: str = "auto"  # NSA_SEL_BACKEND: auto | torch | triton_sel (triton_sel = forced)
    # NSA_TORCH_CHUNK_BUDGET: elements of the chunked path's largest per-chunk intermediate (None: by device,
    # nsa.plan.rules.CHUNK_BUDGET)
    chunk_budget: int | None = None

    def fa2_enabled(self, branch: str) -> bool:
        if not self.use_fa2:
            return False
        return self.use_fa2_win if branch == "win" else self.use_fa2_cmp if branch == "cmp" else False

    def min_len(self, branch: str) -> int | None:
        return self.min_len_win if branch == "win" else self.min_len_cmp


# Toggles of earlier NSA code bases (nsa-vibe) that this library does not read, and what replaced each.
# Setting one warns once per process (RetiredToggleWarning), naming it and its replacement, instead of
# being silently ignored. docs/migration.md has the full table. (NSA_BATCH_SIZE and NSA_ACCUM are not here:
# they are the training showcase's batch settings, read by bench/train_showcase.py, not by the library.)
RETIRED = {
    "NSA_SDPA_AUDIT": "every routing decision is counted in nsa.telemetry.snapshot() and logged with NSA_DEBUG_LOG=1",
    "NSA_SEL_TRITON_GROUP": "the Triton selection kernel is always group-centric (one program per KV head's query "
    "group); there is nothing to switch",
    "NSA_DEBUG_COMPARE": "the parity tests assert against the fp64 oracle and report the largest error on failure "
    "(tests/gpu/test_triton_sel_parity_gpu.py)",
}


class RetiredToggleWarning(UserWarning):
    """An NSA_* toggle of an earlier code base is set; this library ignores it (the message says what replaced it)."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_retired(environ=None) -> list[str]:
    """Warn once per process for each retired toggle that is set; returns the names warned about now."""
    environ = os.environ if environ is None else environ
    fresh = []
    with _warned_lock:
        for name in RETIRED:
            if name in environ and name not in _warned:
                _warned.add(name)
                fresh.append(name)
    for name in fresh:
        warnings.warn(f"{name} is set but has no effect in this library: {RETIRED[name]}", RetiredToggleWarning,
                      stacklevel=3)
    return fresh


def reset_retired_warnings() -> None:
    with _warned_lock:
        _warned.clear()


@trace_constant  # under torch.compile: warned when the caller is traced (its lock is not traceable)
def _warn_retired_now() -> None:
    warn_retired()


def read() -> Toggles:
    """The toggles as the environment holds them now (and a one-time warning for each retired one set).
    Under torch.compile: as the environment holds them when the caller is traced (nsa.compiling)."""
    _warn_retired_now()
    pref_raw = os.environ.get("NSA_FA2_PREF_FP16")
    pref = None if pref_raw is None or pref_raw.strip() == "" else env_bool("NSA_FA2_PREF_FP16", True)
    t = Toggles(
        use_fa2=env_bool("NSA_USE_FA2", True),
        use_fa2_win=env_bool("NSA_USE_FA2_WIN", True),
        use_fa2_cmp=env_bool("NSA_USE_FA2_CMP", True),
        use_cudnn=env_bool("NSA_USE_CUDNN", True),
        dense_core=env_bool("NSA_DENSE_CORE", True),
        triton_window=env_bool("NSA_TRITON_WINDOW", True),
        triton_cmp_max_len=env_int("NSA_TRITON_CMP_MAX_LEN", TRITON_CMP_MAX_LEN, minimum=0),
        min_len_win=env_int("NSA_FA2_MIN_LEN_WIN", None),
        min_len_cmp=env_int("NSA_FA2_MIN_LEN_CMP", None),
        force=env_bool("NSA_FA2_FORCE", False),
        force_varlen=env_bool("NSA_FA2_FORCE_VARLEN", False),
        force_dense=env_bool("NSA_FA2_FORCE_DENSE", False),
        pref_fp16=pref,
        debug_timing=env_bool("NSA_DEBUG_TIMING", False),
        sdpa_chunk=env_int("NSA_SDPA_CHUNK", None, minimum=1),
        use_triton_sel=env_bool("NSA_USE_TRITON_SEL", True),
        triton_sel_force=env_bool("NSA_TRITON_SEL_FORCE", False),
        sel_allow_grad=env_bool("NSA_SEL_TRITON_ALLOW_GRAD", True),
        sel_min_len=env_int("NSA_SEL_TRITON_MIN_L", None),
        use_triton_topn=env_bool("NSA_USE_TRITON_TOPN", True),
        sel_backend=env_choice("NSA_SEL_BACKEND", SEL_BACKENDS, "auto"),
        chunk_budget=env_int("NSA_TORCH_CHUNK_BUDGET", None, minimum=1),
    )
    if t.force_varlen and t.force_dense:
        raise NSAInputError("NSA_FA2_FORCE_VARLEN=1 and NSA_FA2_FORCE_DENSE=1 contradict each other: set one")
    return t


def debug_log() -> bool:
    """NSA_DEBUG_LOG=1: nsa.telemetry logs each (branch, backend, reason)."""
    return env_bool("NSA_DEBUG_LOG", False)


def log_limit() -> int:
    """NSA_LOG_LIMIT: how many times each (branch, backend, reason) is logged (default 5)."""
    return env_int("NSA_LOG_LIMIT", 5)


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton's interpreter runs the kernels on CPU tensors (a forced kernel may run there)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def nsa_variables() -> dict[str, str]:
    """Every NSA_* variable set, by name (the reports record them)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("NSA_")}
