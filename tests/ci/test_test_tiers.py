"""The suite's tiers. The quick tier (`-m "not slow"`) drops cases of a sweep, never a whole test: every test
function with a `slow` case keeps a case in it, except the sm 8.0 / 9.0 compile check, which only the full suite
runs (a few minutes of compiling). The core tier (`-m "not slow and (sample or not heavy)"`, what CI runs on its
other Pythons and in the test plan's `pytest -q`) also drops the heavy files' tests (Triton's interpreter,
Inductor) but their `sample` ones: every heavy file keeps at least one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FULL_SUITE_ONLY = "tests/cpu/test_triton_compile_sm80_sm90.py"
CORE = "not slow and (sample or not heavy)"


def _collected(marker: str) -> set[str]:
    """The test functions (path::name, parameters dropped) that `-m marker` collects in tests/cpu."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTEST_ADDOPTS": ""}
    res = subprocess.run([sys.executable, "-m", "pytest", "tests/cpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", marker], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return {ln.split("[", 1)[0] for ln in res.stdout.splitlines() if "::" in ln}


def test_the_quick_tier_keeps_a_case_of_every_test():
    slow, quick = _collected("slow"), _collected("not slow")
    assert slow and quick
    dropped = {name for name in slow - quick if not name.startswith(FULL_SUITE_ONLY)}
    assert not dropped, f"tests with no case left in the quick tier: {sorted(dropped)}"
    assert not any(name.startswith(FULL_SUITE_ONLY) for name in quick), "the compile check runs in the full suite"


def test_the_core_tier_keeps_a_sample_of_every_heavy_file():
    heavy, core = _collected("heavy"), _collected(CORE)
    files = lambda names: {n.split("::", 1)[0] for n in names}  # noqa: E731
    assert "tests/cpu/test_compile.py" in files(heavy)
    assert all(Path(f).name.endswith("_interp.py") for f in files(heavy) - {"tests/cpu/test_compile.py"})
    assert not files(heavy) - files(core), f"heavy files with no sample: {sorted(files(heavy) - files(core))}"
    kept = heavy & core
    assert len(kept) < len(heavy) / 4, f"the core tier keeps {len(kept)} of {len(heavy)} heavy tests"
    assert _collected("not slow and not heavy") <= core, "the core tier drops a test that is not heavy"


def test_ci_runs_the_core_tier():
    assert f"core='-m \"{CORE}\"'" in (ROOT / ".ci" / "run").read_text()
