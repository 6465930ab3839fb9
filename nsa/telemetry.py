"""Which backend served each branch, and why: counters and rate-limited debug logs.

Every routing decision calls `record(branch, backend, reason)`. A fallback is therefore always counted
and visible: `snapshot()` returns the counters (the smoke and GPU reports include them), `reset()`
clears them. `event()` counts provider events that are not routing decisions (a contiguity copy);
`add_time()` fills the NSA_DEBUG_TIMING buckets; both appear in the snapshot.
With NSA_DEBUG_LOG=1 each (branch, backend, reason) is also logged, at most
NSA_LOG_LIMIT times (default 5). Both variables are read at call time.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter

from .compiling import compiling, trace_constant

log = logging.getLogger("nsa")
_lock = threading.Lock()
_counts: Counter = Counter()
_logged: Counter = Counter()
_events: Counter = Counter()  # (branch, backend, event): things that are not routing decisions
_times: dict = {}  # bucket -> [calls, total ms] (NSA_DEBUG_TIMING=1)


@trace_constant  # under torch.compile: counted once per traced graph (nsa.compiling)
def record(branch: str, backend: str, reason: str = "ok", **details) -> None:
    from .toggles import debug_log, log_limit

    key = (branch, backend, reason)
    limit = log_limit() if debug_log() else 0  # read before taking the lock: a malformed value raises
    with _lock:
        _counts[key] += 1
        emit = _logged[key] < limit
        if emit:
            _logged[key] += 1
    if emit:
        extra = " ".join(f"{k}={v}" for k, v in details.items())
        log.warning("nsa.route branch=%s backend=%s reason=%s %s", branch, backend, reason, extra)


@trace_constant
def event(branch: str, backend: str, name: str) -> None:
    """Count something a provider did that is not a routing decision (e.g. "contiguous_copy")."""
    with _lock:
        _events[(branch, backend, name)] += 1


def add_time(bucket: str, ms: float) -> None:
    """Add one timed call to a bucket (the router times provider calls when NSA_DEBUG_TIMING=1)."""
    with _lock:
        calls, total = _times.get(bucket, (0, 0.0))
        _times[bucket] = (calls + 1, total + float(ms))


def timing_on() -> bool:
    """NSA_DEBUG_TIMING=1, read at call time (the toggle's parser lives in nsa.toggles). Every attention
    call passes here, the torch backend's too, so this is also where retired toggles are warned about."""
    from .toggles import env_bool, warn_retired

    if compiling():  # no synchronized timers inside a compiled graph (docs/compile.md)
        return False
    warn_retired()
    return env_bool("NSA_DEBUG_TIMING", False)


def _sync_for(args) -> None:
    for a in args:
        if getattr(a, "is_cuda", False):
            import torch

            torch.cuda.synchronize(a.device)
            return


def timed(bucket: str, fn):
    """fn, timed into `bucket` when NSA_DEBUG_TIMING=1 (synchronized on CUDA input), else fn itself."""
    if not timing_on():
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _sync_for(args)
        t0 = time.perf_counter()
        res = fn(*args, **kwargs)
        _sync_for(args)
        add_time(bucket, (time.perf_counter() - t0) * 1e3)
        return res

    return wrapper


class stopwatch:  # noqa: N801 - used as a context manager, like a function
    """`with stopwatch(tensor) as sw: ...` then sw.ms: wall time, synchronized when tensor is on CUDA."""

    def __init__(self, *tensors):
        self.tensors, self.ms = tensors, 0.0

    def __enter__(self):
        _sync_for(self.tensors)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync_for(self.tensors)
        self.ms = (time.perf_counter() - self.t0) * 1e3
        return False


def _desc(name: str, t) -> str:
    return f"{name}={tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" if t is not None else f"{name}=None"


def log_call(executor: str, steps: dict, tensors: dict, total_ms: float, before: dict) -> None:
    """NSA_DEBUG_TIMING=1: one log line per attention call: path (executor, each step's provider and
    reason), input shapes and dtypes, device, total time and the time each branch bucket took in it."""
    with _lock:
        now = dict(_times)
    spent = {k: round(v[1] - before.get(k, (0, 0.0))[1], 3) for k, v in sorted(now.items())
             if v[0] != before.get(k, (0, 0.0))[0]}
    device = next((str(t.device) for t in tensors.values() if t is not None), "?")
    path = " ".join(f"{name}:{s.provider}/{s.reason}" for name, s in steps.items())
    shapes = " ".join(_desc(n, t) for n, t in tensors.items())
    log.warning("nsa.timing executor=%s path=[%s] %s device=%s total_ms=%.3f branch_ms=%s",
                executor, path, shapes, device, total_ms, spent)


def times_now() -> dict:
    with _lock:
        return dict(_times)


# Reasons that are not fallbacks: the chosen path ran ("ok"), the caller forced it ("forced..."), a
# decode step ran the torch branches on the cache ("decode"), or torch.compile traced the fused pipeline
# as separate operators ("compile": nsa.plan.rules.COMPILE_NO_DENSE_CORE).
NORMAL_REASONS = ("ok", "decode", "compile")


def is_normal(reason: str) -> bool:
    return reason in NORMAL_REASONS or reason.startswith("forced")


# Decisions whose every reason is normal: the "core" step of a fused call says whether its steps ran as one
# autograd node (nsa.run.dense_core) and, when not, why (packed input, head dims padded, NSA_DENSE_CORE=0,
# ...). The same kernels run either way, and a step that fell back is counted on that step.
NEVER_FALLBACK = ("core",)


def is_fallback(branch: str, reason: str) -> bool:
    return branch not in NEVER_FALLBACK and not is_normal(reason)


def snapshot() -> dict:
    """{"counts": [{"branch", "backend", "reason", "calls"}...], "fallbacks": n, "calls": n,
    "events": [{"branch", "backend", "event", "calls"}...], "timings": {bucket: {"calls", "total_ms"}}}."""
    with _lock:
        items = sorted(_counts.items())
        events = sorted(_events.items())
        times = dict(sorted(_times.items()))
    rows = [{"branch": b, "backend": be, "reason": r, "calls": n} for (b, be, r), n in items]
    fallbacks = sum(n for (b, _, r), n in items if is_fallback(b, r))
    return {"counts": rows, "calls": sum(n for _, n in items), "fallbacks": fallbacks,
            "events": [{"branch": b, "backend": be, "event": e, "calls": n} for (b, be, e), n in events],
            "timings": {k: {"calls": c, "total_ms": round(t, 4)} for k, (c, t) in times.items()}}


def served(branch: str) -> dict:
    """calls per backend for one branch, e.g. {"torch": 3}."""
    with _lock:
        out: Counter = Counter()
        for (b, be, _), n in _counts.items():
            if b == branch:
                out[be] += n
    return dict(out)


def reset() -> None:
    with _lock:
        _counts.clear()
        _logged.clear()
        _events.clear()
        _times.clear()
