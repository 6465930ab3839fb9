"""pytest-xdist workers spread over the visible GPUs, each pinned to one of them.

Load it either way (both may be active; it is idempotent):
  - from tests/gpu/conftest.py:  `from ._pinning import pytest_xdist_auto_num_workers  # noqa: F401`
  - on the command line:         `python -m pytest -p ci.sessions.gpu_split tests/gpu -n auto` (the nox sessions)

Visible GPUs: NSA_GPU_LIST, else CUDA_VISIBLE_DEVICES, else every GPU `nvidia-smi` lists (torch as a
last resort, in the controller only). In the controller `-n auto` becomes workers_per_gpu() workers for each GPU
(pytest_xdist_auto_num_workers), and the list is exported as NSA_GPU_LIST for the workers.
Worker gwN: before anything touches CUDA (at import of this module, which happens before the test
modules and before any conftest below the one importing it), CUDA_VISIBLE_DEVICES is set to the N-th GPU
of NSA_GPU_LIST (modulo its length), so each worker's `cuda:0` is its own GPU. Stdlib only: importing
this never initializes CUDA.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

__all__ = ["pytest_xdist_auto_num_workers"]

LIST_ENV = "NSA_GPU_LIST"
PINNED_ENV = "NSA_GPU_PINNED"
PER_GPU_ENV = "NSA_WORKERS_PER_GPU"


def workers_per_gpu(n_gpus: int, environ=os.environ, cpus: int | None = None) -> int:
    """Workers sharing each GPU. A cold suite spends most of its time compiling Triton kernels on the CPU,
    so several workers per GPU keep both busy: one per core, at most 16 per GPU (tests/gpu/_sharing.py keeps
    them within the GPU's memory). NSA_WORKERS_PER_GPU overrides."""
    if environ.get(PER_GPU_ENV, "").strip():
        value = environ[PER_GPU_ENV].strip()
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{PER_GPU_ENV}={value!r}: expected a whole number >= 1")
        return int(value)
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(16, cpus // max(1, n_gpus)))


def visible_gpus(allow_torch: bool = True) -> list[str]:
    """GPU ids this process may use (NSA_GPU_LIST wins when set). Only the torch fallback, used when
    nvidia-smi is absent and allow_torch is true, initializes CUDA in this process."""
    for name in (LIST_ENV, "CUDA_VISIBLE_DEVICES"):
        if name in os.environ:
            return [x.strip() for x in os.environ[name].split(",") if x.strip() and x.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=60)
            if out.returncode == 0:
                return [x.strip() for x in out.stdout.splitlines() if x.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    if not allow_torch:
        return []
    try:  # no nvidia-smi: ask torch (initializes CUDA in this process, which runs no tests when it is the controller)
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPUs
        return []


def pin_worker(environ=os.environ) -> str | None:
    """In an xdist worker: set CUDA_VISIBLE_DEVICES to this worker's GPU. Returns it (None elsewhere)."""
    worker = environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    if environ.get(PINNED_ENV) == worker:
        return environ.get("CUDA_VISIBLE_DEVICES")
    if LIST_ENV in environ:
        gpus = [x for x in environ[LIST_ENV].split(",") if x]
    else:  # the controller exported nothing (explicit -n N): list them here, without touching CUDA
        gpus = visible_gpus(allow_torch=False) if environ is os.environ else []
    if not gpus:
        return None
    index = int("".join(ch for ch in worker if ch.isdigit()) or 0)
    gpu = gpus[index % len(gpus)]
    environ["CUDA_VISIBLE_DEVICES"] = gpu
    environ[PINNED_ENV] = worker
    return gpu


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own answer (one per CPU)
def pytest_xdist_auto_num_workers(config):
    gpus = visible_gpus()
    if gpus and LIST_ENV not in os.environ:
        os.environ[LIST_ENV] = ",".join(gpus)
    return len(gpus) * workers_per_gpu(len(gpus)) if gpus else None


pin_worker()
