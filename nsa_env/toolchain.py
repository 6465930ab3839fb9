"""Facts about the build and JIT toolchain of this machine, for `nsa-env doctor`.

    facts(build_modules)  -> {"cpus", "mem_available_gib", "env", "cc", "python_h", "cuda_home", "libcuda",
                              "build_modules", "glibc", "wheel_glibc"}

Each fact is looked up the way its consumer looks it up: the C compiler and Python.h as Triton's launcher
build does (CC, else gcc, else clang; sysconfig's include dir), CUDA_HOME as torch.utils.cpp_extension
does (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda), libcuda.so.1 as Triton's driver does
(TRITON_LIBCUDA_PATH, `ldconfig -p`, LD_LIBRARY_PATH). Memory and cores honour cgroup limits (containers).
Nothing here raises: a fact that cannot be read is None, with the reason where it helps.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

BUILD_ENV = ("MAX_JOBS", "NVCC_THREADS", "CC", "CUDA_HOME", "CUDA_PATH", "TRITON_LIBCUDA_PATH",
             "FLASH_ATTN_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "PIP_NO_BUILD_ISOLATION")
GIB = 2**30
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


# --- memory and cores --------------------------------------------------------------------------------------


def _cgroup_memory_left() -> int | None:
    """Bytes the cgroup (v2, else v1) still allows, or None without a limit."""
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read(limit_f), _read(usage_f)
        if limit and limit.isdigit() and int(limit) < 2**60:
            return max(0, int(limit) - int(usage or 0))
    return None


def memory_available_gib() -> float | None:
    meminfo = _read("/proc/meminfo") or ""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)
    avail = int(m.group(1)) * 1024 if m else None
    left = _cgroup_memory_left()
    if avail is None or (left is not None and left < avail):
        avail = left
    return None if avail is None else round(avail / GIB, 1)


def cpus() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = (_read("/sys/fs/cgroup/cpu.max") or "max").split()
    if quota and quota[0].isdigit() and len(quota) > 1 and int(quota[1]):
        n = min(n, max(1, int(quota[0]) // int(quota[1])))
    return n


# --- compilers and headers ---------------------------------------------------------------------------------


def c_compiler() -> dict[str, Any]:
    cc = os.environ.get("CC")
    if cc:
        return {"path": shutil.which(cc), "from": "CC", "name": cc}
    for name in ("gcc", "clang"):
        if path := shutil.which(name):
            return {"path": path, "from": "PATH", "name": name}
    return {"path": None, "from": None, "name": None}


def python_header() -> dict[str, Any]:
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; Triton switches to posix_prefix the same way
        scheme = "posix_prefix"
    include = sysconfig.get_paths(scheme=scheme)["include"]
    header = Path(include) / "Python.h"
    return {"include": include, "found": header.exists()}


def cuda_home() -> dict[str, Any]:
    """torch.utils.cpp_extension's CUDA_HOME search, and the nvcc release found there."""
    home, source = None, None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            home, source = os.environ[var], var
            break
    if home is None and (nvcc := shutil.which("nvcc")):
        home, source = os.path.dirname(os.path.dirname(nvcc)), "nvcc on PATH"  # not resolved, as torch does
    if home is None and Path("/usr/local/cuda").exists():
        home, source = "/usr/local/cuda", "/usr/local/cuda"
    out: dict[str, Any] = {"path": home, "from": source, "nvcc": None, "nvcc_version": None, "headers": None,
                           "toolkits": sorted(str(p.parent.parent) for p in Path("/usr/local").glob("cuda*/bin/nvcc"))}
    if home:
        nvcc = Path(home) / "bin" / "nvcc"
        out["headers"] = (Path(home) / "include" / "cuda_runtime.h").exists()
        if nvcc.exists():
            out["nvcc"] = str(nvcc)
            text = _run([str(nvcc), "--version"]) or ""
            m = re.search(r"release (\d+\.\d+)", text)
            out["nvcc_version"] = m.group(1) if m else None
    return out


def libcuda() -> dict[str, Any]:
    """Folders holding libcuda.so.1 (what Triton >= 3.6 links) and libcuda.so (what older Triton links)."""
    if path := os.environ.get("TRITON_LIBCUDA_PATH"):
        dirs, source = [path], "TRITON_LIBCUDA_PATH"
    else:
        ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else None)
        listing = (_run([ldconfig, "-p"]) or "") if ldconfig else ""
        dirs = sorted({str(Path(ln.split()[-1]).parent) for ln in listing.splitlines() if "libcuda.so.1" in ln})
        source = "ldconfig -p"
        if not dirs:
            dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
            source = "LD_LIBRARY_PATH"
    return {
        "from": source,
        "so1_dirs": [d for d in dirs if (Path(d) / "libcuda.so.1").exists()],
        "so_dirs": [d for d in dirs if (Path(d) / "libcuda.so").exists()],
    }


def build_modules(names: list[str]) -> dict[str, bool]:
    """Which modules a --no-build-isolation build would import are importable here (not imported)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            out[name] = False
    return out


# --- glibc -------------------------------------------------------------------------------------------------


def host_glibc() -> str | None:
    lib, version = platform.libc_ver()
    return version if lib == "glibc" and version else None


def tag_glibc(tag: str) -> tuple[int, int] | None:
    """The glibc a wheel platform tag promises to need: manylinux_2_28_x86_64 -> (2, 28)."""
    m = re.match(r"^manylinux_(\d+)_(\d+)_", tag)
    if m:
        return int(m.group(1)), int(m.group(2))
    return _LEGACY_MANYLINUX.get(tag.split("_", 1)[0])


def wheel_glibc() -> dict[str, str]:
    """Installed distribution -> the glibc its wheel tags need (the least of its tags: any one suffices).
    Only wheels tagged manylinux; a plain linux_x86_64 wheel promises nothing."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        wheel = dist.read_text("WHEEL") or ""
        needs = [g for t in re.findall(r"^Tag:\s*\S+-\S+-(\S+)$", wheel, re.M)
                 for p in t.split(".") if (g := tag_glibc(p))]
        name = dist.metadata["Name"]
        if needs and name:
            least = min(needs)
            out[name] = f"{least[0]}.{least[1]}"
    return out


def facts(modules: list[str]) -> dict[str, Any]:
    return {
        "cpus": cpus(),
        "mem_available_gib": memory_available_gib(),
        "env": {k: os.environ[k] for k in BUILD_ENV if k in os.environ},
        "cc": c_compiler(),
        "python_h": python_header(),
        "cuda_home": cuda_home(),
        "libcuda": libcuda(),
        "build_modules": build_modules(modules),
        "glibc": host_glibc(),
        "wheel_glibc": wheel_glibc(),
    }
