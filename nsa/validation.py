"""Input checks shared by every backend: each failure names the argument and what is accepted.

Nothing here may silently fix an input: a wrong dtype, shape or device is an error, never a cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compiling import compiling

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class NSAInputError(ValueError):
    """A bad argument to an NSA function (the message names it)."""


@dataclass(frozen=True)
class Shapes:
    B: int
    T: int
    Hq: int
    Hkv: int
    Dk: int
    Dv: int

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv


def _check_tensor(name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise NSAInputError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise NSAInputError(f"{name} must have {ndim} dims {layout}, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise NSAInputError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def check_qkv(q, k, v, gates) -> Shapes:
    """Validate q [B,T,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], gates [B,T,Hq,3]; return the sizes."""
    _check_tensor("q", q, 4, "[B, T, Hq, Dk]")
    _check_tensor("k", k, 4, "[B, T, Hkv, Dk]")
    _check_tensor("v", v, 4, "[B, T, Hkv, Dv]")
    _check_tensor("gates", gates, 4, "[B, T, Hq, 3]")
    B, T, Hq, Dk = q.shape
    for name, x in (("k", k), ("v", v), ("gates", gates)):
        if x.device != q.device:
            raise NSAInputError(f"{name} is on {x.device} but q is on {q.device}: all inputs must share a device")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise NSAInputError(f"{name} has dtype {x.dtype} but q has {q.dtype}: q, k and v must share a dtype")
    if k.shape[:2] != (B, T) or v.shape[:2] != (B, T):
        raise NSAInputError(
            f"k and v must have the batch and length of q {(B, T)}, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    Hkv = k.shape[2]
    if v.shape[2] != Hkv:
        raise NSAInputError(f"v must have Hkv={Hkv} heads like k, got {v.shape[2]}")
    if Hkv < 1 or Hq % Hkv:
        raise NSAInputError(f"q heads (Hq={Hq}) must be a positive multiple of k/v heads (Hkv={Hkv})")
    if k.shape[3] != Dk:
        raise NSAInputError(f"k head dim ({k.shape[3]}) must equal q head dim (Dk={Dk})")
    if Dk < 1 or v.shape[3] < 1:
        raise NSAInputError(f"head dims must be positive, got Dk={Dk}, Dv={v.shape[3]}")
    if tuple(gates.shape) != (B, T, Hq, 3):
        raise NSAInputError(f"gates must have shape [B, T, Hq, 3] = {(B, T, Hq, 3)}, got {tuple(gates.shape)}")
    return Shapes(B, T, Hq, Hkv, Dk, v.shape[3])


def check_branch_kv(name: str, kv, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
    """Per-branch K/V (module with independent projections) must match the main k/v's layout."""
    if not (isinstance(kv, (tuple, list)) and len(kv) == 2):
        raise NSAInputError(f"{name} must be a (k, v) pair of tensors")
    for part, x, like in (("k", kv[0], like_k), ("v", kv[1], like_v)):
        _check_tensor(f"{name}[{part}]", x, 4, "like the main " + part)
        if tuple(x.shape) != tuple(like.shape) or x.dtype != like.dtype or x.device != like.device:
            raise NSAInputError(
                f"{name}[{part}] must match the main {part}: shape {tuple(like.shape)}, {like.dtype}, "
                f"{like.device}; got {tuple(x.shape)}, {x.dtype}, {x.device}"
            )


def check_cu_seqlens(cu_seqlens, shapes: Shapes, device: torch.device) -> list[int] | None:
    """Validate packed-sequence offsets; return them on the host (one small copy, varlen calls only), or None
    under torch.compile, where the values are checked on the device instead."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise NSAInputError(f"cu_seqlens must be a torch.Tensor of int32, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise NSAInputError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise NSAInputError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise NSAInputError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if shapes.B != 1:
        raise NSAInputError(f"with cu_seqlens, sequences are packed along T and B must be 1, got B={shapes.B}")
    if compiling():
        # Inside a compiled graph the values cannot reach the host without a graph break: the same checks
        # run on the device, in the graph (torch.compile fails the call with this message). Planning then
        # bounds every sequence's length by T (nsa.plan: CallContext.max_len).
        cu = cu_seqlens
        ok = (cu[0] == 0) & (cu[1:] >= cu[:-1]).all() & (cu[-1] == shapes.T)
        # (no T in the message: formatting it would fix a dynamic length to this trace's value)
        torch._assert_async(ok, "cu_seqlens must start at 0, be non-decreasing and end at the packed length T "
                                "(q.shape[1])")
        return None
    host = cu_seqlens.tolist()
    if host[0] != 0:
        raise NSAInputError(f"cu_seqlens must start at 0, got {host[0]}")
    if any(b < a for a, b in zip(host, host[1:])):
        raise NSAInputError(f"cu_seqlens must be non-decreasing, got {host[:16]}{'...' if len(host) > 16 else ''}")
    if host[-1] != shapes.T:
        raise NSAInputError(f"cu_seqlens must end at the packed length T={shapes.T}, got {host[-1]}")
    return host


def check_block_indices(block_indices, shapes: Shapes, n_sel: int, device: torch.device) -> None:
    if not isinstance(block_indices, torch.Tensor):
        raise NSAInputError(f"block_indices must be a torch.Tensor, got {type(block_indices).__name__}")
    if block_indices.dtype not in (torch.int32, torch.int64):
        raise NSAInputError(f"block_indices must be int32 or int64, got {block_indices.dtype}")
    want = (shapes.B, shapes.T, shapes.Hkv, n_sel)
    if tuple(block_indices.shape) != want:
        raise NSAInputError(
            f"block_indices must have shape [B, T, Hkv, n_sel] = {want}, got {tuple(block_indices.shape)}"
        )
    if block_indices.device != device:
        raise NSAInputError(f"block_indices is on {block_indices.device} but q is on {device}")
