"""The seeds' one-shot runner and the runbook script: thin wrappers, checked without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_runner_oneshot_runs_nox_oneshot_into_artifacts_runner(tmp_path):
    fake = tmp_path / "nox"
    log = tmp_path / "called"
    fake.write_text(f'#!/usr/bin/env bash\necho "$PWD|$NSA_ARTIFACTS|$*" > {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "NSA_NOX": str(fake), "NSA_NOX_ARGS": "--no-venv"}
    env.pop("NSA_ARTIFACTS", None)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "runner_oneshot.sh"), "--skip-no-gpu"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cwd, out, args = log.read_text().strip().split("|")
    assert Path(cwd) == ROOT and Path(out) == ROOT / "artifacts" / "runner"
    assert args == "--no-venv -s oneshot -- --skip-no-gpu"


def test_runner_oneshot_without_nox_says_how_to_get_it(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH with dirname and no nox
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    env = {"PATH": str(bin_dir), "NSA_NOX": str(tmp_path / "none"), "HOME": str(tmp_path)}
    res = subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "runner_oneshot.sh")], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "requirements/bootstrap.txt" in res.stderr, res.stderr


def test_runbook_script_runs_the_seed_commands_that_need_no_gpu():
    """Every step of tests/runbooks.sh is a command line of docs/migration.md (as written or its successor)."""
    script = (ROOT / "tests" / "runbooks.sh").read_text()
    page = (ROOT / "docs" / "migration.md").read_text()
    steps = [line.split('" ', 1)[1] for line in script.splitlines() if line.startswith('step "')]
    assert len(steps) >= 12
    for cmd in steps:
        cmd = cmd.strip()[1:-1].replace('\\"', '"')  # the quoted shell word, unescaped
        if cmd.startswith("export NSA_USE_FA2=1") or "NSA_SDPA_AUDIT=1 NSA_SEL" in cmd:
            continue  # the probe heredoc and the retired-toggle check: not one command line
        assert cmd.replace("NSA_DEBUG_LOG=1 NSA_LOG_LIMIT=5 ", "") in page or cmd in page, cmd
