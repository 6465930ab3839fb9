"""What this environment is, what NSA can run in it, and what is wrong with it.

    python -m nsa.env                    # report: Python, torch/CUDA/cuDNN, GPUs, driver, triton,
                                         # flash-attn, PyTorch's FA-2 varlen, SDPA backends, and
                                         # each NSA backend (ok / why not)
    python -m nsa.env --json             # the same as JSON (schema "nsa-env/1")
    python -m nsa.env --check-lock [CELL|PATH]
                                         # installed distributions vs a cell's lock (missing, extra, wrong
                                         # version); exit 1 on drift. No CELL: the cell matching this torch.
    python -m nsa.env doctor [--json] [--head-dim D ...]
                                         # common failures explained, with the fix; exit 1 if any is an error
Also installed as the console script `nsa-env`. Works without a GPU and without triton or flash-attn
(they are reported as not installed, with the reason). Everything is computed from a report dict, so
backend_availability() and diagnose() can be called (and tested) on a report made elsewhere.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata as md
import json
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEMA = "nsa-env/1"
BACKENDS = ("reference", "torch", "sdpa", "torch_flash", "flash_attn", "triton_sel")
FA2_MIN_SM = 8.0
FA2_MAX_HEAD_DIM = 256
ADA_SM = "8.9"
ENV_PREFIXES = ("NSA_", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST")
# Not part of any lock: the installer itself and this project (installed with --no-deps after the lock).
LOCK_IGNORED = ("pip", "nsa")
REPO = Path(__file__).resolve().parent.parent


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
    }
    # torch pins its triton in its own metadata (the CPU build pins none).
    for req in (md.requires("torch") or []) if version else []:
        m = re.match(r"(?i)^triton\s*==\s*([\w.]+)", req)
        if m:
            facts["requires_triton"] = m.group(1)
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
    return {
        "installed": version is not None,
        "version": version,
        "imports": mod is not None,
        "error": None if mod is not None else why,
        "runnable": dense_ok,
        "reason": dense_why,
        "varlen_runnable": varlen_ok,
        "varlen_reason": varlen_why,
    }


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
    """The full report (see `python -m nsa.env --json`)."""
    from nsa.kernels.flash_wrappers import torch_flash_status, torch_flash_varlen_status

    tf_ok, tf_why = torch_flash_varlen_status()
    op_ok, op_why = torch_flash_status()
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
        # What the torch_flash backend calls (nsa/backends/torch_flash.py).
        "torch_flash_op": {"available": op_ok, "reason": op_why},
        "sdpa": _sdpa_facts(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }
    report["torch"]["expected_triton"] = expected_triton(report["torch"].get("version"))
    report["cell"] = guess_cell(report)
    report["backends"] = {
        k: {"ok": ok, "reason": why} for k, (ok, why) in backend_availability(report).items()
    }
    return report


# --- the configuration matrix (optional: present in a checkout, absent in an installed wheel) ------------


def load_matrix() -> dict[str, Any] | None:
    path = REPO / "requirements" / "matrix.toml"
    if sys.version_info < (3, 11) or not path.exists():
        return None
    import tomllib

    with path.open("rb") as f:
        return tomllib.load(f)


def expected_triton(torch_version: str | None) -> str | None:
    """The triton torch pins: its own metadata, else (CPU builds) the matrix's upstream table."""
    if not torch_version:
        return None
    requires = [r for r in (md.requires("torch") or []) if re.match(r"(?i)^triton\s*==", r)]
    if requires:
        return re.split(r"==", requires[0])[1].split(";")[0].strip()
    m = load_matrix()
    entry = (m or {}).get("upstream", {}).get("torch", {}).get(torch_version.split("+")[0], {})
    return entry.get("triton")


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


# --- lock drift ------------------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> dict[str, str]:
    """name -> pinned version of a pip-tools style lock (URL wheels: the version in the file name)."""
    out: dict[str, str] = {}
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+)|@\s*(\S+))", line)
        if not m:
            continue
        if m.group(2):
            out[_canonical(m.group(1))] = m.group(2)
        else:  # name @ https://.../flash_attn-2.8.3%2Bcu12...-cp311-...whl
            fname = m.group(3).rsplit("/", 1)[-1].replace("%2B", "+")
            parts = fname.split("-")
            # Upstream renames the built wheel (+cu12torch2.8...); the installed metadata says plain 2.8.3.
            out[_canonical(m.group(1))] = parts[1].split("+")[0] if len(parts) > 1 else "?"
    return out


def installed_distributions() -> dict[str, str]:
    out: dict[str, str] = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name:
            out.setdefault(_canonical(name), d.version)  # first on sys.path wins, as for imports
    return out


def _same(a: str, b: str) -> bool:
    try:
        from packaging.version import Version

        return Version(a) == Version(b)
    except Exception:  # packaging absent or a non-PEP 440 version: compare the text  # noqa: BLE001
        return a == b


def check_lock(lock_text: str, installed: dict[str, str], variant: str | None = None) -> dict[str, Any]:
    """Compare installed distributions with a lock. `variant` (cpu, cu130) accepts a local label that
    names the same build: the lock's torch 2.11.0 (PyPI's CUDA 13.0 build) is installed 2.11.0+cu130
    from PyTorch's index, and a URL wheel's +cu12torch2.8... label is not in the installed version."""
    locked = parse_lock(lock_text)
    result: dict[str, Any] = {
        "missing": [],
        "extra": [],
        "wrong_version": [],
        "local_label": [],
        "ignored": [],
        "matching": 0,
    }
    for name, want in sorted(locked.items()):
        have = installed.get(name)
        if have is None:
            result["missing"].append({"name": name, "locked": want})
        elif _same(have, want):
            result["matching"] += 1
        else:
            pub_have, _, label_have = have.partition("+")
            pub_want, _, label_want = want.partition("+")
            same_build = _same(pub_have, pub_want) and (
                not label_have or label_have == variant or (label_want and not label_have)
            )
            entry = {"name": name, "locked": want, "installed": have}
            result["local_label" if same_build else "wrong_version"].append(entry)
    for name, have in sorted(installed.items()):
        if name in locked:
            continue
        (result["ignored"] if name in LOCK_IGNORED else result["extra"]).append(
            {"name": name, "installed": have}
        )
    result["drift"] = bool(result["missing"] or result["extra"] or result["wrong_version"])
    return result


def find_lock(cell_or_path: str) -> Path:
    p = Path(cell_or_path)
    if p.suffix == ".txt" and p.exists():
        return p
    for base in (Path.cwd(), REPO):
        cand = base / "requirements" / "locks" / f"{cell_or_path}.txt"
        if cand.exists():
            return cand
    raise FileNotFoundError(
        f"--check-lock: no lock for {cell_or_path!r} (looked for requirements/locks/{cell_or_path}.txt "
        f"under {Path.cwd()} and {REPO}); pass a cell id of requirements/matrix.toml or a lock path"
    )


# --- doctor ----------------------------------------------------------------------------------------------


@dataclass
class Finding:
    code: str
    severity: str  # "error" | "warning" | "info"
    problem: str
    fix: str


def _flash_wheel_for(report: dict[str, Any], version: str) -> tuple[str, str]:
    """(wheel file name matching this torch, whether upstream publishes it)."""
    t, py = report["torch"], report["python"]["version"]
    mm = ".".join(t["version"].split("+")[0].split(".")[:2])
    cuda_major = (t.get("cuda") or "12").split(".")[0]
    abi = "TRUE" if t.get("cxx11abi") else "FALSE"
    cp = "cp" + "".join(py.split(".")[:2])
    wheel = f"flash_attn-{version}+cu{cuda_major}torch{mm}cxx11abi{abi}-{cp}-{cp}-linux_x86_64.whl"
    rel = ((load_matrix() or {}).get("upstream", {}).get("flash_attn", {}) or {}).get(version)
    if rel is None:
        return wheel, "unknown (docs/environments.md lists the published wheels)"
    pyv = ".".join(py.split(".")[:2])
    published = (
        mm in rel["torch"]
        and cuda_major in rel["cuda_major"]
        and pyv in rel["python"]
        and (abi == "TRUE") in rel["cxx11abi"]
        and not any(ex.get("torch") == mm and ex.get("python") == pyv for ex in rel.get("exclude", []))
    )
    return wheel, "published upstream" if published else "NOT published upstream: build from source"


def diagnose(report: dict[str, Any], head_dims: tuple[int, ...] = (128, 192)) -> list[Finding]:
    """The common environment failures found in a report, each with its fix in plain words."""
    f: list[Finding] = []
    t, tr, fa, drv, gpus = (
        report["torch"],
        report["triton"],
        report["flash_attn"],
        report["driver"],
        report["gpus"],
    )
    if not t.get("imports"):
        f.append(
            Finding(
                "torch_missing",
                "error",
                t.get("error") or "torch does not import",
                "Install a cell exactly: pip install --require-hashes --no-deps -r "
                "requirements/locks/<cell>.txt (docs/environments.md).",
            )
        )
        return f

    want = t.get("expected_triton")
    if want and tr.get("installed") and not _same(tr["version"], want):
        f.append(
            Finding(
                "torch_triton_mismatch",
                "error",
                f"triton {tr['version']} is installed but torch {t['version']} pins triton {want}; "
                "kernels fail to compile or crash with the wrong one.",
                f"pip install triton=={want} (never upgrade triton on its own; it moves with torch).",
            )
        )
    elif want and not tr.get("installed"):
        f.append(
            Finding(
                "triton_missing",
                "warning" if gpus else "info",
                f"triton is not installed (torch {t['version']} pairs with triton {want}); the Triton "
                "selection kernel cannot run.",
                f"pip install triton=={want}",
            )
        )

    err = fa.get("error") or ""
    if fa.get("installed") and "undefined symbol" in err:
        wheel, status = _flash_wheel_for(report, fa.get("version") or "2.8.3")
        f.append(
            Finding(
                "flash_attn_abi",
                "error",
                f"flash_attn {fa.get('version')} fails to import with an undefined symbol: its wheel was "
                f"built for another torch, CUDA major or C++ ABI than torch {t['version']}.",
                f"pip uninstall -y flash-attn, then install the wheel built for this torch: {wheel} "
                f"({status}); else build it: pip install flash-attn=={fa.get('version')} "
                "--no-build-isolation (hours; MAX_JOBS limits memory).",
            )
        )
    elif fa.get("installed") and not fa.get("imports"):
        f.append(
            Finding(
                "flash_attn_import",
                "error",
                f"flash_attn does not import: {err}",
                "Reinstall the flash-attn of your cell (docs/environments.md).",
            )
        )

    old = [g for g in gpus if float(g["sm"]) < FA2_MIN_SM]
    if old:
        names = ", ".join(f"{g['name']} (sm {g['sm']})" for g in old)
        f.append(
            Finding(
                "fa2_sm_unsupported",
                "warning",
                f"FlashAttention-2 has no kernels for {names}; it needs "
                "sm >= 8.0 (Ampere, Ada, Hopper, Blackwell).",
                "Nothing to install: NSA falls back to the sdpa/torch backends on these GPUs.",
            )
        )
    for d in head_dims:
        if d > FA2_MAX_HEAD_DIM:
            f.append(
                Finding(
                    "fa2_head_dim",
                    "warning",
                    f"head dim {d} > {FA2_MAX_HEAD_DIM}: FlashAttention-2 "
                    "(flash-attn and torch's varlen_attn) does not support it.",
                    "Use head dims <= 256; NSA uses the sdpa/torch backends for larger ones.",
                )
            )
        elif d % 8:
            f.append(
                Finding(
                    "fa2_head_dim",
                    "warning",
                    f"head dim {d} is not a multiple of 8: torch's flash "
                    "kernels refuse it and flash-attn pads it (slower).",
                    "Use a multiple of 8.",
                )
            )

    if t.get("cuda") and drv.get("cuda"):
        need, have = t["cuda"], drv["cuda"]
        nmaj, nmin = (int(x) for x in need.split(".")[:2])
        hmaj, hmin = (int(x) for x in have.split(".")[:2])
        if hmaj < nmaj:
            f.append(
                Finding(
                    "driver_too_old",
                    "error",
                    f"the NVIDIA driver {drv.get('version') or ''} supports CUDA up to {have}; torch "
                    f"{t['version']} is built for CUDA {need}: CUDA calls fail (no kernel image / "
                    "driver insufficient).",
                    f"Upgrade the driver to one for CUDA {need}, or install a cell built for CUDA "
                    f"{hmaj}.x (`python -m ci.matrix list`).",
                )
            )
        elif hmaj == nmaj and hmin < nmin:
            f.append(
                Finding(
                    "driver_minor_older",
                    "warning",
                    f"the driver supports CUDA {have}, torch is built for {need}: it runs through CUDA "
                    "minor-version compatibility, but JIT of newer PTX fails.",
                    f"Upgrade the driver to one for CUDA {need} when you can.",
                )
            )
    if t.get("cuda") and not gpus:
        f.append(
            Finding(
                "no_gpu",
                "info",
                f"torch {t['version']} is a CUDA build but sees no GPU.",
                "Check nvidia-smi, CUDA_VISIBLE_DEVICES and the container's --gpus flag.",
            )
        )
    ada = [g for g in gpus if g["sm"] == ADA_SM]
    if ada and report.get("env", {}).get("NSA_TRITON_SEL_FORCE") != "1":
        f.append(
            Finding(
                "ada_triton_sel_off",
                "info",
                f"{ada[0]['name']} is Ada (sm 8.9): the Triton selection kernel is off by default there "
                "(it was slower than the packed SDPA path and failed parity at some shapes).",
                "Nothing to fix. For tests only: NSA_TRITON_SEL_FORCE=1.",
            )
        )
    return f


# --- CLI -------------------------------------------------------------------------------------------------


def _print_report(r: dict[str, Any]) -> None:
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
    print("NSA backends")
    for name, b in r["backends"].items():
        print(f"  {name:12} {'yes' if b['ok'] else 'no '}  {b['reason']}")
    if r["env"]:
        print("Environment variables")
        for k, v in r["env"].items():
            line(k, v)


def _print_drift(lock: Path, res: dict[str, Any]) -> None:
    print(f"lock {lock}: {res['matching']} matching")
    for title, key in (
        ("version drift", "wrong_version"),
        ("missing (in the lock, not installed)", "missing"),
        ("extra (installed, not in the lock)", "extra"),
        ("same release, other local label (not drift)", "local_label"),
    ):
        if res[key]:
            print(f"{title}: {len(res[key])}")
            for e in res[key]:
                print(
                    f"  {e['name']:28} locked {e.get('locked', '-'):16} installed {e.get('installed', '-')}"
                )
    print("DRIFT" if res["drift"] else "no drift")


def _doctor(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nsa-env doctor", description="Explain common environment failures.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--head-dim",
        type=int,
        action="append",
        dest="head_dims",
        help="head dims you will use (default: 128 and 192); repeat for several",
    )
    args = ap.parse_args(argv)
    dims = tuple(args.head_dims or (128, 192))
    if any(d <= 0 for d in dims):
        ap.error(f"--head-dim must be positive, got {dims}")
    findings = diagnose(collect(), dims)
    if args.json:
        print(json.dumps([asdict(x) for x in findings], indent=2))
    else:
        for x in findings:
            print(f"[{x.severity.upper()}] {x.code}: {x.problem}\n    fix: {x.fix}")
        if not findings:
            print("doctor: nothing wrong found")
    return 1 if any(x.severity == "error" for x in findings) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        return _doctor(argv[1:])
    ap = argparse.ArgumentParser(
        prog="nsa-env",
        description=__doc__.split("\n\n")[0],
        epilog="Subcommand: `nsa-env doctor [--json] [--head-dim D]`.",
    )
    ap.add_argument("--json", action="store_true", help="print the report (or the drift) as JSON")
    ap.add_argument(
        "--check-lock",
        nargs="?",
        const="auto",
        metavar="CELL",
        help="compare installed packages with requirements/locks/CELL.txt (or a lock path); "
        "without CELL, the cell matching this torch and Python",
    )
    args = ap.parse_args(argv)
    report = collect()
    if args.check_lock is None:
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_report(report)
        return 0
    cell = report["cell"] if args.check_lock == "auto" else args.check_lock
    if not cell:
        ap.error("--check-lock: torch is not installed, so no cell can be guessed; name one")
    try:
        lock = find_lock(cell)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    variant = cell.split("-", 1)[0] if re.match(r"^(cpu|cu\d+)-", cell) else None
    res = check_lock(lock.read_text(), installed_distributions(), variant)
    if args.json:
        print(json.dumps({"lock": str(lock), "cell": cell, **res}, indent=2))
    else:
        _print_drift(lock, res)
    return 1 if res["drift"] else 0


if __name__ == "__main__":
    sys.exit(main())
