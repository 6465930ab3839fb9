"""Offline checks of the workflows, Dockerfiles, YAML and Python: what `nox -s lint` runs.

    python ci/lint.py                       # every check on this repository
    python ci/lint.py --only zizmor,policy  # some of them
    python ci/lint.py --root DIR            # another tree (the tests point it at seeded bad workflows)

Checks (each a function taking paths, so tests can aim them at a temporary directory):
  actionlint  workflow semantics, expressions, runner labels (.github/actionlint.yaml), shell via shellcheck
  schema      check-jsonschema --builtin-schema vendor.github-workflows
  zizmor      zizmor --offline (security audits; config .github/zizmor.yml)
  hadolint    every docker/**/Dockerfile* with .hadolint.yaml
  yamllint    workflows and YAML configs with .yamllint
  ruff        ruff check (pyproject.toml)
  policy      this project's rules for workflows (see check_policy), and every action pinned at a commit whose
              facts .github/actions.toml records, none on a Node runtime GitHub removed (check_action_pins)
Tools come from requirements/locks/lint.txt (hash-pinned); none needs the network.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHA_PIN = re.compile(r"^[^@\s]+@[0-9a-f]{40}$")
FORK_GUARD = "github.event.pull_request.head.repo.full_name == github.repository"
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
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise ToolMissing(
            f"{name!r} not found: install the lint tools with "
            "`pip install --require-hashes -r requirements/locks/lint.txt` (or run `nox -s lint`)"
        )
    return found


def _run(name: str, cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> Result:
    full_env = dict(os.environ)
    # Tools found next to the interpreter must see each other (actionlint calls shellcheck).
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=full_env, check=False)
    out = (proc.stdout + proc.stderr).strip()
    return Result(name, proc.returncode == 0, f"$ {' '.join(cmd)}\n{out}".strip())


def workflow_files(root: Path) -> list[Path]:
    wf = root / ".github" / "workflows"
    return sorted([*wf.glob("*.yml"), *wf.glob("*.yaml")]) if wf.is_dir() else []


def dockerfiles(root: Path) -> list[Path]:
    d = root / "docker"
    return sorted(p for p in d.rglob("Dockerfile*") if p.is_file()) if d.is_dir() else []


def _rel(paths: Iterable[Path], root: Path) -> list[str]:
    return [str(p.resolve().relative_to(root.resolve())) for p in paths]


def check_tool(root: Path, name: str, files: list[Path], cmd: list[str], config: str = "", flag: str = "") -> Result:
    """Run a linter (cmd[0], found by find_tool) on files, with its config file when the tree has one."""
    if not files:
        return Result(name, True, skipped="nothing to check")
    cmd = [find_tool(cmd[0]), *cmd[1:]]
    if config and (root / config).exists():
        cmd += [flag, str(root / config)]
    return _run(name, cmd + _rel(files, root), root)


def _shellcheck() -> list[str]:
    try:
        return ["-shellcheck", find_tool("shellcheck")]
    except ToolMissing:
        return ["-shellcheck="]  # explicit: without shellcheck the run: scripts are not linted


# ---------------------------------------------------------------------------------------------- policy


def _load_yaml(path: Path) -> Any:
    try:
        import yaml  # noqa: PLC0415 - pyyaml comes with the lint tools
    except ImportError as exc:
        raise ToolMissing("pyyaml not installed: install requirements/locks/lint.txt") from exc

    with path.open(encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    if isinstance(doc, dict) and True in doc and "on" not in doc:
        doc["on"] = doc.pop(True)  # YAML 1.1 reads the key `on` as the boolean true
    return doc


def _triggers(doc: dict[str, Any]) -> set[str]:
    on = doc.get("on", {})
    if isinstance(on, str):
        return {on}
    if isinstance(on, list):
        return set(on)
    return set(on or {})


def _runs_on_self_hosted(job: dict[str, Any]) -> bool:
    runs_on = job.get("runs-on", "")
    if isinstance(runs_on, dict):
        runs_on = runs_on.get("labels", [])
    labels = [runs_on] if isinstance(runs_on, str) else list(runs_on or [])
    # An expression may name self-hosted runners: treat it as if it does.
    return any("self-hosted" in str(label) or "${{" in str(label) for label in labels)


def _guarded(job_id: str, jobs: dict[str, Any], seen: set[str] | None = None) -> bool:
    """A job is fork-guarded when its `if:` checks the PR head repository, or a job it needs is
    (a skipped need skips it too, unless its own `if:` uses always()/failure()/cancelled())."""
    seen = seen or set()
    if job_id in seen:
        return False
    seen.add(job_id)
    job = jobs.get(job_id) or {}
    cond = str(job.get("if", ""))
    if re.sub(r"\s+", " ", FORK_GUARD) in re.sub(r"\s+", " ", cond):
        return True
    if re.search(r"\b(always|failure|cancelled)\(\)", cond):
        return False
    needs = job.get("needs", [])
    needs = [needs] if isinstance(needs, str) else list(needs or [])
    return any(_guarded(n, jobs, seen) for n in needs)


def check_policy_file(path: Path) -> list[str]:
    """This project's workflow rules; returns one message per violation."""
    name = path.name
    problems: list[str] = []
    try:
        doc = _load_yaml(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a finding, reported with its cause
        return [f"{name}: cannot parse: {exc}"]
    if not isinstance(doc, dict):
        return [f"{name}: not a workflow mapping"]
    triggers = _triggers(doc)
    jobs = doc.get("jobs") or {}
    if "pull_request_target" in triggers:
        problems.append(f"{name}: pull_request_target is forbidden (it runs with secrets on fork PRs)")
    if "workflow_run" in triggers:
        problems.append(f"{name}: workflow_run is forbidden (privileged context fed by untrusted runs)")
    if "permissions" not in doc:
        problems.append(f"{name}: no top-level `permissions:` (set `contents: read` and widen per job)")
    elif doc["permissions"] in ("write-all", "read-all") or (
        isinstance(doc["permissions"], dict) and any(v == "write" for v in doc["permissions"].values())
    ):
        problems.append(f"{name}: top-level permissions must be read-only; grant writes per job")
    if "concurrency" not in doc:
        problems.append(f"{name}: no `concurrency:` (superseded runs must be cancelled)")
    for job_id, job in jobs.items():
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
        if _runs_on_self_hosted(job) and triggers & {"pull_request", "pull_request_target"}:
            if not _guarded(job_id, jobs):
                problems.append(
                    f"{where}: runs on self-hosted runners on pull_request without a fork guard "
                    f"(`if:` on `{FORK_GUARD}`, on it or on a job it needs)"
                )
        for i, step in enumerate(job.get("steps") or []):
            uses = str(step.get("uses", "")) if isinstance(step, dict) else ""
            if not uses or uses.startswith("./") or uses.startswith("docker://"):
                continue
            label = f"{where} step {i + 1} ({uses})"
            if not SHA_PIN.match(uses):
                problems.append(f"{label}: action not pinned by a full 40-hex commit SHA")
            if uses.split("@")[0] == "actions/checkout":
                with_ = step.get("with") or {}
                if with_.get("persist-credentials") is not False:
                    problems.append(f"{label}: checkout must set `persist-credentials: false`")
                ref = str(with_.get("ref", ""))
                if "head" in ref and "pull_request" in ref:
                    problems.append(f"{label}: checks out the PR head ref explicitly")
    return problems


def load_action_facts(root: Path) -> dict[str, dict[str, Any]]:
    """.github/actions.toml: 'owner/repo@sha' -> its facts (version, runs_using, runs_inner)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = root / ".github" / "actions.toml"
    if not path.exists():
        return {}
    return {f"{a['repo']}@{a['sha']}": a for a in tomllib.loads(path.read_text(encoding="utf-8")).get("action", [])}


def check_action_pins(path: Path, facts: dict[str, dict[str, Any]]) -> list[str]:
    """Every remote action of a workflow is pinned at a commit recorded in .github/actions.toml, its version
    comment is that commit's version, and it (and any action it runs) declares a runtime GitHub still runs."""
    problems = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = USES_LINE.match(line)
        if not m or m.group(1).startswith(("./", "docker:")):
            continue
        repo = "/".join(m.group(1).split("/")[:2])
        where, pin = f"{path.name}:{n}", f"{repo}@{m.group(2)}"
        fact = facts.get(pin)
        if fact is None:
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
    if not workflows:
        return Result("policy", True, skipped="no workflows")
    facts = load_action_facts(root)
    problems = [p for wf in workflows for p in (*check_policy_file(wf), *check_action_pins(wf, facts))]
    return Result("policy", not problems, "\n".join(problems))


# ------------------------------------------------------------------------------------------------ main


def run_checks(root: Path, only: Iterable[str] | None = None) -> list[Result]:
    root = root.resolve()
    workflows = workflow_files(root)
    configs = [".github/actionlint.yaml", ".github/zizmor.yml", ".hadolint.yaml"]
    yaml_files = [*workflows, *[root / c for c in configs if (root / c).exists()]]
    checks: dict[str, Callable[[], Result]] = {
        "actionlint": lambda: check_tool(root, "actionlint", workflows, ["actionlint", "-no-color", *_shellcheck()],
                                         ".github/actionlint.yaml", "-config-file"),
        "schema": lambda: check_tool(root, "schema", workflows,
                                     ["check-jsonschema", "--builtin-schema", "vendor.github-workflows"]),
        "zizmor": lambda: check_tool(root, "zizmor", workflows, ["zizmor", "--offline", "--no-progress",
                                                                 "--color=never"], ".github/zizmor.yml", "--config"),
        "hadolint": lambda: check_tool(root, "hadolint", dockerfiles(root), ["hadolint", "--no-color"],
                                       ".hadolint.yaml", "--config"),
        "yamllint": lambda: check_tool(root, "yamllint", yaml_files, ["yamllint", "--strict", "-f", "parsable"],
                                       ".yamllint", "-c"),
        "ruff": lambda: _run("ruff", [find_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."],
                             root),
        "policy": lambda: check_policy(root, workflows),
    }
    wanted = list(only) if only else list(checks)
    unknown = [w for w in wanted if w not in checks]
    if unknown:
        raise SystemExit(f"lint: unknown check(s) {unknown}; known: {list(checks)}")
    results = []
    for name in wanted:
        try:
            results.append(checks[name]())
        except ToolMissing as exc:
            results.append(Result(name, False, str(exc)))
    return results


def render(results: list[Result]) -> str:
    lines = []
    for r in results:
        lines.append(f"{'SKIP' if r.skipped else 'PASS' if r.ok else 'FAIL'}  {r.name}"
                     + (f"  ({r.skipped})" if r.skipped else ""))
        if not r.ok and r.output:
            lines.extend("      " + line for line in r.output.splitlines())
    failed = [r.name for r in results if not r.ok]
    return "\n".join([*lines, f"lint: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Offline workflow, Dockerfile, YAML and Python checks.")
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--only", default="", help="comma-separated subset of checks")
    args = ap.parse_args(argv)
    results = run_checks(args.root, [o for o in args.only.split(",") if o] or None)
    print(render(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
