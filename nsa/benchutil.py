"""Shared helpers of the smoke and the benches: environment metadata, timing, peak memory, CSV/JSON output.

- `env_metadata(device)`: python, torch, CUDA, device name, git commit (None outside a git checkout),
  date, CPU threads, versions of triton / flash-attn when installed, and the NSA_* variables set.
- `time_fn(fn, iters, warmup, device)`: per-iteration times (CUDA events on a GPU, perf_counter on CPU)
  and their median.
- `peak_memory(fn, device)`: peak memory of one call: torch.cuda.max_memory_allocated above the
  starting allocation on a GPU; on CPU the rise of the process's peak RSS (VmHWM, reset through
  /proc/self/clear_refs), or ru_maxrss when that is not possible (then it is a process-wide high-water
  mark and says so in `method`).
- `write_csv(path, rows)`, `write_json(path, obj)`.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

import torch

from .toggles import nsa_variables

REPO_ROOT = Path(__file__).resolve().parent.parent

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; anything else as given (an unavailable cuda is an error)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine")
    return dev


def git_commit(short: bool = True) -> str | None:
    """The checkout's commit, or None (not a git checkout, no commit yet, git missing)."""
    cmd = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
    try:
        res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.strip() or None


def git_dirty() -> bool | None:
    try:
        res = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(res.stdout.strip()) if res.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return cpu


def _path_name(arg: str) -> str:
    """An absolute path on the command line as its file name (an option like --csv=/x/y.csv too)."""
    key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    return key + eq + (os.path.basename(value) if os.path.isabs(value) else value)


def env_metadata(device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    try:
        import nsa

        nsa_version = nsa.__version__
    except Exception:  # noqa: BLE001 - metadata must never fail the run
        nsa_version = None
    meta = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "triton": _version("triton"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "nsa": nsa_version,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "argv": [_path_name(a) for a in sys.argv],  # results travel without the machine's directories
        "nsa_env": nsa_variables(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        meta["gpu_capability"] = f"{props.major}.{props.minor}"
        meta["gpu_memory_gib"] = round(props.total_memory / 2**30, 2)
        meta["cudnn"] = torch.backends.cudnn.version()
    return meta


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], iters: int = 10, warmup: int = 2, device="cpu") -> dict:
    """Run fn `warmup` times, then time `iters` calls one by one. Returns median/mean/min/max ms and all."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    device = torch.device(device)
    for _ in range(max(warmup, 0)):
        fn()
    sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": min(times),
            "max_ms": max(times), "iters": iters, "warmup": warmup, "times_ms": times}


class Stopwatch:
    """`with Stopwatch(device) as sw: ...`; then sw.ms (synchronizes a CUDA device at both ends)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.ms = float("nan")

    def __enter__(self):
        sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.ms = (time.perf_counter() - self._t0) * 1e3
        return False


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


_MALLOPT_DONE = None


def exact_cpu_allocations() -> bool:
    """glibc: serve every allocation >= 64 KiB by mmap and return it on free (mallopt M_MMAP_THRESHOLD,
    which also turns off the dynamic threshold), so RSS follows tensor allocations instead of staying
    at a high-water mark of reused heap. Returns whether it applied."""
    global _MALLOPT_DONE
    if _MALLOPT_DONE is None:
        _MALLOPT_DONE = False
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            m_trim_threshold, m_mmap_threshold = -1, -3
            _MALLOPT_DONE = bool(libc.mallopt(m_mmap_threshold, 64 * 1024)) and bool(
                libc.mallopt(m_trim_threshold, 128 * 1024))
        except (OSError, AttributeError):
            pass
    return _MALLOPT_DONE


def peak_memory(fn: Callable[[], object], device="cpu") -> dict:
    """Peak memory of one call of fn above what was in use before it: {"peak_bytes", "method"}."""
    device = torch.device(device)
    # No gc.collect(): tensors are freed by reference counting, and a full collection with torch loaded
    # costs more than the small measurements it would precede.
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device) - base),
                "method": "cuda.max_memory_allocated"}
    exact = exact_cpu_allocations()
    rss = _status_kb("VmRSS")
    if rss is not None and _reset_hwm():
        fn()
        hwm = _status_kb("VmHWM")
        how = "VmHWM-VmRSS (clear_refs" + (", mmap threshold 64 KiB)" if exact else ")")
        return {"peak_bytes": max(0, (hwm - rss) * 1024), "method": how}
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_bytes": max(0, (after - before) * 1024),
            "method": "ru_maxrss rise (process high-water mark: 0 when below an earlier peak)"}


def _clean(x):
    """JSON-safe: NaN/inf -> None, tensors and numpy scalars -> Python numbers, paths -> str."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, torch.Tensor):
        return _clean(x.tolist())
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    if hasattr(x, "item") and callable(x.item):
        return _clean(x.item())
    return x


def write_json(path: str | os.PathLike, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")
    return path


def write_csv(path: str | os.PathLike, rows: Iterable[dict], columns: list[str] | None = None) -> Path:
    """Rows of dicts -> CSV with a header (columns: given order, else first-seen order). NaN -> empty."""
    rows = list(rows)
    if columns is None:
        columns = []
        for r in rows:
            columns += [c for c in r if c not in columns]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _csv_value(r.get(c)) for c in columns})
    return path


def _csv_value(x):
    if x is None:
        return ""
    if isinstance(x, float):
        if not math.isfinite(x):
            return ""
        return f"{x:.6g}"
    return x


def sidecar_path(csv_path: str | os.PathLike) -> Path:
    """The JSON beside a CSV: decode.csv -> decode.json."""
    return Path(csv_path).with_suffix(".json")


def read_csv(path: str | os.PathLike) -> list[dict]:
    with Path(path).open(newline="") as fh:
        return list(csv.DictReader(fh))


def fmt_bytes(n) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def console():
    """A rich Console when rich is installed, else None (callers then print plain text)."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    # Not a terminal (CI logs, pipes): rich would wrap tables at 80 columns; give them room.
    return Console() if sys.stdout.isatty() else Console(width=200)


def print_table(title: str, columns: list[str], rows: list[list], con=None) -> None:
    """A rich table, or aligned plain text without rich."""
    con = con if con is not None else console()
    rows = [[("-" if v is None else str(v)) for v in r] for r in rows]
    if con is not None:
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*r)
        con.print(table)
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
