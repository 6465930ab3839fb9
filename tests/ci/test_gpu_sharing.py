"""tests/gpu/_sharing.py: the lock that lets xdist workers share a GPU, and the rerun of a test that ran out of
GPU memory beside others (alone, reported)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

_spec = importlib.util.spec_from_file_location("gpu_sharing", Path(__file__).parents[1] / "gpu" / "_sharing.py")
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)


def _hold_shared(folder, seconds, started):
    lock = S.GpuLock(Path(folder))
    with lock.shared():
        started.set()
        time.sleep(seconds)


def test_exclusive_waits_for_shared_holders_and_shared_ones_share(tmp_path):
    ctx = mp.get_context("spawn")
    started = [ctx.Event() for _ in range(2)]
    holders = [ctx.Process(target=_hold_shared, args=(str(tmp_path), 1.0, e)) for e in started]
    for p in holders:
        p.start()
    assert all(e.wait(30) for e in started)  # two shared holders at once
    lock, t0 = S.GpuLock(tmp_path), time.monotonic()
    with lock.exclusive():
        waited = time.monotonic() - t0
    for p in holders:
        p.join(30)
    assert waited > 0.5, waited  # the rerun waited for the running tests


def _fake_item(fn):
    return SimpleNamespace(obj=fn, funcargs={}, _fixtureinfo=SimpleNamespace(argnames=()), user_properties=[])


@pytest.fixture
def worker_lock(tmp_path, monkeypatch):
    """As in an xdist worker that shares a GPU (no GPU here: emptying the cache does nothing)."""
    monkeypatch.setattr(S, "_LOCK", S.GpuLock(tmp_path))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_a_test_out_of_memory_is_rerun_alone_and_reported(worker_lock):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    item = _fake_item(flaky)
    assert S.pytest_pyfunc_call(item) is True and len(calls) == 2
    assert item.user_properties == [("gpu_oom_rerun", "CUDA out of memory. Tried to allocate 2.00 GiB")]


def test_a_triton_launch_out_of_memory_is_rerun_too(worker_lock):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Triton Error [CUDA]: out of memory")

    item = _fake_item(flaky)
    assert S.pytest_pyfunc_call(item) is True and len(calls) == 2
    assert item.user_properties == [("gpu_oom_rerun", "Triton Error [CUDA]: out of memory")]


@pytest.mark.parametrize("error", [AssertionError("wrong result"), RuntimeError("illegal memory access")])
def test_other_failures_are_not_rerun(worker_lock, error):
    calls = []

    def failing():
        calls.append(1)
        raise error

    with pytest.raises(type(error), match=str(error)):
        S.pytest_pyfunc_call(_fake_item(failing))
    assert len(calls) == 1


def test_outside_xdist_the_default_call_runs(monkeypatch):
    monkeypatch.setattr(S, "_LOCK", None)
    assert S.pytest_pyfunc_call(_fake_item(lambda: None)) is None


def test_big_tests_share_one_group():
    class Item(SimpleNamespace):
        def get_closest_marker(self, name):
            return name in self.marks or None

        def add_marker(self, mark):
            self.added.append(mark)

    big, small = Item(marks={S.BIG}, added=[]), Item(marks=set(), added=[])
    S.mark_big_tests([big, small])
    assert [m.kwargs.get("name", m.args[0] if m.args else None) for m in big.added] == [S.BIG] and not small.added
