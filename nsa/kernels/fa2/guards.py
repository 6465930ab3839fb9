"""Guards run before every FlashAttention-2 call: each failure is a short reason code plus a message.

A failed guard never crashes a kernel: planning (nsa.plan) either raises NSAInputError (the backend was forced)
or falls back to the next provider and counts (branch, served backend, reason) in nsa.telemetry.

Reason codes (docs/backends.md): disabled, not_cuda, sm_unsupported, ada_policy, dtype, head_dim,
head_dim_sm, cu_seqlens, force_dense_packed, below_min_len.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from ...toggles import Toggles
from ..device import ADA, Failure, device_capability

FA2_DTYPES = (torch.float16, torch.bfloat16)
FA2_MAX_HEAD_DIM = 256
# flash-attn / PyTorch FA-2: the backward for head dim > 192 needs the shared memory of sm80 / sm90
# (A100, H100); sm86 / sm87 / sm89 run the forward up to 256 but the backward only up to 192.
SM8X_SMALL_SMEM_BWD_MAX = 192
THRESHOLDS_FILE = Path(__file__).resolve().parents[2] / "fa2_thresholds.json"
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


def padded_head_dim(dk: int, dv: int) -> int:
    """FA-2 needs one head dim for q, k and v: the smaller side is zero-padded to max(dk, dv)."""
    return max(dk, dv)


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
    table = thresholds(path)
    cls = gpu_class(capability)
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
