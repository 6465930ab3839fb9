"""Several pytest-xdist workers on one GPU (tests/gpu/_pinning.py decides how many).

A cold GPU suite is mostly Triton compiling kernels on the CPU, so workers share each GPU. Their memory
is kept in bounds three ways:
- tests marked `big_gpu_memory` (paper-size heads, 64k tokens, more than 2**31 elements) go to one xdist
  group, so at most one of them runs at a time (`--dist loadgroup`);
- each worker returns its cached blocks to the driver after every test;
- a test that still runs out of GPU memory while other tests run is run again alone: it waits for the
  running tests to finish and keeps the others from starting (a reader-writer lock over two files). Each
  rerun is reported (junit property `gpu_oom_rerun`, and a line in the terminal summary), never hidden.
Outside xdist (one process) none of this applies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

import pytest
import torch

BIG = "big_gpu_memory"
WORKER = os.environ.get("PYTEST_XDIST_WORKER")


class GpuLock:
    """Shared for ordinary tests, exclusive for a rerun. The gate lets a waiting exclusive holder in: new
    shared holders pass the gate first, and an exclusive holder keeps it closed while it waits."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.gate = open(folder / "gate", "a+")  # noqa: SIM115 - held for the worker's life
        self.main = open(folder / "main", "a+")  # noqa: SIM115

    @contextlib.contextmanager
    def shared(self):
        fcntl.flock(self.gate, fcntl.LOCK_SH)
        fcntl.flock(self.main, fcntl.LOCK_SH)
        fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.main, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def exclusive(self):
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        fcntl.flock(self.main, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.main, fcntl.LOCK_UN)
            fcntl.flock(self.gate, fcntl.LOCK_UN)


_LOCK = None
if WORKER and torch.cuda.is_available():
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "run")
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-")
    _LOCK = GpuLock(Path(tempfile.gettempdir()) / f"nsa-gpu-share-{run}-{gpu}")


def out_of_memory(e: BaseException) -> bool:
    """torch's allocator raises OutOfMemoryError; Triton's launcher, when the driver cannot reserve a launch's
    local or scratch memory, raises a plain RuntimeError ("Triton Error [CUDA]: out of memory")."""
    return isinstance(e, torch.OutOfMemoryError) or (type(e) is RuntimeError and "[CUDA]: out of memory" in str(e))


def mark_big_tests(items) -> None:
    for item in items:
        if item.get_closest_marker(BIG):
            item.add_marker(pytest.mark.xdist_group(BIG))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if _LOCK is None:
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    try:
        try:
            with _LOCK.shared():
                pyfuncitem.obj(**args)
            return True
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            first = str(e).splitlines()[0]
        torch.cuda.empty_cache()
        pyfuncitem.user_properties.append(("gpu_oom_rerun", first))
        with _LOCK.exclusive():
            pyfuncitem.obj(**args)
        return True
    finally:
        torch.cuda.empty_cache()


_RERUNS: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _RERUNS.extend((report.nodeid, why) for key, why in report.user_properties if key == "gpu_oom_rerun")


def pytest_terminal_summary(terminalreporter):
    if _RERUNS:
        terminalreporter.section("tests rerun alone after running out of GPU memory beside other workers")
        for nodeid, why in _RERUNS:
            terminalreporter.write_line(f"{nodeid}: {why}")
