"""Offline checks of the workflows, Dockerfiles, YAML and Python: what `nox -s lint` runs.

    python ci/lint.py [--only zizmor,policy] [--root DIR]   # every check, or some; on another tree (tests)

TOOLS (actionlint with shellcheck, the workflow schema, zizmor, hadolint, yamllint, ruff; all from the hash-pinned
requirements/locks/lint.txt, all offline) and policy: the workflow rules and action pins (check_policy).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHA_PIN = re.compile(r"^[^@\s]+@[0-9a-f]{40}$")
MAIN_GUARD = "github.ref == 'refs/heads/main'"
# Events that run a pull request's (possibly a fork's) workflow file or code: no self-hosted job may follow.
PR_EVENTS = {"pull_request", "pull_request_target", "pull_request_review", "pull_request_review_comment",
             "issue_comment", "merge_group", "workflow_run"}
HOSTED = re.compile(r"(ubuntu|windows|macos)-[\w.-]+")  # GitHub-hosted runner images; anything else is ours
USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*['\"]?([^\s'\"@]+)@([^\s'\"#]+)['\"]?\s*(?:#\s*(\S+))?")
REMOVED_RUNTIMES = ("node12", "node16", "node20")  # GitHub's runners no longer run these


@dataclass
class Result:
    name: str
    ok: bool
    output: str = ""
    skipped: str = ""  # reason, when the check had nothing to check


class ToolMissing(RuntimeError):
    pass


def find_tool(name: str) -> str:
    """A tool from this interpreter's environment first (the lint venv), then PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise ToolMissing(f"{name!r} not found: install the lint tools with "
                          "`pip install --require-hashes -r requirements/locks/lint.txt` (or run `nox -s lint`)")
    return found


def _run(name: str, cmd: list[str], cwd: Path) -> Result:
    # Tools found next to the interpreter must see each other (actionlint calls shellcheck).
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, check=False)
    return Result(name, proc.returncode == 0, f"$ {' '.join(cmd)}\n{(proc.stdout + proc.stderr).strip()}".strip())


def workflow_files(root: Path) -> list[Path]:
    wf = root / ".github" / "workflows"
    return sorted([*wf.glob("*.yml"), *wf.glob("*.yaml")]) if wf.is_dir() else []


TOOLS = {  # check: (command, config file, its flag, for the files of run_checks)
    "actionlint": (["actionlint", "-no-color"], ".github/actionlint.yaml", "-config-file"),
    "schema": (["check-jsonschema", "--builtin-schema", "vendor.github-workflows"], "", ""),
    "zizmor": (["zizmor", "--offline", "--no-progress", "--color=never"], ".github/zizmor.yml", "--config"),
    "hadolint": (["hadolint", "--no-color"], ".hadolint.yaml", "--config"),
    "yamllint": (["yamllint", "--strict", "-f", "parsable"], ".yamllint", "-c"),
    "ruff": (["ruff", "check", "--no-cache", "--output-format", "concise"], "", ""),  # on the whole tree
}


def check_tool(root: Path, name: str, files: list[Path], cmd: list[str], config: str = "", flag: str = "") -> Result:
    """Run a linter (cmd[0], found by find_tool) on files, with its config file when the tree has one."""
    if not files:
        return Result(name, True, skipped="nothing to check")
    cmd = [find_tool(cmd[0]), *cmd[1:], *([flag, str(root / config)] if config and (root / config).exists() else [])]
    if name == "actionlint":  # explicit: without shellcheck the run: scripts would silently go unlinted
        try:
            cmd += ["-shellcheck", find_tool("shellcheck")]
        except ToolMissing:
            cmd += ["-shellcheck="]
    return _run(name, cmd + [str(p.resolve().relative_to(root.resolve())) for p in files], root)


def _load_yaml(path: Path) -> Any:
    try:
        import yaml  # noqa: PLC0415 - pyyaml comes with the lint tools
    except ImportError as exc:
        raise ToolMissing("pyyaml not installed: install requirements/locks/lint.txt") from exc
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    if isinstance(doc, dict) and True in doc and "on" not in doc:
        doc["on"] = doc.pop(True)  # YAML 1.1 reads the key `on` as the boolean true
    return doc


def runner_labels(job: dict[str, Any]) -> list[str]:
    r = job.get("runs-on", "")
    r = [f"group:{r.get('group')}", *r.get("labels", [])] if isinstance(r, dict) else r  # a group is never hosted
    return [r] if isinstance(r, str) else [str(x) for x in r or []]


def self_hosted(job: dict[str, Any]) -> bool:
    """Whether a job may land on one of our (GPU) runners: any label that is not a GitHub-hosted image name
    counts, an expression too (it may pick one at run time), and so does a runner group."""
    return any(not HOSTED.fullmatch(label) for label in runner_labels(job))


def main_guarded(job: dict[str, Any]) -> bool:
    """`if:` is MAIN_GUARD, or starts with `MAIN_GUARD &&` and has no ||, through which another ref could pass."""
    cond = " ".join(str(job.get("if", "")).split())
    cond = cond[3:-2].strip() if cond.startswith("${{") and cond.endswith("}}") else cond
    return cond == MAIN_GUARD or cond.startswith(f"{MAIN_GUARD} && ") and "||" not in cond


def check_policy_file(path: Path) -> list[str]:
    """This project's workflow rules; returns one message per violation."""
    name = path.name
    try:
        doc = _load_yaml(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a finding, reported with its cause
        return [f"{name}: cannot parse: {exc}"]
    if not isinstance(doc, dict):
        return [f"{name}: not a workflow mapping"]
    on, perms = doc.get("on", {}), doc.get("permissions", "absent")
    triggers = {on} if isinstance(on, str) else set(on or [])
    untrusted = sorted(triggers & PR_EVENTS)
    problems = [f"{name}: {msg}" for bad, msg in [
        ("pull_request_target" in triggers, "pull_request_target is forbidden (it runs with secrets on fork PRs)"),
        ("workflow_run" in triggers, "workflow_run is forbidden (privileged context fed by untrusted runs)"),
        (perms == "absent", "no top-level `permissions:` (set `contents: read` and widen per job)"),
        (perms in ("write-all", "read-all") or isinstance(perms, dict) and "write" in perms.values(),
         "top-level permissions must be read-only; grant writes per job"),
        ("concurrency" not in doc, "no `concurrency:` (superseded runs must be cancelled)")] if bad]
    for job_id, job in (doc.get("jobs") or {}).items():
        where = f"{name}: job {job_id!r}"
        if not isinstance(job, dict):
            continue
        if "uses" in job:  # reusable workflow call
            ref = str(job["uses"])
            if not ref.startswith("./") and not SHA_PIN.match(ref):
                problems.append(f"{where}: reusable workflow {ref!r} not pinned by a full commit SHA")
            continue
        if "timeout-minutes" not in job:
            problems.append(f"{where}: no timeout-minutes")
        if self_hosted(job):
            labels = runner_labels(job)
            if untrusted:
                problems.append(f"{where}: runs on self-hosted/GPU runners {labels} in a workflow triggered by "
                                f"{untrusted}: pull request code would reach them; accepted: GPU jobs only in "
                                "workflows without pull-request-like triggers (gpu.yml, dispatched for a PR head)")
            if not main_guarded(job):
                problems.append(f"{where}: runs on self-hosted/GPU runners {labels} without `if: {MAIN_GUARD}` "
                                f"(alone or followed by `&& ...` with no ||; found {job.get('if', 'no if:')!r})")
        for i, step in enumerate(job.get("steps") or []):
            uses = str(step.get("uses", "")) if isinstance(step, dict) else ""
            if not uses or uses.startswith(("./", "docker://")):
                continue
            label = f"{where} step {i + 1} ({uses})"
            if not SHA_PIN.match(uses):
                problems.append(f"{label}: action not pinned by a full 40-hex commit SHA")
            if uses.split("@")[0] == "actions/checkout":
                with_ = step.get("with") or {}
                ref = str(with_.get("ref", ""))
                problems += [f"{label}: {msg}" for bad, msg in [
                    (with_.get("persist-credentials") is not False, "checkout must set `persist-credentials: false`"),
                    ("head" in ref and "pull_request" in ref, "checks out the PR head ref explicitly")] if bad]
    return problems


def load_action_facts(root: Path) -> dict[str, dict[str, Any]]:
    """.github/actions.toml: 'owner/repo@sha' -> its facts (version, runs_using, runs_inner)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = root / ".github" / "actions.toml"
    actions = tomllib.loads(path.read_text(encoding="utf-8")).get("action", []) if path.exists() else []
    return {f"{a['repo']}@{a['sha']}": a for a in actions}


def check_action_pins(path: Path, facts: dict[str, dict[str, Any]]) -> list[str]:
    """Every remote action of a workflow is pinned at a commit recorded in .github/actions.toml, its version
    comment is that commit's version, and it (and any action it runs) declares a runtime GitHub still runs."""
    problems = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not (m := USES_LINE.match(line)) or m.group(1).startswith(("./", "docker:")):
            continue
        repo = "/".join(m.group(1).split("/")[:2])
        where, pin = f"{path.name}:{n}", f"{repo}@{m.group(2)}"
        if (fact := facts.get(pin)) is None:
            problems.append(f"{where}: {pin} is not recorded in .github/actions.toml (version, runs.using)")
            continue
        if m.group(3) != fact["version"]:
            problems.append(f"{where}: {pin} is {fact['version']}, but its comment says {m.group(3)!r}")
        for used in [pin, *fact.get("runs_inner", [])]:
            runtime = (facts.get(used) or {}).get("runs_using")
            if runtime is None:
                problems.append(f"{where}: {pin} runs {used}, which .github/actions.toml does not record")
            elif runtime in REMOVED_RUNTIMES:
                problems.append(f"{where}: {used} runs on {runtime}, which GitHub's runners no longer provide")
    return problems


def check_policy(root: Path, workflows: list[Path]) -> Result:
    """check_policy_file's workflow rules and check_action_pins on every workflow."""
    if not workflows:
        return Result("policy", True, skipped="no workflows")
    facts = load_action_facts(root)
    problems = [p for wf in workflows for p in (*check_policy_file(wf), *check_action_pins(wf, facts))]
    return Result("policy", not problems, "\n".join(problems))


def run_checks(root: Path, only: list[str] | None = None) -> list[Result]:
    root, names = root.resolve(), [*TOOLS, "policy"]
    if unknown := [w for w in only or [] if w not in names]:
        raise SystemExit(f"lint: unknown check(s) {unknown}; known: {names}")
    wfs = workflow_files(root)
    files = {"hadolint": sorted(p for p in (root / "docker").rglob("Dockerfile*") if p.is_file()),
             "yamllint": [*wfs, *(root / c for c in (".github/actionlint.yaml", ".github/zizmor.yml", ".hadolint.yaml")
                                  if (root / c).exists())], "ruff": [root]}
    results = []
    for name in only or names:
        try:
            results.append(check_policy(root, wfs) if name == "policy" else
                           check_tool(root, name, files.get(name, wfs), *TOOLS[name]))
        except ToolMissing as exc:
            results.append(Result(name, False, str(exc)))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Offline workflow, Dockerfile, YAML and Python checks.")
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--only", default="", help="comma-separated subset of checks")
    args = ap.parse_args(argv)
    results = run_checks(args.root, [o for o in args.only.split(",") if o] or None)
    for r in results:
        state = "SKIP" if r.skipped else "PASS" if r.ok else "FAIL"
        print(f"{state}  {r.name}" + (f"  ({r.skipped})" if r.skipped else ""))
        print("".join(f"      {line}\n" for line in r.output.splitlines()) if not r.ok else "", end="")
    failed = [r.name for r in results if not r.ok]
    print(f"lint: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
