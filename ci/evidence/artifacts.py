"""The artifact tree of GPU runs, artifacts/<commit>/<cell>/<gpu-slug>/, and the verdict (docs/gpu-suites.md).

One directory holds one run: the sessions sharing a run id (NSA_RUN_ID). state.json records each suite
(RUNNING, saved, before it starts); summary.md and known_good.json are rendered from it. State of another
run id is moved aside to `<gpu-slug>.previous/`, never merged."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATE_SCHEMA, KG_SCHEMA = "nsa-run/2", "nsa-known-good/1"
PASS, FAIL, RUNNING = "PASS", "FAIL", "RUNNING"
# Every one of these must run to completion and pass in one run for it to be known-good.
PLANNED_SUITES = ("gpu_parity", "backward", "bench")
SUITE_TITLES = {
    "gpu_parity": "GPU parity (FA-2 cmp/win, Triton selection if present, decode vs prefill, torch vs fp64 oracle)",
    "backward": "Grad/Train smokes (gradient parity, gradcheck fp64, training smoke: loss falls)",
    "bench": "Benches (prefill, decode, FA-2) + bench gate"}
KNOWN_GOOD, HOST_ENV, EVIDENCE = "known-good", "passes-on-host", "evidence"
# CI runs that may certify a commit: the commit on main that triggered them (a PR's merge commit, a manual
# run of another ref or commit, is evidence for that change only).
CERTIFYING_EVENTS, MAIN_REF = ("push", "schedule"), "refs/heads/main"
GITHUB_VARS = {"event": "GITHUB_EVENT_NAME", "ref": "GITHUB_REF", "repository": "GITHUB_REPOSITORY",
               "run_id": "GITHUB_RUN_ID", "run_attempt": "GITHUB_RUN_ATTEMPT", "sha": "GITHUB_SHA"}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def parse_date(text) -> _dt.datetime | None:
    """An ISO 8601 time with a UTC offset, else None (a time without an offset cannot be ordered)."""
    try:
        d = _dt.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return d if d.tzinfo is not None else None


def slug_path(text: str) -> str:
    """A path component: keep the ids' own spelling (cu130-torch2.11-py312), drop anything path-like."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", str(text)).strip("-.") or "unknown"


def gpu_slug(gpus: list[dict] | None) -> str:
    """[{'name': 'NVIDIA H200'}] -> 'nvidia-h200'; two of them -> '2x-nvidia-h200'; none -> 'no-gpu'."""
    names = [re.sub(r"[^a-z0-9]+", "-", str(g.get("name") or "unknown").lower()).strip("-") for g in gpus or []]
    return "+".join(f"{names.count(n)}x-{n}" if names.count(n) > 1 else n for n in dict.fromkeys(names)) or "no-gpu"


def new_run_id(environ=os.environ) -> str:
    """In GitHub Actions each session is its own nox call: the workflow run (and attempt) is the run."""
    if environ.get("GITHUB_RUN_ID"):
        return f"gh-{environ['GITHUB_RUN_ID']}-{environ.get('GITHUB_RUN_ATTEMPT') or 1}"
    return f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def github_context(environ=os.environ) -> dict | None:
    """GitHub's description of the CI run, or None for a local run."""
    if environ.get("GITHUB_ACTIONS") != "true" and not environ.get("GITHUB_EVENT_NAME"):
        return None
    return {k: environ.get(v) for k, v in GITHUB_VARS.items()}


def git_commit(root: Path = ROOT, environ=os.environ, exclude: str | None = None) -> dict:
    """{commit (full), commit_short, commit_source, dirty, changes}. Git runs with safe.directory=<root>: in a
    container, root does not own the runner's checkout and git would refuse it. Where git cannot answer:
    GITHUB_SHA, then NSA_COMMIT (a copy without .git); dirty is then None (not checked). Untracked files
    count as changes (a stray conftest.py or module changes what runs); `exclude` (the artifact folder) not."""
    def git(*args):
        try:
            return subprocess.run(["git", "-c", f"safe.directory={root}", *args], cwd=root, capture_output=True,
                                  text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            return subprocess.CompletedProcess(args, -1, "", str(e))

    head = git("rev-parse", "HEAD")
    if head.returncode == 0:
        st = git("status", "--porcelain", "--untracked-files=all", "--", ".",
                 *([f":(exclude){exclude}"] if exclude else []))
        changes = st.stdout.splitlines() if st.returncode == 0 else None
        sha = head.stdout.strip()
        return {"commit": sha, "commit_short": sha[:12], "commit_source": "git",
                "dirty": None if changes is None else bool(changes), "changes": (changes or [])[:20]}
    why = (head.stderr.strip().splitlines() or [f"exit {head.returncode}"])[-1]
    for var in ("GITHUB_SHA", "NSA_COMMIT", None):
        sha = environ.get(var, "").strip() if var else "unknown"
        if sha:
            return {"commit": sha, "commit_short": sha[:12], "commit_source": var, "dirty": None, "changes": [],
                    "git_error": why}


@dataclass
class Result:
    returncode: int
    seconds: float
    tail: list[str]
    log: Path


def run_logged(cmd: list[str], log: Path, *, env: dict | None = None, cwd: Path = ROOT, echo=True,
               timeout: float | None = None) -> Result:
    """Run cmd in a process group of its own, streaming stdout+stderr to the console and to `log` (the
    command line first). After `timeout` seconds the group is killed: rc 124, and the tail says so."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0, tail = time.perf_counter(), []
    with log.open("w") as fh:
        print("$ " + " ".join(cmd), file=fh, flush=True)
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", bufsize=1, start_new_session=True)
        except OSError as e:
            fh.write(f"could not start: {e}\n")
            return Result(127, 0.0, [f"could not start: {e}"], log)

        def pump():  # a thread, so that the wait below can time out while the output is still open
            for line in proc.stdout:
                fh.write(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                tail.append(line.rstrip("\n"))
                if len(tail) > 200:
                    del tail[:100]

        reader, rc = threading.Thread(target=pump, daemon=True), None
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also on an interrupt: xdist workers and a bench's children must not outlive the step
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            reader.join(timeout=10)
        if rc is None:
            rc = 124
            tail.append(f"timed out after {round(timeout, 1):g} s: the command's process group was killed")
            fh.write(tail[-1] + "\n")
        fh.write(f"\n[exit {rc} after {time.perf_counter() - t0:.1f} s]\n")
    return Result(rc, time.perf_counter() - t0, tail, log)


def collect_env(python: str, out: Path, *, env: dict | None = None) -> dict:
    """Write env.json from `python -m nsa_env --json`; on failure write (and return) the failure itself."""
    rc, stdout, stderr, report = -1, "", "", None
    try:
        p = subprocess.run([python, "-m", "nsa_env", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
        report = json.loads(stdout) if rc == 0 else None
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        stderr = f"{e}: {stdout[:500]}\n{stderr}"
    report = report or {"error": "`python -m nsa_env --json` failed", "returncode": rc, "stderr": stderr[-4000:],
                        "python": {"executable": python}}
    report.setdefault("host", socket.gethostname())
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def env_facts(report: dict) -> dict:
    """The fields the summary and known_good.json need, from an env.json (tolerant of a failed one)."""
    gpus, sub = report.get("gpus") or [{}], {k: report.get(k) or {} for k in ("torch", "driver", "triton")}
    return {"host": report.get("host") or socket.gethostname(), "gpus": [g.get("name") for g in gpus if g],
            "gpu": gpus[0].get("name"), "gpu_count": len([g for g in gpus if g]), "sm": gpus[0].get("sm"),
            "driver": sub["driver"].get("version"), "python": (report.get("python") or {}).get("version"),
            **{k: sub["torch"].get(k) for k in ("cuda", "cudnn")}, "torch": sub["torch"].get("version"),
            "triton": sub["triton"].get("version"), "flash_attn": (report.get("flash_attn") or {}).get("version"),
            "cell": report.get("cell"), "env_error": report.get("error")}


def parse_junit(path: Path) -> dict:
    """{'tests', 'passed', 'failed', 'errors', 'skipped', 'skip_reasons': [...], 'failures': [...]} ."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skip_reasons": [], "failures": []}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {**counts, "missing": True}
    for case in root.iter("testcase"):
        kind = next((k for k in ("failure", "error", "skipped") if case.find(k) is not None), None)
        counts["tests"] += 1
        counts[{"failure": "failed", "error": "errors", "skipped": "skipped"}.get(kind, "passed")] += 1
        if kind in ("failure", "error"):
            counts["failures"].append(f"{case.get('classname', '')}::{case.get('name', '')}")
        elif kind and case.find(kind).get("message") not in (None, "", *counts["skip_reasons"]):
            counts["skip_reasons"].append(case.find(kind).get("message"))
    counts["skip_reasons"], counts["failures"] = counts["skip_reasons"][:10], counts["failures"][:20]
    return counts


def suite_status(returncode: int, counts: dict, missing: list[str] | None = None) -> tuple[str, list[str]]:
    """PASS only when pytest exited 0, nothing failed, at least one test passed and no expected file is missing."""
    notes = ["missing test files: " + ", ".join(missing)] if missing else []
    if returncode == 5 or counts.get("tests", 0) == 0:
        notes.append("no tests ran")
    elif counts.get("passed", 0) == 0:
        notes.append("every test was skipped")
    if returncode == 124:
        notes.append("timed out: the suite's time limit was reached and pytest was killed")
    elif returncode not in (0, 5):
        notes.append(f"pytest exited {returncode}")
    ok = returncode == 0 and counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("errors")
    return (PASS if ok and not missing else FAIL), notes


class RunDir:
    """artifacts/<commit>/<cell>/<gpu-slug>/ and its state.json, for one run id."""

    def __init__(self, path: Path, *, run_id: str, cell: str, gpu_slug: str, commit: dict | None = None,
                 github: dict | None = None, log=print):
        self.path, self.state_path = Path(path), Path(path) / "state.json"
        old = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        if old and old.get("run_id") != run_id:
            aside = self.path.with_name(self.path.name + ".previous")
            shutil.rmtree(aside, ignore_errors=True)
            self.path.rename(aside)
            log(f"artifacts: {self.path} held run {old.get('run_id')!r}, not this run {run_id!r}: moved to "
                f"{aside.name}/, starting fresh (one run id per invocation: NSA_RUN_ID)")
            old = {}
        (self.path / "logs").mkdir(parents=True, exist_ok=True)
        self.state = old or {"schema": STATE_SCHEMA, "run_id": run_id, "created": now_iso(), "suites": {},
                             "benches": {}, "steps": [], "dirty": False, "changes": []}
        commit = commit or {"commit": "unknown", "commit_short": "unknown", "dirty": None}
        # A run is dirty (or unchecked) when any of its sessions saw its tree so.
        was, now = self.state.get("dirty"), commit.get("dirty")
        self.state.update(commit, dirty=True if True in (was, now) else (None if None in (was, now) else False),
                          changes=list(dict.fromkeys(self.state.get("changes", []) + commit.get("changes", [])))[:20],
                          cell=cell, gpu_slug=gpu_slug, github=github)

    @classmethod
    def create(cls, base: Path, cell: str, gpus: list[dict] | None, **kw) -> RunDir:
        gs = gpu_slug(gpus)
        short = (kw.get("commit") or {}).get("commit_short", "unknown")
        return cls(Path(base) / slug_path(short) / slug_path(cell) / gs, cell=cell, gpu_slug=gs, **kw)

    def rel(self, p: Path | str) -> str:
        return str(Path(p).resolve().relative_to(self.path.resolve()))

    def save(self) -> None:
        self.state["updated"] = now_iso()
        self.state_path.write_text(json.dumps(self.state, indent=2, default=str) + "\n")

    def set_env(self, report: dict) -> None:
        self.state["env"] = env_facts(report)

    def set_lock(self, cell: str, check: dict | None) -> None:
        lock = ROOT / "requirements" / "locks" / f"{cell}.txt"
        sha = hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None
        self.state["lock"] = {"path": str(lock.relative_to(ROOT)) if sha else None, "sha256": sha}
        if check is not None:
            self.state["lock"]["check"] = {k: (len(v) if isinstance(v, list) else v) for k, v in check.items()
                if k in ("missing", "extra", "wrong_version", "local_label", "matching", "drift", "error")}
        self.state["image"] = {"digest": os.environ.get("NSA_IMAGE_DIGEST") or None,
                               "name": os.environ.get("NSA_IMAGE") or None}

    def begin_suite(self, name: str, timeout_s: float) -> None:
        """Recorded, saved and rendered before the suite starts: a crash, kill or timeout leaves it RUNNING."""
        self.state["suites"][name] = {"status": RUNNING, "started": now_iso(), "timeout_s": timeout_s}
        self.finalize()

    def record_suite(self, name: str, **fields) -> None:
        self.state["suites"][name] = {**self.state["suites"].get(name, {}), "finished": now_iso(), **fields}

    def record_bench(self, name: str, **fields) -> None:
        self.state["benches"][name] = {"finished": now_iso(), **fields}

    def record_step(self, name: str, status: str, seconds: float, log: str | None = None, note: str = "") -> None:
        self.state["steps"] = [s for s in self.state.get("steps", []) if s["name"] != name] + [
            {"name": name, "status": status, "seconds": round(seconds, 2), "log": log, "note": note}]

    def finalize(self) -> None:
        self.save()
        where = self.path.resolve()
        kg = known_good_record(self.state, str(where.relative_to(ROOT) if where.is_relative_to(ROOT) else where))
        (self.path / "known_good.json").write_text(json.dumps(kg, indent=2) + "\n")
        files = sorted({self.rel(p) for p in self.path.rglob("*") if p.is_file()} | {"summary.md"})
        (self.path / "summary.md").write_text(render_summary(self.state, kg, files))


def lock_differences(chk: dict | None) -> int | None:
    """How many packages of the cell's lock are missing or at another version; None when not checked."""
    ok = chk and not chk.get("error") and "missing" in chk
    return int(chk.get("missing") or 0) + int(chk.get("wrong_version") or 0) if ok else None


def provenance_problems(entry: dict) -> list[str]:
    """Why the run cannot certify its commit: no run id, an unknown or dirty tree, a CI run not on main."""
    problems = [] if entry.get("run_id") else ["no run id: the suites are not shown to come from one run"]
    commit, gh = str(entry.get("commit") or "unknown"), entry.get("github")
    if commit == "unknown":
        problems.append("commit unknown (git could not answer; no GITHUB_SHA or NSA_COMMIT)")
    if entry.get("dirty"):
        problems.append("uncommitted changes in the tree (tracked or untracked files)")
    elif entry.get("dirty") is None and not (gh and entry.get("commit_source") == "GITHUB_SHA"):
        src = entry.get("commit_source")
        problems.append("the tree was not checked for changes" + (f" (git did not answer; commit from {src})"
                                                                 if src else ""))
    if gh:
        if gh.get("event") not in CERTIFYING_EVENTS or gh.get("ref") != MAIN_REF:
            problems.append(f"a {gh.get('event')} run on {gh.get('ref')}: CI certifies only push and schedule "
                            f"runs on {MAIN_REF}")
        elif gh.get("sha") != commit:  # GITHUB_SHA: the commit on main that triggered the run
            problems.append(f"tested commit {commit[:12]}, not the commit {str(gh.get('sha'))[:12]} that triggered "
                            "the run")
    return problems


def verdict(entry: dict) -> tuple[str, str]:
    """(status, reason) of a run record (known_good.json). Known-good: every planned suite ran to completion
    and passed in this run, on a GPU, from a clean committed tree, locally or in a push/schedule run on main,
    with every package of the cell's lock at its locked version (extra packages are listed, not fatal)."""
    suites = entry.get("suites") or {}
    bad = [f"{n} did not finish (left RUNNING: killed, crashed or timed out)" if s.get("status") == RUNNING
           else f"{n} ({s.get('status')})" for n, s in sorted(suites.items()) if s.get("status") != PASS]
    if bad:
        return "failing", "suites not passing: " + "; ".join(bad)
    missing = [n for n in PLANNED_SUITES if n not in suites]
    if missing:
        return "incomplete", "suites not run in this run: " + ", ".join(missing)
    if not entry.get("gpu_count"):
        return "incomplete", "no GPU in the environment report"
    passed = "all suites passed: " + ", ".join(sorted(suites))
    problems = provenance_problems(entry)
    if problems:
        return EVIDENCE, f"{passed}; not known-good: " + "; ".join(problems)
    check = entry.get("lock_check")
    differ = lock_differences(check)
    if differ is None:
        return HOST_ENV, f"{passed}; the installed set was not checked against the cell's lock"
    if differ:
        return HOST_ENV, (f"{passed}; {differ} package(s) of the cell's lock missing or at another version "
                          f"({check.get('missing', 0)} missing, {check.get('wrong_version', 0)} other version)")
    if ((entry.get("overlay") or {}).get("pip_check") or {}).get("returncode"):
        return HOST_ENV, f"{passed}; `pip check` failed in the overlay venv (its nsa-overlay.json says why)"
    extra = f"; {check['extra']} extra package(s) installed" if check.get("extra") else ""
    return KNOWN_GOOD, f"{passed}, every package of the cell's lock at its locked version{extra}"


def status_text(entry: dict) -> str:
    """How KNOWN_GOOD.md shows a status: `passes on host environment (N packages differ)`."""
    differ = lock_differences(entry.get("lock_check"))
    differ = "lock not checked" if differ is None else f"{differ} packages differ"
    return {EVIDENCE: "passes, evidence only", HOST_ENV: f"passes on host environment ({differ})"}.get(
        entry.get("status"), str(entry.get("status")))


def run_seconds(state: dict) -> float | None:
    a, b = parse_date(state.get("created")), parse_date(state.get("updated"))
    return (b - a).total_seconds() if a and b else None


def overlay_facts(overlay: dict | None) -> dict | None:
    """What a published entry keeps of an overlay venv's record: what it installed and `pip check`'s answer
    (the host's paths stay in state.json)."""
    return {k: overlay.get(k) for k in ("install", "pip_check")} if overlay else None


def known_good_record(state: dict, artifact_dir: str) -> dict:
    """The run's entry for KNOWN_GOOD.md; its status comes from verdict()."""
    e, gate, lock = state.get("env") or {}, state.get("gate") or {}, state.get("lock") or {}
    entry = {"schema": KG_SCHEMA, "cell": state.get("cell"), "gpu": e.get("gpu"), "gpu_slug": state.get("gpu_slug"),
        "gpu_count": e.get("gpu_count", 0), "sm": e.get("sm"), "driver": e.get("driver"), "host": e.get("host"),
        **{k: state.get(k) for k in ("run_id", "commit", "commit_short", "commit_source", "dirty", "github")},
        "started": state.get("created"), "date": state.get("updated") or now_iso(), "run_seconds": run_seconds(state),
        "versions": {k: e.get(k) for k in ("python", "torch", "triton", "cuda", "cudnn", "flash_attn")},
        "lock": {k: lock.get(k) for k in ("path", "sha256")}, "lock_check": lock.get("check"),
        "image_digest": (state.get("image") or {}).get("digest"), "overlay": overlay_facts(state.get("overlay")),
        "suites": {n: {"status": s.get("status"), "runtime_s": s.get("runtime_s"),
                       **{k: (s.get("counts") or {}).get(k) for k in ("passed", "failed", "skipped")}}
                   for n, s in sorted((state.get("suites") or {}).items())}, "bench_gate": gate.get("status"),
        "headline": {r["figure"]: round(float(r["value"]), 4) for r in gate.get("rows") or []},
        "artifacts": artifact_dir,
    }
    entry["status"], entry["reason"] = verdict(entry)
    return entry


def _fmt_s(s) -> str:
    return "n/a" if s is None else f"{float(s):.1f} s" if float(s) < 120 else f"{float(s) / 60:.1f} min"


def _suite_line(name: str, s: dict | None) -> str:
    title = SUITE_TITLES.get(name, name)
    if not s:
        return f"- {title}: NOT RUN"
    if s.get("status") == RUNNING:
        return f"- {title}: RUNNING since {s.get('started')}: not finished (killed, crashed or timed out)"
    c = s.get("counts") or {}
    parts = [_fmt_s(s.get("runtime_s"))] + ([f"limit {_fmt_s(s['timeout_s'])}"] if s.get("timeout_s") else [])
    if c:
        parts.append(f"{c.get('passed', 0)} passed, {c.get('failed', 0) + c.get('errors', 0)} failed, "
                     f"{c.get('skipped', 0)} skipped")
    return "\n  - ".join([f"- {title}: {s.get('status', '?')} ({'; '.join(parts)})", *(s.get("notes") or []),
                          *[f"skipped: {r}" for r in (c.get("skip_reasons") or [])[:5]],
                          *[f"failed: {f}" for f in (c.get("failures") or [])[:10]]])


def render_summary(state: dict, kg: dict, files: list[str]) -> str:
    e, lock, gh, suites = (state.get(k) or {} for k in ("env", "lock", "github", "suites"))
    gpu = (f"{e['gpu_count']} x " if e.get("gpu_count", 0) > 1 else "") + (e.get("gpu") or "no GPU")
    dirty = {True: " (uncommitted changes)", None: " (tree not checked)"}.get(state.get("dirty"), "")
    chk, image = lock.get("check") or {}, state.get("image") or {}
    lines = [f"# NSA GPU run: {state.get('cell')} on {state.get('gpu_slug')}", "", "```",
        f"GPU Host: {e.get('host', 'unknown')} / {gpu} / Driver {e.get('driver') or 'unknown'}",
        f"Commit: {state.get('commit')}{dirty} (from {state.get('commit_source')})",
        f"Torch/Triton/CUDA: torch {e.get('torch')}, triton {e.get('triton')}, cuda {e.get('cuda')}",
        f"Python: {e.get('python')}; cell: {state.get('cell')}; flash-attn: {e.get('flash_attn') or 'not installed'}",
        f"Run: {state.get('run_id')}, {state.get('created')} to {state.get('updated')} "
        f"(wall time {_fmt_s(run_seconds(state))})",
        "CI: " + (", ".join(f"{k} {v}" for k, v in gh.items() if v) or "none (local run)"), "```",
        *[f"- uncommitted: {c}" for c in state.get("changes") or []],
        *(["", f"**Environment report failed**: {e['env_error']} (see env.json)"] if e.get("env_error") else []),
        "", f"Lock: {lock.get('path')} (sha256 {str(lock.get('sha256'))[:16]}...)" + (
            f"; installed vs lock: {chk.get('matching', 0)} matching, {chk.get('missing', 0)} missing, "
            f"{chk.get('wrong_version', 0)} other version, {chk.get('extra', 0)} extra" if chk else ""),
        *([f"Image: {image.get('name') or ''} {image['digest']}"] if image.get("digest") else []),
        "", "## Tests", "", *[_suite_line(n, suites.get(n)) for n in ("gpu_parity", "backward")],
        *[_suite_line(n, s) for n, s in sorted(suites.items()) if n not in PLANNED_SUITES],
        "", "## Benches", "", *([] if state.get("benches") else ["- not run"])]
    for name, b in sorted((state.get("benches") or {}).items()):
        note = f": {b['note']}" if b.get("note") else ""
        lines += [f"- {name} bench: {b.get('status')} ({_fmt_s(b.get('runtime_s'))}){note}",
                  *[f"  - {x}" for x in b.get("summary") or []]]
    gate = state.get("gate") or {}
    if gate:
        lines += [f"- Bench gate ({gate.get('class')}, allowance {gate.get('allowance', 0):.0%}): {gate.get('status')}",
                  *[f"  - {x}" for x in gate.get("lines") or []]]
    lines += [_suite_line("bench", suites.get("bench"))] + (["", "## Steps", ""] if state.get("steps") else [])
    lines += [f"- {x['name']}: {x['status']} ({_fmt_s(x.get('seconds'))})" + (f" [{x['log']}]" if x.get("log") else "")
              + (f" - {x['note']}" if x.get("note") else "") for x in state.get("steps") or []]
    lines += ["", "## Report template", "", "```", *state["template"], "```"] if state.get("template") else []
    lines += ["", f"## Verdict: {status_text(kg)}", "", kg["reason"], "", "## Artifacts", ""]
    return "\n".join(lines + [f"- {f}" for f in files]) + "\n"
