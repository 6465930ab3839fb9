"""The environment report: Python, torch/CUDA/cuDNN, GPUs, driver, triton, flash-attn, PyTorch's FA-2
varlen, SDPA backends, the build toolchain, and each NSA backend (ok / why not).

Works without a GPU, without triton or flash-attn (they are reported as not installed, with the reason)
and outside a checkout (the upstream facts ship as nsa_env/upstream.json). Everything downstream is
computed from the report dict, so backend_availability() and the doctor's diagnose() can be called (and
tested) on a report made elsewhere. `nsa-env` (nsa_env/cli.py) prints it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

from nsa_env import toolchain, upstream

SCHEMA = "nsa-env/1"
BACKENDS = ("reference", "torch", "sdpa", "torch_flash", "torch_cudnn", "flash_attn", "triton_sel")
FA2_MIN_SM = 8.0
FA2_MAX_HEAD_DIM = 256
ADA_SM = "8.9"
ENV_PREFIXES = ("NSA_", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST")


# --- facts ---------------------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _torch_facts() -> dict[str, Any]:
    version = _dist_version("torch")
    facts: dict[str, Any] = {
        "installed": version is not None,
        "version": version,
        "imports": False,
        "error": None,
        "cuda": None,
        "cudnn": None,
        "cxx11abi": None,
        "requires_triton": None,
        "arch_list": None,
    }
    # torch pins its triton in its own metadata (the CPU build pins none): "3.6.0" exact, "~=3.8.0" a range.
    if version:
        facts["requires_triton"] = upstream.triton_pin_from_requires(md.requires("torch"))[1]
    if version is None:
        facts["error"] = "torch is not installed"
        return facts
    try:
        import torch
    except (ImportError, OSError) as e:
        facts["error"] = f"import torch failed: {e}"
        return facts
    facts.update(
        imports=True,
        version=torch.__version__,
        cuda=torch.version.cuda,
        cxx11abi=bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False)),
        arch_list=torch.cuda.get_arch_list() if torch.version.cuda else [],  # [] without a visible GPU
    )
    if torch.backends.cudnn.is_available():
        facts["cudnn"] = torch.backends.cudnn.version()
    return facts


def _gpu_facts() -> list[dict[str, Any]]:
    try:
        import torch
    except (ImportError, OSError):
        return []
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "sm": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    return gpus


def _driver_facts() -> dict[str, Any]:
    """Driver version (/proc) and the newest CUDA it supports (cuDriverGetVersion); None where absent."""
    out: dict[str, Any] = {"version": None, "cuda": None}
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
        out["version"] = m.group(1) if m else None
    except OSError:
        pass
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            out["cuda"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        pass  # no NVIDIA driver on this machine
    return out


def _triton_facts() -> dict[str, Any]:
    from nsa.kernels.flash_wrappers import _import

    version = _dist_version("triton")
    mod, why = _import("triton") if version else (None, "triton is not installed")
    facts = {
        "installed": version is not None,
        "version": version,
        "imports": mod is not None,
        "error": None if mod is not None else why,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if mod is not None:  # NSA's own selection kernel module (nsa.kernels.triton.selection) imports too
        from nsa.kernels.triton import available

        facts["sel_kernel_imports"], facts["sel_kernel_error"] = available()
    return facts


def _flash_facts() -> dict[str, Any]:
    from nsa.kernels.flash_wrappers import _import, flash_attn_status

    version = _dist_version("flash-attn")
    mod, why = _import("flash_attn") if version else (None, "flash-attn is not installed")
    dense_ok, dense_why = flash_attn_status(varlen=False)
    varlen_ok, varlen_why = flash_attn_status(varlen=True)
    archs, archs_error = _flash_archs() if version else (None, "flash-attn is not installed")
    return {
        "installed": version is not None,
        "version": version,
        "imports": mod is not None,
        "error": None if mod is not None else why,
        "runnable": dense_ok,
        "reason": dense_why,
        "varlen_runnable": varlen_ok,
        "varlen_reason": varlen_why,
        "archs": archs,
        "archs_error": archs_error,
    }


def _flash_archs() -> tuple[dict[str, list[str]] | None, str | None]:
    """The GPU architectures flash-attn's extension carries, read from its file (no import, no toolkit)."""
    from importlib.util import find_spec

    from nsa_env.cuda_archs import fatbin_archs

    try:
        spec = find_spec("flash_attn_2_cuda")
        if spec is None or not spec.origin:
            return None, "flash_attn_2_cuda (flash-attn's CUDA extension) not found"
        return fatbin_archs(spec.origin), None
    except (OSError, ValueError, ImportError) as e:
        return None, f"cannot read flash_attn_2_cuda's architectures: {e}"


def _sdpa_facts() -> dict[str, Any]:
    try:
        import torch
    except (ImportError, OSError):
        return {"function": False}
    cuda = torch.backends.cuda
    facts: dict[str, Any] = {"function": hasattr(torch.nn.functional, "scaled_dot_product_attention")}
    for name in ("flash", "mem_efficient", "math", "cudnn"):
        fn = getattr(cuda, f"{name}_sdp_enabled", None)
        facts[f"{name}_enabled"] = bool(fn()) if fn else None
    built = getattr(cuda, "is_flash_attention_available", None)
    facts["flash_built"] = bool(built()) if built else None
    return facts


def collect() -> dict[str, Any]:
    """The full report (see `nsa-env --json`)."""
    from nsa.kernels.fa2.torch_cudnn import torch_cudnn_status
    from nsa.kernels.flash_wrappers import torch_flash_status, torch_flash_varlen_status

    tf_ok, tf_why = torch_flash_varlen_status()
    op_ok, op_why = torch_flash_status()
    cd_ok, cd_why = torch_cudnn_status()
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "machine": platform.machine(),
            "libc": " ".join(platform.libc_ver()).strip() or None,
        },
        "torch": _torch_facts(),
        "gpus": _gpu_facts(),
        "driver": _driver_facts(),
        "triton": _triton_facts(),
        "flash_attn": _flash_facts(),
        "torch_flash_varlen": {"available": tf_ok, "reason": tf_why},
        # What the torch_flash backend calls (nsa/kernels/fa2/torch_flash.py).
        "torch_flash_op": {"available": op_ok, "reason": op_why},
        # What torch_cudnn calls (nsa/kernels/fa2/torch_cudnn.py; the dense compressed branch on sm 9.0).
        "torch_cudnn_op": {"available": cd_ok, "reason": cd_why},
        "sdpa": _sdpa_facts(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        # What building flash-attn and Triton's launchers need (nsa-env doctor).
        "toolchain": toolchain.facts(upstream.load().get("flash_attn_build", {}).get("modules", [])),
    }
    report["torch"]["expected_triton"] = expected_triton(report["torch"].get("version"))
    report["cell"] = guess_cell(report)
    report["backends"] = {
        k: {"ok": ok, "reason": why} for k, (ok, why) in backend_availability(report).items()
    }
    return report


# --- the configuration matrix's facts (shipped as nsa_env/upstream.json) -----------------------------------


def expected_triton(
    torch_version: str | None, requires: list[str] | None = None, facts: dict[str, Any] | None = None
) -> str | None:
    """The triton torch pins here: "3.6.0" (exact) or a range such as "~=3.8.0" (torch >= 2.14).

    From the installed torch's own metadata (`requires`: its Requires-Dist lines) where it names triton,
    else (CPU builds pin none) from the matrix's record of that torch release, shipped with nsa_env."""
    if not torch_version:
        return None
    mentioned, pin = upstream.triton_pin_from_requires(md.requires("torch") if requires is None else requires)
    if mentioned:
        return pin  # None where the pin's marker excludes this platform or Python
    return upstream.triton_pin_for_torch(upstream.load() if facts is None else facts, torch_version)


def guess_cell(report: dict[str, Any]) -> str | None:
    """The matrix cell id this environment would be: {cpu|cuXYZ}-torch{M.m}-py{XY}."""
    t = report["torch"]
    if not t.get("version"):
        return None
    mm = ".".join(t["version"].split("+")[0].split(".")[:2])
    variant = "cu" + t["cuda"].replace(".", "") if t.get("cuda") else "cpu"
    py = "".join(report["python"]["version"].split(".")[:2])
    return f"{variant}-torch{mm}-py{py}"


# --- backends --------------------------------------------------------------------------------------------


def _sm(report: dict[str, Any]) -> float | None:
    gpus = report.get("gpus") or []
    return float(gpus[0]["sm"]) if gpus else None


def backend_availability(report: dict[str, Any] | None = None) -> dict[str, tuple[bool, str]]:
    """NSA backend name -> (can run here, why / how). Computed from a report (collect() when None)."""
    if report is None:
        report = collect()
    t = report["torch"]
    if not t.get("imports"):
        why = t.get("error") or "torch does not import"
        return {name: (False, why) for name in BACKENDS}
    sm = _sm(report)
    where = f"CUDA GPU sm {report['gpus'][0]['sm']}" if sm is not None else "CPU"
    out: dict[str, tuple[bool, str]] = {
        "reference": (True, "explicit-mask oracle (fp64 capable), any device"),
        "torch": (True, f"vectorized PyTorch on {where}"),
    }
    if report["sdpa"].get("function"):
        out["sdpa"] = (True, f"torch scaled_dot_product_attention on {where}")
    else:
        out["sdpa"] = (False, f"torch {t['version']} has no scaled_dot_product_attention")
    tf = report.get("torch_flash_op") or report["torch_flash_varlen"]
    out["torch_flash"] = (bool(tf["available"]), tf["reason"])
    cd = report.get("torch_cudnn_op") or {"available": False, "reason": "not in this report (made by an older nsa-env)"}
    if cd["available"] and (sm is None or sm < 9.0):
        cd = {"available": False, "reason": f"cuDNN attention is used on sm 9.0 and newer only ({where})"}
    out["torch_cudnn"] = (bool(cd["available"]), cd["reason"])
    fa = report["flash_attn"]
    out["flash_attn"] = (bool(fa.get("varlen_runnable")), fa.get("varlen_reason") or fa.get("error") or "")
    out["triton_sel"] = _triton_sel(report, sm)
    return out


def _triton_sel(report: dict[str, Any], sm: float | None) -> tuple[bool, str]:
    tr = report["triton"]
    if not tr.get("imports"):
        return False, tr.get("error") or "triton does not import"
    if tr.get("sel_kernel_imports") is False:  # absent in reports made before the kernel existed
        return False, tr.get("sel_kernel_error") or "nsa.kernels.triton.selection does not import"
    forced = report.get("env", {}).get("NSA_TRITON_SEL_FORCE") == "1"
    if sm is None:
        if tr.get("interpreter"):
            return True, (f"triton {tr['version']} interpreter on CPU (TRITON_INTERPRET=1; slow, tests only: "
                          "auto keeps sel on torch on CPU, NSA_SEL_BACKEND=triton_sel forces it)")
        return (
            False,
            "no CUDA GPU; TRITON_INTERPRET=1 runs the kernel in Triton's CPU interpreter (tests only)",
        )
    if sm < FA2_MIN_SM:
        return False, f"sm {sm} < 8.0: the selection kernel needs bf16 tensor cores (Ampere or newer)"
    if f"{sm:.1f}" == ADA_SM and not forced:
        return (
            False,
            "Ada (sm 8.9): the Triton selection kernel is off by default; NSA_TRITON_SEL_FORCE=1 forces it",
        )
    return True, f"triton {tr['version']} on sm {sm}" + (" (forced)" if forced else "")


def print_report(r: dict[str, Any]) -> None:
    t, tr, fa = r["torch"], r["triton"], r["flash_attn"]

    def line(key: str, value: Any) -> None:
        print(f"  {key:22} {value}")

    print("NSA environment")
    line("python", f"{r['python']['version']} ({r['python']['executable']})")
    line("platform", f"{r['platform']['system']} {r['platform']['machine']} {r['platform']['libc'] or ''}")
    line("torch", t["version"] if t.get("imports") else f"unavailable: {t['error']}")
    line("torch CUDA / cuDNN", f"{t.get('cuda') or 'none (CPU build)'} / {t.get('cudnn') or 'none'}")
    for g in r["gpus"] or [None]:
        line(
            "gpu", f"{g['index']}: {g['name']}, sm {g['sm']}, {g['memory_gib']} GiB" if g else "none visible"
        )
    d = r["driver"]
    line("driver", f"{d['version']} (CUDA {d['cuda']})" if d["version"] or d["cuda"] else "no NVIDIA driver")
    want = f" (torch pins {t['expected_triton']})" if t.get("expected_triton") else ""
    line("triton", (tr["version"] if tr["imports"] else f"not usable: {tr['error']}") + want)
    line("flash-attn", f"{fa['version']}, imports" if fa["imports"] else f"not usable: {fa['error']}")
    line(
        "torch FA-2 varlen",
        "yes" if r["torch_flash_varlen"]["available"] else r["torch_flash_varlen"]["reason"],
    )
    s = r["sdpa"]
    if s.get("function"):
        enabled = [
            k[: -len("_enabled")]
            for k in ("flash_enabled", "mem_efficient_enabled", "math_enabled", "cudnn_enabled")
            if s.get(k)
        ]
        line("SDPA backends enabled", ", ".join(enabled) + ("" if r["gpus"] else " (CUDA ones need a GPU)"))
    line("matrix cell", r.get("cell"))
    tc = r.get("toolchain") or {}
    if tc:
        ch, cc = tc["cuda_home"], tc["cc"]
        nvcc = f"nvcc {ch['nvcc_version']} in {ch['path']} ({ch['from']})" if ch.get("nvcc") else "no nvcc"
        mem = tc["mem_available_gib"]
        line("build", f"{tc['cpus']} cores, {mem if mem is not None else '?'} GiB free; {cc['path'] or 'no C compiler'}"
                      f"; {nvcc}; glibc {tc['glibc'] or 'none'}")
    print("NSA backends")
    for name, b in r["backends"].items():
        print(f"  {name:12} {'yes' if b['ok'] else 'no '}  {b['reason']}")
    if r["env"]:
        print("Environment variables")
        for k, v in r["env"].items():
            line(k, v)
