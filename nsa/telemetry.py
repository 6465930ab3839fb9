"""Which backend served each branch, and why: counters and rate-limited debug logs.

Every routing decision calls `record(branch, backend, reason)`. A fallback is therefore always counted
and visible: `snapshot()` returns the counters (the smoke and GPU reports include them), `reset()`
clears them. `event()` counts provider events that are not routing decisions (a contiguity copy);
`add_time()` fills the NSA_DEBUG_TIMING buckets; both appear in the snapshot.
With NSA_DEBUG_LOG=1 each (branch, backend, reason) is also logged, at most
NSA_LOG_LIMIT times (default 5). Both variables are read at call time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter

log = logging.getLogger("nsa")
_lock = threading.Lock()
_counts: Counter = Counter()
_logged: Counter = Counter()
_events: Counter = Counter()  # (branch, backend, event): things that are not routing decisions
_times: dict = {}  # bucket -> [calls, total ms] (NSA_DEBUG_TIMING=1)


def _log_limit() -> int:
    try:
        return int(os.environ.get("NSA_LOG_LIMIT", "5"))
    except ValueError:
        return 5


def record(branch: str, backend: str, reason: str = "ok", **details) -> None:
    key = (branch, backend, reason)
    with _lock:
        _counts[key] += 1
        emit = os.environ.get("NSA_DEBUG_LOG", "0") == "1" and _logged[key] < _log_limit()
        if emit:
            _logged[key] += 1
    if emit:
        extra = " ".join(f"{k}={v}" for k, v in details.items())
        log.warning("nsa.route branch=%s backend=%s reason=%s %s", branch, backend, reason, extra)


def event(branch: str, backend: str, name: str) -> None:
    """Count something a provider did that is not a routing decision (e.g. "contiguous_copy")."""
    with _lock:
        _events[(branch, backend, name)] += 1


def add_time(bucket: str, ms: float) -> None:
    """Add one timed call to a bucket (the router times provider calls when NSA_DEBUG_TIMING=1)."""
    with _lock:
        calls, total = _times.get(bucket, (0, 0.0))
        _times[bucket] = (calls + 1, total + float(ms))


# Reasons that are not fallbacks: the chosen path ran ("ok"), the caller forced it ("forced..."), or a
# decode step ran the torch branches on the cache ("decode").
NORMAL_REASONS = ("ok", "decode")


def is_normal(reason: str) -> bool:
    return reason in NORMAL_REASONS or reason.startswith("forced")


def snapshot() -> dict:
    """{"counts": [{"branch", "backend", "reason", "calls"}...], "fallbacks": n, "calls": n,
    "events": [{"branch", "backend", "event", "calls"}...], "timings": {bucket: {"calls", "total_ms"}}}."""
    with _lock:
        items = sorted(_counts.items())
        events = sorted(_events.items())
        times = dict(sorted(_times.items()))
    rows = [{"branch": b, "backend": be, "reason": r, "calls": n} for (b, be, r), n in items]
    fallbacks = sum(n for (_, _, r), n in items if not is_normal(r))
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
