"""Rehearse the workflows on this machine with `act` (docs/runners.md says how and why).

    python -m ci.sessions.rehearse [JOB ...]   # ci.yml's jobs (default tests, a small selection, and smoke)
    python -m ci.sessions.rehearse gpu         # pull requests reach no GPU job; only green main runs publish
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ci.lint import ToolMissing, _load_yaml, find_tool, self_hosted
from ci.matrix import load
from ci.sessions.quickstart import clean_env, local_index

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
DEFAULT_JOBS = ["tests", "smoke"]
REHEARSED_PYTHON = "3.11"
DEFAULT_PYTEST_ARGS = "tests/ci/test_workflows.py -q -x"  # fast and meaningful; .ci/run runs the full suite
KEPT_ACTIONS = ("actions/checkout",)  # remote actions act would fetch from GitHub: only checkout is kept
HOST = ["-P", "ubuntu-latest=-self-hosted", "--container-daemon-socket", "-"]
SHA = "0123456789abcdef0123456789abcdef01234567"
# (name, event, payload, how the GPU legs end, the jobs expected to run). act has no cancelled result:
# "cancelled" rewrites `needs.gpu.result` in every `if:` to 'cancelled' while the legs pass.
MAIN, BRANCH = {"ref": "refs/heads/main"}, {"ref": "refs/heads/feature"}
PR_INPUTS = {"inputs": {"pr": "7", "sha": SHA, "cells": "", "gpus": ""}}
SCENARIOS = [("push to main, green", "push", MAIN, "success", {"plan", "gpu", "known-good"}),
    ("nightly, green", "schedule", MAIN, "success", {"plan", "gpu", "known-good"}),
    ("push to main, a leg failed", "push", MAIN, "failure", {"plan", "gpu"}),
    ("push to main, a leg cancelled", "push", MAIN, "cancelled", {"plan", "gpu"}),
    ("dispatch on main", "workflow_dispatch", {**MAIN, "inputs": {"pr": ""}}, "success", {"plan", "gpu"}),
    ("dispatch of a PR head", "workflow_dispatch", {**MAIN, **PR_INPUTS}, "success", {"plan", "gpu", "status"}),
    ("dispatch of a PR head, red", "workflow_dispatch", {**MAIN, **PR_INPUTS}, "failure", {"plan", "gpu", "status"}),
    ("dispatch from a branch", "workflow_dispatch", {**BRANCH, **PR_INPUTS}, "success", set()),
]
PULL_REQUESTS = {  # whose head repository: someone's fork, and this repository
    "fork": {"number": 7, "head": {"repo": {"full_name": "someone/nsa"}, "sha": SHA, "ref": "patch"}},
    "same-repo": {"number": 7, "head": {"repo": {"full_name": "nsa-project/nsa"}, "sha": SHA, "ref": "patch"}},
}


class RehearsalError(RuntimeError):
    pass


def act(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """act in cwd, made an empty git repository on main: act reads the commit and branch it runs for."""
    git = ["git", "-C", str(cwd), "-c", "user.name=rehearsal", "-c", "user.email=rehearsal@localhost"]
    for cmd in ([] if (cwd / ".git").exists() else [["init", "-q", "-b", "main"], ["commit", "-q",
                                                                                  "--allow-empty", "-m", "r"]]):
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    return subprocess.run([find_tool("act"), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=300)


def pr_gpu_jobs(workflows: Path, pull_request: dict[str, Any]) -> list[str]:
    """`workflow:job` of every self-hosted/GPU job that `act pull_request --list` plans for this event."""
    with tempfile.TemporaryDirectory(prefix="nsa-rehearse-") as tmp:
        event = Path(tmp) / "event.json"
        event.write_text(json.dumps({"pull_request": pull_request}))
        proc = act(["pull_request", "--list", "-e", str(event), "-W", str(workflows)], Path(tmp))
    table = proc.stdout.partition("Stage ")[2]
    if proc.returncode != 0 or not table:
        raise RehearsalError(f"act pull_request --list failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    rows = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[1:] if line.strip()]
    jobs = {(r[-2], r[1]): (_load_yaml(workflows / r[-2])["jobs"] or {}).get(r[1], {}) for r in rows}
    return sorted(f"{wf}:{job}" for (wf, job), spec in jobs.items() if self_hosted(spec))


def host_copy(doc: dict[str, Any], gpu_result: str) -> dict[str, Any]:
    """gpu.yml's triggers and jobs with their `if:`, `needs:` and output names, each job on this host printing
    its name; the two GPU legs end as gpu_result."""
    jobs = {}
    for job_id, job in doc["jobs"].items():
        fail = "\nif [ '${{ matrix.leg }}' = b ]; then exit 1; fi" * (job_id == "gpu" and gpu_result == "failure")
        jobs[job_id] = {**{k: job[k] for k in ("if", "needs") if k in job}, "runs-on": "ubuntu-latest",
                        "outputs": dict.fromkeys(job.get("outputs", {}), SHA),
                        "strategy": {"matrix": {"leg": ["a", "b"]}},
                        "steps": [{"run": f"printf 'NSA-REHEARSAL %s ran\\n' {job_id}{fail}"}]}
        if "if" in job and gpu_result == "cancelled":
            jobs[job_id]["if"] = str(job["if"]).replace("needs.gpu.result", "'cancelled'")
    return {**doc, "jobs": jobs}


def publish_rehearsal(doc: dict[str, Any]) -> list[str]:
    """gpu.yml (parsed) under each scenario: the jobs that ran against those expected; a line per deviation."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="nsa-rehearse-") as tmp:
        repo = Path(tmp)
        for name, event, payload, result, expected in SCENARIOS:
            (repo / "wf.yml").write_text(yaml.safe_dump(host_copy(doc, result), sort_keys=False))
            (repo / "event.json").write_text(json.dumps(payload))
            proc = act([event, "-W", "wf.yml", "-e", "event.json", *HOST], repo)
            ran = set(re.findall(r"NSA-REHEARSAL ([a-z][\w-]*) ran", proc.stdout + proc.stderr))
            verdict = "as expected" if ran == expected else f"EXPECTED {sorted(expected)}"
            print(f"rehearse gpu: {name:32s} ran {sorted(ran)} {verdict}", flush=True)
            if ran != expected:
                problems.append(f"{name}: ran {sorted(ran)}, expected {sorted(expected)}")
    return problems


def offline_copy(doc: dict[str, Any], jobs: list[str]) -> dict[str, Any]:
    """The workflow with only `jobs` (their `needs` dropped) and no remote actions but checkout."""
    if missing := [j for j in jobs if j not in doc.get("jobs", {})]:
        raise RehearsalError(f"no job(s) {missing} in ci.yml; jobs: {list(doc.get('jobs', {}))}")
    out = {**copy.deepcopy(doc), "jobs": {}}
    for job_id in jobs:
        job = copy.deepcopy(doc["jobs"][job_id])
        job.pop("needs", None)
        job["steps"] = [s for s in job.get("steps", []) if not (u := str(s.get("uses", ""))) or u.startswith("./")
                        or u.split("@")[0] in KEPT_ACTIONS]
        if not [s for s in job["steps"] if "run" in s]:
            raise RehearsalError(f"job {job_id}: no run: steps to rehearse")
        out["jobs"][job_id] = job
    return out


def main(argv: list[str] | None = None) -> int:
    jobs = (argv if argv is not None else sys.argv[1:]) or DEFAULT_JOBS
    try:
        if jobs == ["gpu"]:
            problems = [f"{kind} pull request: act plans GPU job(s) {found}" for kind, pr in PULL_REQUESTS.items()
                        if (found := pr_gpu_jobs(WORKFLOWS, pr))] + publish_rehearsal(_load_yaml(WORKFLOWS / "gpu.yml"))
            print("\n".join(f"rehearse gpu: FAIL {p}" for p in problems) or
                  "rehearse gpu: no pull request (fork, same repository) plans a GPU job; every scenario as expected")
            return 1 if problems else 0
        if not (ROOT / ".git").exists():
            raise RehearsalError(f"{ROOT} is not a git checkout: act needs one")
        rehearsal = offline_copy(_load_yaml(WORKFLOWS / "ci.yml"), jobs)
    except (RehearsalError, ToolMissing) as exc:
        print(f"rehearse: error: {exc}", file=sys.stderr)
        return 2
    matrix = load()
    cell = matrix.get(matrix.quickstart[REHEARSED_PYTHON])
    # act's host runner works in ~/.cache/act; keep it and its temp files out of the checkout.
    with local_index(matrix, cell) as index_env, tempfile.TemporaryDirectory(prefix="nsa-rehearse-") as tmp:
        wf = Path(tmp) / "ci-rehearsal.yml"
        wf.write_text(yaml.safe_dump(rehearsal, sort_keys=False), encoding="utf-8")
        failed = []
        for job in jobs:
            cmd = [find_tool("act"), "pull_request", "-W", str(wf), "-j", job, *HOST, "--action-offline-mode",
                   "--env", f"NSA_CI_PYTEST_ARGS={os.environ.get('NSA_CI_PYTEST_ARGS', DEFAULT_PYTEST_ARGS)}",
                   "--env", f"PIP_CONFIG_FILE={os.devnull}", "--matrix", f"python:{REHEARSED_PYTHON}",
                   *[a for k, v in index_env.items() for a in ("--env", f"{k}={v}")]]
            print(f"rehearse: {' '.join(cmd)}", flush=True)
            rc = subprocess.run(cmd, cwd=ROOT, env=clean_env(index_env), check=False).returncode
            print(f"rehearse: job {job}: {'PASS' if rc == 0 else f'FAIL (act exit {rc})'}", flush=True)
            failed += [job] if rc else []
    print(f"rehearse: FAILED jobs: {', '.join(failed)}" if failed else f"rehearse: {len(jobs)} job(s) passed",
          file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
