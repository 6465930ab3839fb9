"""Checks of what is installed and how it runs: torch, the triton it pins, flash-attn's import, the
GPU (FA-2 support, kernel images, Ada), head dims, the driver, and the toolchain Triton's JIT needs."""

from __future__ import annotations

import re
from typing import Any

from packaging.version import Version

from nsa_env import report, upstream
from nsa_env.cuda_archs import runs_on
from nsa_env.doctor.core import GLIBC_MISSING, Context, Finding, NotApplicable, major_minor, older


def check_torch(ctx: Context) -> list[Finding]:
    t = ctx.torch
    if t.get("imports"):
        return []
    return [Finding("torch_missing", "error", t.get("error") or "torch does not import",
                    "Install a cell exactly: pip install --require-hashes --no-deps -r "
                    "requirements/locks/<cell>.txt (docs/environments.md).")]


def check_triton_pin(ctx: Context) -> list[Finding]:
    t, tr = ctx.torch, ctx.report["triton"]
    want = t.get("expected_triton")
    if not want:
        raise NotApplicable(f"torch {t['version']} pins no triton here")
    if tr.get("installed") and not upstream.pin_matches(tr["version"], want):
        return [Finding(
            "torch_triton_mismatch", "error",
            f"triton {tr['version']} is installed but torch {t['version']} pins triton {want}; "
            "kernels fail to compile or crash with the wrong one.",
            f"pip install {upstream.pip_requirement(want)} (never upgrade triton on its own; it moves with torch).",
        )]
    if not tr.get("installed"):
        return [Finding(
            "triton_missing", "warning" if ctx.gpus else "info",
            f"triton is not installed (torch {t['version']} pairs with triton {want}); the Triton "
            "selection kernel cannot run.",
            f"pip install {upstream.pip_requirement(want)}",
        )]
    return []


def check_flash_import(ctx: Context) -> list[Finding]:
    fa, t = ctx.flash, ctx.torch
    if not fa.get("installed"):
        raise NotApplicable("flash-attn is not installed")
    err = fa.get("error") or ""
    if "undefined symbol" in err:
        w, why = ctx.flash_wheel
        if w:
            wheel, status = w["wheel"], "published upstream"
        else:
            cuda_major = (t.get("cuda") or "12").split(".")[0]
            combo = upstream.flash_combo(major_minor(t["version"]), cuda_major, ctx.python_mm, bool(t.get("cxx11abi")))
            wheel, status = f"flash_attn-{ctx.flash_version}+{combo}", f"NOT published upstream: {why}"
        return [Finding(
            "flash_attn_abi", "error",
            f"flash_attn {fa.get('version')} fails to import with an undefined symbol: its wheel was built for "
            f"another torch, CUDA major or C++ ABI than torch {t['version']}.",
            f"pip uninstall -y flash-attn, then install the wheel built for this torch: {wheel} ({status}); "
            f"else build it: {ctx.flash_install()} (see build_oom_risk).",
        )]
    if not fa.get("imports") and not re.search(GLIBC_MISSING, err):  # glibc_too_old explains that one
        return [Finding("flash_attn_import", "error", f"flash_attn does not import: {err}",
                        "Reinstall the flash-attn of your cell (docs/environments.md).")]
    return []


def check_fa2_sm(ctx: Context) -> list[Finding]:
    old = [g for g in ctx.gpus if float(g["sm"]) < report.FA2_MIN_SM]
    if not ctx.gpus:
        raise NotApplicable("no CUDA GPU visible")
    if not old:
        return []
    names = ", ".join(f"{g['name']} (sm {g['sm']})" for g in old)
    return [Finding("fa2_sm_unsupported", "warning",
                    f"FlashAttention-2 has no kernels for {names}; it needs sm >= 8.0 (Ampere, Ada, Hopper, "
                    "Blackwell).",
                    "Nothing to install: NSA falls back to the sdpa/torch backends on these GPUs.")]


def check_head_dims(ctx: Context) -> list[Finding]:
    out = []
    for d in ctx.head_dims:
        if d > report.FA2_MAX_HEAD_DIM:
            out.append(Finding("fa2_head_dim", "warning",
                               f"head dim {d} > {report.FA2_MAX_HEAD_DIM}: FlashAttention-2 (flash-attn and torch's "
                               "varlen_attn) does not support it.",
                               "Use head dims <= 256; NSA uses the sdpa/torch backends for larger ones."))
        elif d % 8:
            out.append(Finding("fa2_head_dim", "warning",
                               f"head dim {d} is not a multiple of 8: torch's flash kernels refuse it and "
                               "flash-attn pads it (slower).",
                               "Use a multiple of 8."))
    return out


def check_driver(ctx: Context) -> list[Finding]:
    t, drv = ctx.torch, ctx.report["driver"]
    if not t.get("cuda"):
        raise NotApplicable("torch is a CPU build")
    need = t["cuda"]
    nmaj, nmin = (int(x) for x in need.split(".")[:2])
    if not drv.get("cuda"):
        # libcuda did not answer; the kernel module's version still says whether it is old enough.
        floor = ctx.facts.get("driver", {}).get(str(nmaj))
        if drv.get("version") and floor and older(drv["version"], floor):
            return [Finding("driver_too_old", "error",
                            f"the NVIDIA driver {drv['version']} is older than {floor}, the first that runs CUDA "
                            f"{nmaj}.x; torch {t['version']} is built for CUDA {need}.",
                            f"Upgrade the driver to >= {floor}, or install a cell built for an older CUDA major.")]
        raise NotApplicable("no NVIDIA driver answered (no libcuda.so.1)")
    have = drv["cuda"]
    hmaj, hmin = (int(x) for x in have.split(".")[:2])
    if hmaj < nmaj:
        floor = ctx.facts.get("driver", {}).get(str(nmaj))
        return [Finding("driver_too_old", "error",
                        f"the NVIDIA driver {drv.get('version') or ''} supports CUDA up to {have}; torch "
                        f"{t['version']} is built for CUDA {need}: CUDA calls fail (no kernel image / driver "
                        "insufficient).",
                        f"Upgrade the driver to one for CUDA {need}{f' (>= {floor})' if floor else ''}, or "
                        f"install a cell built for CUDA {hmaj}.x (`python -m ci.matrix list`).")]
    if hmaj == nmaj and hmin < nmin:
        return [Finding("driver_minor_older", "warning",
                        f"the driver supports CUDA {have}, torch is built for {need}: it runs through CUDA "
                        "minor-version compatibility, but JIT of newer PTX fails.",
                        f"Upgrade the driver to one for CUDA {need} when you can.")]
    return []


def check_no_gpu(ctx: Context) -> list[Finding]:
    t = ctx.torch
    if not t.get("cuda"):
        raise NotApplicable("torch is a CPU build")
    if ctx.gpus:
        return []
    return [Finding("no_gpu", "info", f"torch {t['version']} is a CUDA build but sees no GPU.",
                    "Check nvidia-smi, CUDA_VISIBLE_DEVICES and the container's --gpus flag.")]


def check_ada(ctx: Context) -> list[Finding]:
    ada = [g for g in ctx.gpus if g["sm"] == report.ADA_SM]
    if not ada:
        raise NotApplicable("no Ada GPU (sm 8.9)")
    if ctx.report.get("env", {}).get("NSA_TRITON_SEL_FORCE") == "1":
        return []
    return [Finding("ada_triton_sel_off", "info",
                    f"{ada[0]['name']} is Ada (sm 8.9): the Triton selection kernel is off by default there (it "
                    "was slower than the packed SDPA path and failed parity at some shapes).",
                    "Nothing to fix. For tests only: NSA_TRITON_SEL_FORCE=1.")]


NO_KERNEL_IMAGE = r"no kernel image is available for execution on the device"


def _cuda_for_sm(facts: dict[str, Any], sm: str) -> str:
    able = sorted((v for v, archs in facts.get("cuda_archs", {}).items() if sm in archs), key=Version)
    return f"CUDA {able[0]} or newer" if able else "a CUDA version that supports it"


def check_no_kernel_image(ctx: Context) -> list[Finding]:
    if not ctx.gpus:
        if ctx.in_log(NO_KERNEL_IMAGE):
            return [Finding("no_kernel_image", "error", "the log shows 'no kernel image is available for execution "
                            "on the device' (torch or an extension lacks the GPU's architecture).",
                            "Run the doctor on the GPU machine: it compares each binary's architectures with the GPU.")]
        raise NotApplicable("no CUDA GPU visible")
    out: list[Finding] = []
    t, fa = ctx.torch, ctx.flash
    arch_list = t.get("arch_list")
    fa_archs = fa.get("archs")
    for g in ctx.gpus:
        sm, tag = g["sm"], g["sm"].replace(".", "")
        if arch_list and not runs_on(arch_list, sm):
            out.append(Finding("no_kernel_image", "error",
                               f"torch {t['version']} carries kernels for {' '.join(arch_list)}; {g['name']} is sm "
                               f"{sm}: CUDA ops fail with 'no kernel image is available for execution on the device'.",
                               f"Install a torch built for sm {sm} ({_cuda_for_sm(ctx.facts, sm)}; "
                               "docs/environments.md lists the cells and their gpu_archs)."))
        elif fa_archs and float(sm) >= report.FA2_MIN_SM and not runs_on(fa_archs["sass"] + fa_archs["ptx"], sm):
            out.append(Finding("no_kernel_image", "error",
                               f"flash-attn {fa.get('version')} carries kernels for "
                               f"{' '.join(fa_archs['sass'] + fa_archs['ptx'])}; {g['name']} is sm {sm}: its calls "
                               "fail with 'no kernel image is available'.",
                               f"Rebuild it for this GPU: FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS={tag} "
                               f"pip install --no-build-isolation --no-cache-dir --force-reinstall "
                               f"flash-attn=={fa.get('version')}"))
    if not out and ctx.in_log(NO_KERNEL_IMAGE):
        out.append(Finding("no_kernel_image", "error",
                           "the log shows 'no kernel image is available', but torch and flash-attn cover this GPU: "
                           "another extension in the failing call was built without its architecture.",
                           f"Rebuild that extension with TORCH_CUDA_ARCH_LIST={ctx.gpus[0]['sm']}."))
    if arch_list is None and fa_archs is None and not out:
        raise NotApplicable("the report has no architecture lists (made by an older nsa)")
    return out


CC_FIX = "apt-get install gcc (or export CC=<path of a C compiler>)."
PYTHON_H_FIX = "Install this Python's headers (apt-get install python3.X-dev for a system Python)."
LIBCUDA_FIX = ("Run ldconfig as root, or export TRITON_LIBCUDA_PATH=<folder of libcuda.so.1>; in a container, "
               "start it with the NVIDIA container toolkit (--gpus all).")
TOOLCHAIN_LOG = (
    (r"Failed to find C compiler", "Triton found no C compiler to build its kernel launcher", CC_FIX),
    (r"Python\.h: No such file or directory", "Triton's launcher build found no Python.h", PYTHON_H_FIX),
    (r"libcuda\.so cannot found", "Triton found no libcuda.so.1", LIBCUDA_FIX),
    (r"cannot find -lcuda", "Triton < 3.6 links -lcuda and found no unversioned libcuda.so",
     "ln -s libcuda.so.1 libcuda.so in the driver's library folder (as root), or upgrade torch and its triton."),
)


def check_triton_toolchain(ctx: Context) -> list[Finding]:
    out = [Finding("triton_toolchain", "error", f"{what} (log: \"{m.group(0)}\").", fix)
           for pattern, what, fix in TOOLCHAIN_LOG if (m := ctx.in_log(pattern))]
    if out:
        return out
    tr = ctx.report.get("triton", {})
    if not tr.get("imports"):
        raise NotApplicable("triton does not import (torch_triton_mismatch / triton_missing say why)")
    if not ctx.gpus:
        raise NotApplicable("no CUDA GPU: Triton compiles nothing here (TRITON_INTERPRET=1 needs no compiler)")
    tc = ctx.toolchain()
    cc, py, lc = tc.get("cc") or {}, tc.get("python_h") or {}, tc.get("libcuda") or {}
    fails = "Triton compiles a C launcher per kernel and fails"
    if not cc.get("path"):
        what = f"CC={cc['name']} is not on PATH" if cc.get("from") == "CC" else "no C compiler (no CC, gcc, clang)"
        out.append(Finding("triton_toolchain", "error", f"{what}: {fails} (\"Failed to find C compiler\").", CC_FIX))
    if py and not py.get("found"):
        out.append(Finding("triton_toolchain", "error", f"no Python.h in {py.get('include')}: {fails}.",
                           PYTHON_H_FIX.replace("3.X", ctx.python_mm)))
    if not lc.get("so1_dirs"):
        out.append(Finding("triton_toolchain", "error",
                           f"libcuda.so.1 not found (via {lc.get('from')}): {fails} to link it.", LIBCUDA_FIX))
    elif (since := ctx.facts.get("triton", {}).get("links_libcuda_so1_from")) and older(tr["version"], since) \
            and not lc.get("so_dirs"):
        d = lc["so1_dirs"][0]
        out.append(Finding("triton_toolchain", "error",
                           f"triton {tr['version']} links -lcuda, which needs libcuda.so; {d} has only libcuda.so.1.",
                           f"ln -s libcuda.so.1 {d}/libcuda.so (as root), or upgrade torch and its triton."))
    return out
