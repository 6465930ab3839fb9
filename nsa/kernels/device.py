"""Device facts shared by the kernels and the guards of planning: a failed guard (reason code + message)
and the GPU's compute capability (cached per device index)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

ADA = (8, 9)


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
