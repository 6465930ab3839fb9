"""The selection backward kernels compile for sm_90 on this CPU machine (bench/triton_sel_compile_check.py:
Triton's own argument specialization and compiler, the ptxas it ships). The interpreter runs the kernels'
logic; this catches what it cannot (typing and lowering errors, shared memory over the limit). Runs in a
subprocess because the suite's TRITON_INTERPRET=1 replaces the kernels in this process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_backward_kernels_compile_for_sm90():
    spec = importlib.util.find_spec("triton")
    if spec is None:
        pytest.skip("triton is not installed (the CPU lock pins it)")
    if not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no ptxas (the CPU image prunes it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "triton_sel_compile_check.py"), "--quick",
                          "--D", "128"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert {ln.split()[0] for ln in lines if "regs=" in ln} == {"dq", "dkdv", "reduce"}, res.stdout
    assert lines[-1] == "compile check (sm_90): 0 failure(s)"
