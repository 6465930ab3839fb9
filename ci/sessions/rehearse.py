"""Rehearse ci.yml's CPU jobs on this machine with `act`: the workflow's own `run:` steps.

    python -m ci.sessions.rehearse                 # jobs tests (a small pytest selection) and smoke
    python -m ci.sessions.rehearse lint lock       # chosen jobs
    NSA_CI_PYTEST_ARGS="tests/cpu -q -x" python -m ci.sessions.rehearse tests

As on a fresh runner that reaches only package indexes: no pip configuration, the CPU cell's PyTorch index
served from 127.0.0.1 (ci.sessions.quickstart.local_index); matrix jobs run their Python 3.11 entry. act runs each
job on this host (`-P ubuntu-latest=-self-hosted`) from a copy of ci.yml without the remote `uses:` steps
but actions/checkout (runner preparation only; act would fetch them from GitHub), and this script checks
that every `run:` step of the chosen jobs is kept byte for byte. docs/runners.md says more.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from ci.lint import ToolMissing, _load_yaml, find_tool
from ci.matrix import load
from ci.sessions.quickstart import clean_env, local_index

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
DEFAULT_JOBS = ["tests", "smoke"]
REHEARSED_PYTHON = "3.11"
# A fast, meaningful selection for the rehearsal's `tests` job (the full suite runs in .ci/run).
DEFAULT_PYTEST_ARGS = "tests/cpu/test_workflows.py -q -x"
KEPT_ACTIONS = ("actions/checkout",)


class RehearsalError(RuntimeError):
    pass


def offline_copy(doc: dict[str, Any], jobs: list[str]) -> dict[str, Any]:
    """The workflow with only `jobs` (their `needs` dropped) and no remote actions but checkout."""
    missing = [j for j in jobs if j not in doc.get("jobs", {})]
    if missing:
        raise RehearsalError(f"no job(s) {missing} in ci.yml; jobs: {list(doc.get('jobs', {}))}")
    out = copy.deepcopy(doc)
    out["jobs"] = {}
    for job_id in jobs:
        job = copy.deepcopy(doc["jobs"][job_id])
        job.pop("needs", None)
        steps = []
        for step in job.get("steps", []):
            uses = str(step.get("uses", ""))
            if uses and not uses.startswith("./") and uses.split("@")[0] not in KEPT_ACTIONS:
                continue
            steps.append(step)
        job["steps"] = steps
        out["jobs"][job_id] = job
    # Proof: every run: step of the chosen jobs survives unchanged, in order.
    for job_id in jobs:
        want = [s["run"] for s in doc["jobs"][job_id].get("steps", []) if "run" in s]
        got = [s["run"] for s in out["jobs"][job_id]["steps"] if "run" in s]
        if want != got:
            raise RehearsalError(f"job {job_id}: the rehearsal copy lost or changed run: steps")
        if not got:
            raise RehearsalError(f"job {job_id}: no run: steps to rehearse")
    return out


def main(argv: list[str] | None = None) -> int:
    jobs = (argv if argv is not None else sys.argv[1:]) or DEFAULT_JOBS
    try:
        act = find_tool("act")
        if not (ROOT / ".git").exists():
            raise RehearsalError(f"{ROOT} is not a git checkout: act needs one")
        rehearsal = offline_copy(_load_yaml(WORKFLOW), jobs)
    except (RehearsalError, ToolMissing) as exc:
        print(f"rehearse: error: {exc}", file=sys.stderr)
        return 2
    pytest_args = os.environ.get("NSA_CI_PYTEST_ARGS", DEFAULT_PYTEST_ARGS)
    matrix = load()
    cell = matrix.get(matrix.quickstart[REHEARSED_PYTHON])
    # act's host runner works in ~/.cache/act; keep it and its temp files out of the checkout.
    with local_index(matrix, cell) as index_env, tempfile.TemporaryDirectory(prefix="nsa-rehearse-") as tmp:
        env = clean_env(index_env)
        passed = [a for k, v in index_env.items() for a in ("--env", f"{k}={v}")]
        wf = Path(tmp) / "ci-rehearsal.yml"
        wf.write_text(yaml.safe_dump(rehearsal, sort_keys=False), encoding="utf-8")
        failed = []
        for job in jobs:
            cmd = [
                act, "pull_request", "-W", str(wf), "-j", job,
                "-P", "ubuntu-latest=-self-hosted",
                "--env", f"NSA_CI_PYTEST_ARGS={pytest_args}", "--env", f"PIP_CONFIG_FILE={os.devnull}", *passed,
                "--matrix", f"python:{REHEARSED_PYTHON}",
                "--action-offline-mode", "--container-daemon-socket", "-",
            ]
            print(f"rehearse: {' '.join(cmd)}", flush=True)
            t0 = time.monotonic()
            rc = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
            print(f"rehearse: job {job}: {'PASS' if rc == 0 else f'FAIL (act exit {rc})'} "
                  f"in {time.monotonic() - t0:.0f}s", flush=True)
            if rc != 0:
                failed.append(job)
    if failed:
        print(f"rehearse: FAILED jobs: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"rehearse: {len(jobs)} job(s) passed under act: {', '.join(jobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
