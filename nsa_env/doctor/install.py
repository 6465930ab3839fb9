"""Checks of installing flash-attn and loading prebuilt binaries: build isolation, memory for the source
build, whether a prebuilt wheel exists, the CUDA toolkit a build would use, and glibc."""

from __future__ import annotations

import re

from nsa_env import upstream
from nsa_env.doctor.core import GLIBC_MISSING, Context, Finding, NotApplicable, older


def check_build_isolation(ctx: Context) -> list[Finding]:
    modules = ctx.facts.get("flash_attn_build", {}).get("modules", [])
    m = ctx.in_log(r"No module named '?([\w.]+)'?")
    if m and m.group(1).split(".")[0] in modules:
        name = m.group(1).split(".")[0]
        why = ("pip builds in an isolated environment (its default), which has no torch" if name == "torch"
               else f"the build imports {name}, which the build environment lacks")
        return [Finding("build_isolation", "error",
                        f"building flash-attn failed with \"No module named '{name}'\": {why}.",
                        f"pip install {' '.join(x for x in modules if x != 'torch')}, then "
                        f"{ctx.flash_install()} (uv: uv pip install --no-build-isolation ...).")]
    ctx.cuda_torch()
    if ctx.flash.get("installed"):
        return []
    have = ctx.toolchain().get("build_modules") or {}
    missing = [x for x in modules if have.get(x) is False]
    if not missing:
        return []
    w, _ = ctx.flash_wheel
    direct = f"; or pip install {w['url']} (the upstream wheel)" if w and not ctx.wheel_glibc_too_new else ""
    return [Finding("build_isolation", ctx.optional_severity,
                    "`pip install flash-attn` runs flash-attn's setup.py (PyPI has only its source), which imports "
                    "torch: it needs --no-build-isolation, and then these from this environment, which lacks "
                    f"them: {', '.join(missing)}.",
                    f"pip install {' '.join(missing)}, then {ctx.flash_install()}{direct}")]


OOM_LOG = (r"Killed signal terminated program|died due to signal 9|signal 9 \(Kill signal\)|"
           r"fatal error: Killed|std::bad_alloc|^Killed$|out of memory")


def check_build_oom(ctx: Context) -> list[Finding]:
    oom = ctx.in_log(OOM_LOG)
    tc = ctx.report.get("toolchain") or {}
    if not oom:
        ctx.cuda_torch()
        ctx.toolchain()
        pending, why = ctx.source_build
        if not pending:
            raise NotApplicable(f"no flash-attn source build ahead ({why})")
    build = ctx.facts.get("flash_attn_build", {})
    avail, cpus, env_vars = tc.get("mem_available_gib"), tc.get("cpus") or 1, tc.get("env", {})
    if avail is None or not build:
        if oom:
            return [Finding("build_oom_risk", "error", "the log shows the compiler killed for memory (OOM).",
                            f"MAX_JOBS=1 NVCC_THREADS=2 {ctx.flash_install()}; run the doctor on the build machine "
                            "for a value fitted to its memory.")]
        raise NotApplicable("free memory unknown")
    try:
        threads = int(env_vars.get("NVCC_THREADS") or build["nvcc_threads"])
        max_jobs = int(env_vars["MAX_JOBS"]) if env_vars.get("MAX_JOBS") else None
    except ValueError:
        return [Finding("build_oom_risk", "error", f"MAX_JOBS / NVCC_THREADS are not integers: {env_vars}",
                        "Set them to whole numbers, e.g. MAX_JOBS=2 NVCC_THREADS=2.")]
    per_job = build["gib_per_job"] * threads / build["nvcc_threads"]
    safe = max(1, min(max(1, cpus // 2), int(avail // per_job)))
    # Without MAX_JOBS, flash-attn's setup.py picks `safe` itself; only a machine too small for one job fails.
    jobs = max_jobs if max_jobs is not None else safe
    need = jobs * per_job
    if need <= avail and not oom:
        return []
    if per_job > avail:
        fix = (f"MAX_JOBS=1 NVCC_THREADS=1 {ctx.flash_install()}; if it is still killed, add swap or build on a "
               "machine with more memory" + (" (NSA's torch_flash backend needs no build)."
                                             if ctx.torch_flash_available else "."))
    else:
        fix = f"MAX_JOBS={safe} NVCC_THREADS={threads} {ctx.flash_install()}"
    said = "the log shows the compiler killed for memory; " if oom else ""
    return [Finding("build_oom_risk", "error" if oom else ctx.optional_severity,
                    f"{said}{jobs} nvcc job(s) x ~{per_job:g} GiB (flash-attn's estimate at NVCC_THREADS={threads}) "
                    f"= ~{need:g} GiB, but {avail:g} GiB is free ({cpus} cores).",
                    fix)]


def _no_wheel_fix(ctx: Context) -> str:
    if ctx.torch_flash_available:
        return (f"Nothing needed for NSA: torch's built-in FA-2 (torch_flash backend) serves the same branches. "
                f"For flash-attn anyway: {ctx.flash_install()} (see build_oom_risk).")
    cells = ", ".join(upstream.cells_with_flash_wheel(ctx.facts)) or "none"
    return f"Use a cell with an upstream wheel ({cells}), or build: {ctx.flash_install()} (see build_oom_risk)."


def check_no_wheel(ctx: Context) -> list[Finding]:
    if ctx.in_log(r"Precompiled wheel not found"):
        return [Finding("no_wheel", "warning",
                        "flash-attn's setup.py found no prebuilt wheel for this torch/CUDA/Python/ABI (log: "
                        "\"Precompiled wheel not found\") and compiles it from source (an hour or more; needs nvcc "
                        "and memory).",
                        _no_wheel_fix(ctx))]
    ctx.cuda_torch()
    fa = ctx.flash
    if fa.get("installed"):
        raise NotApplicable(f"flash-attn {fa.get('version')} is installed (flash_attn_abi covers a broken one)")
    w, why = ctx.flash_wheel
    if w:
        return []
    return [Finding("no_wheel", ctx.optional_severity,
                    f"{why}: `pip install flash-attn` compiles it from source (an hour or more; needs nvcc and "
                    "memory).",
                    _no_wheel_fix(ctx))]


def check_cuda_home(ctx: Context) -> list[Finding]:
    m = ctx.in_log(r"The detected CUDA version \(([\d.]+)\) mismatches the version that was used to compile\s+"
                   r"PyTorch \(([\d.]+)\)")
    if m:
        return [Finding("cuda_home_mismatch", "error",
                        f"torch's extension build refused nvcc {m.group(1)}: torch is built with CUDA {m.group(2)} "
                        "(the CUDA major must match).",
                        f"export CUDA_HOME=<a CUDA {m.group(2)} toolkit root> (e.g. /usr/local/cuda-{m.group(2)}) "
                        "and rebuild.")]
    m = ctx.in_log(r"CUDA_HOME environment variable is not set|nvcc was not found|nvcc not found at")
    if m:
        return [Finding("cuda_home_mismatch", "error", f"the build found no nvcc (\"{m.group(0)}\").",
                        "Install the CUDA toolkit matching torch.version.cuda (a -devel image has it) and "
                        "export CUDA_HOME=<its root>.")]
    ctx.cuda_torch()
    ch = ctx.toolchain().get("cuda_home") or {}
    pending, _ = ctx.source_build
    sev = ctx.optional_severity if pending else "info"
    want = ctx.torch["cuda"]
    others = ", ".join(ch.get("toolkits") or []) or f"/usr/local/cuda-{want}"
    if not ch.get("path"):
        if not pending:
            return []
        return [Finding("cuda_home_mismatch", sev,
                        "no CUDA toolkit: CUDA_HOME and CUDA_PATH are unset, no nvcc is on PATH, no /usr/local/cuda; "
                        "building flash-attn (any CUDA extension) fails.",
                        f"Install the CUDA {want} toolkit (nvcc; a -devel image) and export CUDA_HOME=<its root>.")]
    where = f"CUDA_HOME={ch['path']} (from {ch.get('from')})"
    if not ch.get("nvcc"):
        return [Finding("cuda_home_mismatch", sev, f"{where} has no bin/nvcc: extension builds fail.",
                        f"export CUDA_HOME=<a CUDA {want} toolkit root> (found: {others}).")]
    have = ch.get("nvcc_version")
    if have and have.split(".")[0] != want.split(".")[0]:
        return [Finding("cuda_home_mismatch", "error" if pending else "warning",
                        f"{where} has nvcc {have}, torch {ctx.torch['version']} is built with CUDA {want}: torch's "
                        "extension builds refuse a different CUDA major.",
                        f"export CUDA_HOME=<a CUDA {want} toolkit root> (found: {others}).")]
    out = []
    if ch.get("headers") is False:
        out.append(Finding("cuda_home_mismatch", sev,
                           f"{where} has no include/cuda_runtime.h: torch's extension builds compile with "
                           f"-I{ch['path']}/include and miss the CUDA headers (nvcc there is a wrapper or link?).",
                           f"export CUDA_HOME=<the toolkit root> (found: {others})."))
    if have and have != want:
        out.append(Finding("cuda_home_mismatch", "info",
                           f"{where} has nvcc {have}, torch is built with CUDA {want}: same major, so builds work "
                           "(torch warns).",
                           f"Nothing needed; CUDA_HOME=<a CUDA {want} toolkit> silences the warning."))
    return out


def check_glibc(ctx: Context) -> list[Finding]:
    host = ctx.host_glibc
    t, tr, fa = ctx.torch, ctx.report.get("triton", {}), ctx.flash
    texts = [t.get("error"), tr.get("error"), tr.get("sel_kernel_error"), fa.get("error"), ctx.log]
    out: list[Finding] = []
    seen = set()
    for m in re.finditer(GLIBC_MISSING, "\n".join(x for x in texts if x)):
        lib, ver, who = m.group(1), m.group(2), (m.group(3) or "a compiled extension").strip()
        if (lib, ver, who) in seen:
            continue
        seen.add((lib, ver, who))
        if lib == "GLIBC" and "flash_attn" in who:
            fix = (f"Build it on this system: {ctx.flash_install(force_build=True)} (see build_oom_risk), or use a "
                   "newer OS or base image (Ubuntu 22.04 has glibc 2.35).")
        elif lib == "GLIBC":
            fix = ("Build it on this system (pip install --no-binary <package> --no-build-isolation <package>), "
                   "or use a newer OS or base image (Ubuntu 22.04 has glibc 2.35).")
        else:
            fix = ("The libstdc++ loaded is older than the one it was built with: install a newer one (conda: "
                   "conda install -c conda-forge 'libstdcxx-ng>=12'; apt: a newer libstdc++6) and load it first.")
        have = (f"glibc {host}" if host else "glibc") if lib == "GLIBC" else "libstdc++"
        out.append(Finding("glibc_too_old", "error", f"{who} needs {lib}_{ver}, which this system's {have} lacks.",
                           fix))
    if not host:
        if out:
            return out
        raise NotApplicable(f"no glibc here ({ctx.report.get('platform', {}).get('libc') or 'unknown libc'})")
    too_new = {n: v for n, v in ((ctx.report.get("toolchain") or {}).get("wheel_glibc") or {}).items()
               if older(host, v)}
    if too_new:
        names = ", ".join(f"{n} (glibc {v})" for n, v in sorted(too_new.items()))
        out.append(Finding("glibc_too_old", "error",
                           f"installed wheels need a newer glibc than this system's {host}: {names}; the environment "
                           "was made on another machine.",
                           "Recreate it here (pip then picks wheels this glibc can load) or use a base image with a "
                           "newer glibc."))
    if t.get("cuda") and not fa.get("installed") and ctx.wheel_glibc_too_new:
        w, _ = ctx.flash_wheel
        need = ctx.facts["flash_attn"][ctx.flash_version]["glibc"]
        out.append(Finding("glibc_too_old", ctx.optional_severity,
                           f"the upstream wheel {w['wheel']} needs glibc >= {need}, this system has {host}: it "
                           "installs (its tag promises no glibc) and then fails to import (GLIBC_x.y not found).",
                           f"Build it here instead: {ctx.flash_install()} (see build_oom_risk), or "
                           f"use a base image with glibc >= {need}."))
    return out
