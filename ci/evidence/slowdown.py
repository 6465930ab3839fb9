"""A test-only switch that deliberately slows a timed path, so a test can prove the bench gate fails.

    NSA_TEST_SLOWDOWN=<factor>     e.g. 3 makes every call wrapped by `slowed()` take ~3x as long

Nothing in nsa/ reads it: only the benches' timed functions that are wrapped with `slowed()` (the
headline bench, ci/evidence/bench_headline.py; other benches may import it the same way). After each call the
wrapper synchronizes the device, measures the call and spins for (factor - 1) times that duration, so the
slowdown is proportional on CPU and GPU alike. Unset, empty or 1: the function is returned unwrapped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

ENV = "NSA_TEST_SLOWDOWN"


def factor(environ=None) -> float:
    """The slowdown factor from NSA_TEST_SLOWDOWN (1.0 when unset); a bad value is an error, not ignored."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number >= 1, got {raw!r}") from None
    if not value >= 1.0:
        raise ValueError(f"{ENV} must be a number >= 1, got {raw!r}")
    return value


def slowed(fn: Callable, sync: Callable[[], None] | None = None, environ=None,
           clock: Callable[[], float] = time.perf_counter) -> Callable:
    """fn itself when no slowdown is asked; else a wrapper that makes each call ~factor times longer, as
    measured by `clock` (wall time by default; the CPU headline bench passes time.process_time)."""
    f = factor(environ)
    if f == 1.0:
        return fn

    def wrapper(*args, **kwargs):
        t0 = clock()
        out = fn(*args, **kwargs)
        if sync is not None:
            sync()
        t1 = clock()
        deadline = t1 + (f - 1.0) * (t1 - t0)
        while clock() < deadline:
            pass
        return out

    wrapper.__wrapped__ = fn
    wrapper.slowdown = f
    return wrapper
