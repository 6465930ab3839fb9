"""Device facts shared by the kernels and the guards of planning: a failed guard (reason code + message),
the GPU's compute capability (cached per device index) and whether launches target a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..compiling import trace_constant
from ..hooks import HOOKS

ADA = (8, 9)


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


@trace_constant  # under torch.compile: read once when the caller is traced (nsa.compiling)
def device_capability(device: torch.device) -> tuple[int, int] | None:
    if HOOKS.pretend_gpu is not None:
        return HOOKS.pretend_gpu
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def on_gpu(device: torch.device) -> bool:
    """Whether kernels launched for tensors on `device` run on a GPU (launch options such as num_warps apply),
    not in Triton's interpreter."""
    return device.type == "cuda" or HOOKS.pretend_gpu is not None


@lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
