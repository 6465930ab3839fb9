"""Tensor-memory-accelerator (TMA) copies of K/V tiles for the selection kernels (Hopper and newer).

A host-side descriptor over a [B, T, H, D] tensor lets a kernel copy the [BLOCK_N, D] tile of one head that
starts at any token with one instruction, straight into shared memory: no per-element addresses or masks
in registers, and Triton's pipeliner overlaps the copies with the block loop. Rows outside [0, T) and
columns past D read as zeros, so a tile may start before token 0 (an id of -1) or run past T. Rows inside
[0, T) that the kernel must not attend (after the query, past the block's end) are read and masked in the
scores; like dense attention kernels, non-finite K/V values there are not supported.

On an H100 (bf16, Hq=64, Hkv=4, D=128, 16 blocks of 64, T=64k) the selection forward went from 18.7 to
16.7-17.0 ms with these copies (bench/kernel_variants.py --kernel sel_fwd).
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from packaging.version import Version

from ...compiling import compiling
from ...hooks import HOOKS
from ..device import device_capability, on_gpu

# nsa.hooks.HOOKS.tma = False: pointer loads everywhere (GPU tests compare both paths); HOOKS.tma_force:
# descriptors on any device and dtype (Triton's interpreter runs them on CPU tensors).
USED: Counter = Counter()  # descriptors made per kernel: tests check which path ran
MIN_TRITON = Version("3.4.0")  # host-side descriptors with a `load` method in kernels
DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def triton_has_descriptors() -> bool:
    import triton

    return Version(triton.__version__.split("+")[0]) >= MIN_TRITON


def supported(*tensors: torch.Tensor) -> bool:
    """Whether every tensor can be read through a descriptor: CUDA sm 9.0+, 16-bit, unit last stride, other
    strides and the base 16-byte aligned, and a Triton that has host-side descriptors."""
    force = HOOKS.tma_force
    if not (HOOKS.tma or force) or not triton_has_descriptors():
        return False
    for t in tensors:
        if t.dim() != 4 or t.stride(-1) != 1:
            return False
        if not force and (not on_gpu(t.device) or t.dtype not in DTYPES or device_capability(t.device)[0] < 9):
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
        # While Dynamo traces (torch.compile) a tensor has no data pointer yet: the operators that take this
        # answer at trace time realign a misaligned base when they run (nsa.kernels.ops.aligned)
        if not compiling() and t.data_ptr() % 16:
            return False
    return True


def tile_descriptor(t: torch.Tensor, block_n: int, block_d: int, kernel: str):
    """Descriptor of [B, T, H, D] `t` whose loads at [b, token, h, 0] give a [1, block_n, 1, block_d] tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    USED[kernel] += 1
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_n, 1, block_d])


def kv_descriptors(use: bool, k: torch.Tensor, v: torch.Tensor, block_n: int, block_dk: int, block_dv: int,
                   kernel: str):
    """(K, V) arguments of a kernel with a TMA constexpr: tile descriptors when `use`, else the tensors
    themselves (the kernel then ignores them and loads through pointers)."""
    if not use:
        return k, v
    return tile_descriptor(k, block_n, block_dk, kernel), tile_descriptor(v, block_n, block_dv, kernel)


def tail_descriptor(use: bool, k: torch.Tensor, block_n: int, block_dk2: int, kernel: str):
    """The K argument of a kernel's second column tile (common.split_dim): a descriptor of [block_n, block_dk2]
    tiles when `use` and the tile exists, else k itself (ignored by the kernel)."""
    return tile_descriptor(k, block_n, block_dk2, kernel) if use and block_dk2 else k


__all__ = ["supported", "triton_has_descriptors", "tile_descriptor", "kv_descriptors", "tail_descriptor", "USED"]
