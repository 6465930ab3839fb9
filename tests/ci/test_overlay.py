"""ci/sessions/overlay.py: which of a cell's locked packages a host must get from the lock's own wheels."""

from __future__ import annotations

from ci.locks import lock_path, parse_lock
from ci.matrix import load
from ci.sessions import overlay

CELL = "cu130-torch2.11-py312"


def locked() -> dict[str, str]:
    return {name: pin.version for name, pin in parse_lock(lock_path(load(), CELL).read_text()).items()}


def test_plan_installs_what_is_missing_or_at_another_version_only():
    have = {**locked(), "torch": "2.11.0+cu130", "jax": "0.11.2"}  # the CUDA build's local label matches
    have["pytest"], have["filelock"] = "9.1.1", "3.0"
    del have["nox"]
    plan = overlay.plan(CELL, have)
    assert [name for name, _, _ in plan["install"]] == ["filelock", "nox", "pytest"]
    assert dict((n, h) for n, _, h in plan["install"]) == {"filelock": "3.0", "nox": None, "pytest": "9.1.1"}
    assert plan["extra"] == 1 and plan["matching"] == len(locked()) - 3


def test_a_cpu_torch_is_not_the_cuda_cells_torch():
    plan = overlay.plan(CELL, {**locked(), "torch": "2.11.0+cpu"})
    assert [name for name, _, _ in plan["install"]] == ["torch"]


def test_read_freeze(tmp_path):
    f = tmp_path / "freeze.txt"
    f.write_text("Markdown-It-Py==4.2.0\n-e git+https://example.invalid/x#egg=x\npytest==9.1.1\n")
    assert overlay.read_freeze(f) == {"markdown-it-py": "4.2.0", "pytest": "9.1.1"}


def test_make_over_this_interpreter(tmp_path):
    """A venv over this test interpreter (a nox venv of its cell's lock): it imports the host's torch, holds
    the lock exactly, and `pip check` is clean. The host being a venv itself is the case that matters."""
    import json
    import os
    import subprocess
    import sys

    import pytest

    cell = os.environ.get("NSA_CELL")
    if not cell:
        pytest.skip("NSA_CELL is not set: these tests run outside a nox session of a cell")
    venv = tmp_path / "lock"
    assert overlay.main(["make", cell, str(venv), "--wheels", str(tmp_path), "--python", sys.executable]) == 0
    record = json.loads((venv / overlay.MARKER).read_text())
    assert record["after"]["install"] == [] and record["pip_check"]["returncode"] == 0
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, sys; print(torch.__file__)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith(tuple(record["host_sites"]))
