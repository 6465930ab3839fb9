"""compute-sanitizer memcheck over the GPU edge sweeps of this folder (`nox -s sanitizer`).

Each sweep (a script beside this file: tiny, odd and empty shapes, forward and backward) runs in a process of
its own under `compute-sanitizer --tool memcheck`; a test fails on any memcheck error and on a sweep that
fails by itself (a non-finite output, a fast path that did not run). Without a CUDA GPU or compute-sanitizer
the tests are skipped with the reason, or fail where NSA_REQUIRE_SANITIZER=1 (the nox session sets it unless
`-- --skip-no-gpu`). NSA_SANITIZER_LOGS=DIR keeps each sweep's full output as DIR/<sweep>.log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MEMCHECK_ERROR_EXIT = 86  # compute-sanitizer's exit status on a memcheck error; a sweep's own failure exits 1


@dataclass(frozen=True)
class Sweep:
    script: str
    timeout_s: int
    # Without the caching allocator every tensor is its own allocation, so an access past its end is caught;
    # the fused pipeline's sweep keeps it (its 4k-token cases allocate too often to run that way in time).
    no_caching_allocator: bool = True
    # One plain run first compiles the Triton kernels into Triton's cache at full speed (the decode sweep's
    # compiles under memcheck alone outran its time limit, and so did the fused pipeline's on a cold cache
    # once its kernels had two column tiles for Dk=192).
    warm_up: bool = True


SWEEPS = {
    "nsa": Sweep("nsa_edge_sweep.py", 360, no_caching_allocator=False),
    "fa2": Sweep("fa2_edge_sweep.py", 150, warm_up=False),
    "triton_sel": Sweep("triton_sel_edge_sweep.py", 110, warm_up=False),
    "decode": Sweep("decode_edge_sweep.py", 200),
    "rope": Sweep("rope_edge_sweep.py", 90, warm_up=False),
}


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    found = found or next((str(p) for h in homes if h for p in [Path(h) / "bin" / "compute-sanitizer"]
                           if p.is_file()), None)
    return found


def why_not_here() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    if find_sanitizer() is None:
        return "compute-sanitizer not found (on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin)"
    return None


def verdict(returncode: int, output: str) -> str:
    """"" when the run is clean, else why not: memcheck errors, a failed sweep, or a run that did not finish."""
    found = re.findall(r"ERROR SUMMARY: (\d+) errors?", output)
    if not found:
        return f"no ERROR SUMMARY in the output (exit {returncode}): compute-sanitizer did not finish"
    if int(found[-1]) or returncode == MEMCHECK_ERROR_EXIT:
        return f"compute-sanitizer memcheck found {found[-1]} error(s)"
    if returncode:
        return f"the sweep failed by itself (exit {returncode}): see its last lines"
    return ""


@pytest.fixture(scope="module")
def sanitizer() -> str:
    why = why_not_here()
    if why:
        if os.environ.get("NSA_REQUIRE_SANITIZER") == "1":
            pytest.fail(f"the sanitizer sweeps need a CUDA GPU and compute-sanitizer: {why}")
        pytest.skip(why)
    return find_sanitizer()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_sweep_is_memcheck_clean(sanitizer, name, tmp_path):
    sweep = SWEEPS[name]
    script = str(HERE / sweep.script)
    env = dict(os.environ)
    if sweep.warm_up:
        subprocess.run([sys.executable, script], env=env, capture_output=True, timeout=sweep.timeout_s)
    if sweep.no_caching_allocator:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    cmd = [sanitizer, "--tool", "memcheck", "--error-exitcode", str(MEMCHECK_ERROR_EXIT), sys.executable, script]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=sweep.timeout_s)
        rc, output = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = -1
        parts = (e.stdout, e.stderr)  # bytes or str, depending on where the timeout struck
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in parts)
        output += f"\ntimed out after {sweep.timeout_s} s"
    log = Path(os.environ.get("NSA_SANITIZER_LOGS") or tmp_path) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output)
    why = verdict(rc, output)
    tail = "\n".join(output.splitlines()[-25:])
    assert not why, f"{name}: {why} (full output: {log})\n{tail}"


@pytest.mark.parametrize("rc, output, expect", [
    pytest.param(0, "ok\n========= ERROR SUMMARY: 0 errors\n", "", id="clean"),
    pytest.param(86, "========= Invalid __global__ read of size 4\n========= ERROR SUMMARY: 3 errors\n",
                 "found 3 error(s)", id="memcheck-errors"),
    pytest.param(0, "========= ERROR SUMMARY: 1 error\n", "found 1 error(s)", id="one-error-exit-0"),
    pytest.param(1, "nsa edge sweep: 2 bad case(s)\n========= ERROR SUMMARY: 0 errors\n",
                 "failed by itself (exit 1)", id="sweep-failed"),
    pytest.param(-1, "lengths=None ...\ntimed out after 150 s", "did not finish", id="cut-short"),
])
def test_the_verdict_fails_on_each_kind_of_failure(rc, output, expect):
    got = verdict(rc, output)
    assert (got == "") if expect == "" else (expect in got), got


def test_every_sweep_script_exists_and_none_is_left_out():
    assert {s.script for s in SWEEPS.values()} == {p.name for p in HERE.glob("*_edge_sweep.py")}
