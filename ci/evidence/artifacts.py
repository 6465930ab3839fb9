"""The artifact tree of GPU runs: artifacts/<commit>/<cell>/<gpu-slug>/.

One run directory per (commit, cell, GPU set). Every GPU session (gpu_parity, backward, bench, oneshot)
records its part in `state.json` there and re-renders the derived files, so running the sessions one
by one or together gives the same tree:

    env.json                  `python -m nsa.env --json` (or its failure: returncode, stderr)
    lock-check.json           `python -m nsa.env --check-lock <cell> --json` (drift of installed packages)
    nvidia-smi.txt            `nvidia-smi` output (when present)
    junit-<suite>.xml         pytest's JUnit XML per suite
    logs/<step>.log           stdout+stderr of every command (routing probe: NSA_DEBUG_LOG=1 NSA_LOG_LIMIT=5)
    telemetry.json            nsa.telemetry counters of the routing probe (which backend served each branch)
    bench-*.csv (+ .json)     bench outputs with their environment sidecars; bench-headline.json; gate.json
    summary.md                the seeds' reporting template, filled in
    known_good.json           what ci/evidence/known_good.py merges into KNOWN_GOOD.md
    README.md                 index of this directory
    state.json                the record everything above is rendered from
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATE_SCHEMA = "nsa-run/1"
KG_SCHEMA = "nsa-known-good/1"
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# The correctness suites a cell needs before it can be called known-good (bench joins when it was run).
REQUIRED_SUITES = ("gpu_parity", "backward")
SUITE_TITLES = {
    "gpu_parity": "GPU parity (FA-2 cmp/win, Triton selection if present, decode vs prefill, torch vs fp64 oracle)",
    "backward": "Grad/Train smokes (gradient parity, gradcheck fp64, training smoke: loss falls)",
    "bench": "Benches (prefill, decode, FA-2) + bench gate",
}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "unknown"


def gpu_slug(gpus: list[dict] | None) -> str:
    """[{'name': 'NVIDIA H200'}] -> 'nvidia-h200'; two of them -> '2x-nvidia-h200'; none -> 'no-gpu'."""
    if not gpus:
        return "no-gpu"
    names = [g.get("name") or "unknown" for g in gpus]
    parts = []
    for name in dict.fromkeys(names):
        n = names.count(name)
        parts.append(f"{n}x-{slug(name)}" if n > 1 else slug(name))
    return "+".join(parts)


def git_commit(root: Path = ROOT) -> tuple[str, bool | None]:
    """(short commit, dirty). NSA_COMMIT overrides (a copy of the tree without .git); else 'unknown'."""
    forced = os.environ.get("NSA_COMMIT", "").strip()
    if forced:
        return forced, None
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=20)
        if sha.returncode != 0:
            return "unknown", None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                            capture_output=True, text=True, timeout=20)
        return sha.stdout.strip(), bool(st.stdout.strip()) if st.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


# --- running commands --------------------------------------------------------------------------------


@dataclass
class Result:
    returncode: int
    seconds: float
    tail: list[str]
    log: Path


def run_logged(cmd: list[str], log: Path, *, env: dict | None = None, cwd: Path = ROOT, echo=True,
               timeout: float | None = None) -> Result:
    """Run cmd, streaming stdout+stderr to the console and to `log`; the command line heads the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tail: list[str] = []
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", bufsize=1)
        except OSError as e:
            fh.write(f"could not start: {e}\n")
            return Result(127, 0.0, [f"could not start: {e}"], log)
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            tail.append(line.rstrip("\n"))
            if len(tail) > 200:
                del tail[:100]
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = 124
        fh.write(f"\n[exit {rc} after {time.perf_counter() - t0:.1f} s]\n")
    return Result(rc, time.perf_counter() - t0, tail, log)


def collect_env(python: str, out: Path, *, env: dict | None = None) -> dict:
    """Write env.json from `python -m nsa.env --json`; on failure write (and return) the failure itself."""
    try:
        p = subprocess.run([python, "-m", "nsa.env", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        rc, stdout, stderr = -1, "", str(e)
    report = None
    if rc == 0:
        try:
            report = json.loads(stdout)
        except json.JSONDecodeError as e:
            stderr = f"output is not JSON ({e}): {stdout[:500]}\n{stderr}"
    if report is None:
        report = {"error": "`python -m nsa.env --json` failed", "returncode": rc,
                  "stderr": stderr[-4000:], "python": {"executable": python}}
    report.setdefault("host", socket.gethostname())
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def env_facts(report: dict) -> dict:
    """The fields the summary and known_good.json need, from an env.json (tolerant of a failed one)."""
    t = report.get("torch") or {}
    gpus = report.get("gpus") or []
    return {
        "host": report.get("host") or socket.gethostname(),
        "gpus": [g.get("name") for g in gpus],
        "gpu": gpus[0].get("name") if gpus else None,
        "gpu_count": len(gpus),
        "sm": gpus[0].get("sm") if gpus else None,
        "driver": (report.get("driver") or {}).get("version"),
        "driver_cuda": (report.get("driver") or {}).get("cuda"),
        "python": (report.get("python") or {}).get("version"),
        "torch": t.get("version"),
        "cuda": t.get("cuda"),
        "cudnn": t.get("cudnn"),
        "triton": (report.get("triton") or {}).get("version"),
        "flash_attn": (report.get("flash_attn") or {}).get("version"),
        "cell": report.get("cell"),
        "env_error": report.get("error"),
    }


def parse_junit(path: Path) -> dict:
    """{'tests', 'passed', 'failed', 'errors', 'skipped', 'skip_reasons': [...], 'failures': [...]} ."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skip_reasons": [], "failures": []}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        counts["missing"] = True
        return counts
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            counts["failures"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            msg = case.find("skipped").get("message", "")
            if msg and msg not in counts["skip_reasons"]:
                counts["skip_reasons"].append(msg)
        else:
            counts["passed"] += 1
    counts["skip_reasons"] = counts["skip_reasons"][:10]
    counts["failures"] = counts["failures"][:20]
    return counts


def suite_status(returncode: int, counts: dict, missing: list[str] | None = None) -> tuple[str, list[str]]:
    """PASS only when pytest exited 0, nothing failed, at least one test passed and no expected file is missing."""
    notes = []
    if missing:
        notes.append("missing test files: " + ", ".join(missing))
    if returncode == 5 or counts.get("tests", 0) == 0:
        notes.append("no tests ran")
    elif counts.get("passed", 0) == 0:
        notes.append("every test was skipped")
    if returncode not in (0, 5):
        notes.append(f"pytest exited {returncode}")
    ok = returncode == 0 and counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("errors")
    return (PASS if ok and not missing else FAIL), notes


# --- the run directory -------------------------------------------------------------------------------


class RunDir:
    """artifacts/<commit>/<cell>/<gpu-slug>/ and its state.json."""

    def __init__(self, path: Path, *, commit: str, cell: str, gpu_slug: str, dirty: bool | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "logs").mkdir(exist_ok=True)
        self.state_path = self.path / "state.json"
        if self.state_path.exists():
            self.state = json.loads(self.state_path.read_text())
        else:
            self.state = {"schema": STATE_SCHEMA, "created": now_iso(), "suites": {}, "benches": {}, "steps": []}
        self.state.update(commit=commit, cell=cell, gpu_slug=gpu_slug, dirty=dirty)

    @classmethod
    def create(cls, base: Path, commit: str, cell: str, gpus: list[dict] | None, dirty=None) -> RunDir:
        gs = gpu_slug(gpus)
        return cls(Path(base) / slug_path(commit) / slug_path(cell) / gs, commit=commit, cell=cell, gpu_slug=gs,
                   dirty=dirty)

    def rel(self, p: Path | str) -> str:
        return str(Path(p).resolve().relative_to(self.path.resolve()))

    def save(self) -> None:
        self.state["updated"] = now_iso()
        self.state_path.write_text(json.dumps(self.state, indent=2, default=str) + "\n")

    # records -----------------------------------------------------------------------------------------
    def set_env(self, report: dict) -> None:
        self.state["env"] = env_facts(report)

    def set_lock(self, cell: str, check: dict | None) -> None:
        lock = ROOT / "requirements" / "locks" / f"{cell}.txt"
        self.state["lock"] = {"path": str(lock.relative_to(ROOT)) if lock.exists() else None,
                              "sha256": sha256_file(lock) if lock.exists() else None}
        if check is not None:
            self.state["lock"]["check"] = {
                k: (len(v) if isinstance(v, list) else v) for k, v in check.items()
                if k in ("missing", "extra", "wrong_version", "local_label", "matching", "drift", "error")}
        digest = os.environ.get("NSA_IMAGE_DIGEST") or None
        self.state["image"] = {"digest": digest, "name": os.environ.get("NSA_IMAGE") or None}

    def record_suite(self, name: str, **fields) -> None:
        entry = {"finished": now_iso(), **fields}
        self.state["suites"][name] = entry

    def record_bench(self, name: str, **fields) -> None:
        self.state["benches"][name] = {"finished": now_iso(), **fields}

    def record_step(self, name: str, status: str, seconds: float, log: str | None = None, note: str = "") -> None:
        self.state["steps"] = [s for s in self.state.get("steps", []) if s["name"] != name]
        self.state["steps"].append({"name": name, "status": status, "seconds": round(seconds, 2), "log": log,
                                    "note": note})

    # derived files -----------------------------------------------------------------------------------
    def finalize(self) -> None:
        self.save()
        kg = known_good_record(self.state, artifact_dir=self._artifact_rel())
        (self.path / "known_good.json").write_text(json.dumps(kg, indent=2) + "\n")
        (self.path / "summary.md").write_text(render_summary(self.state, self.files()))
        (self.path / "README.md").write_text(render_index(self.state, self.files()))

    def _artifact_rel(self) -> str:
        try:
            return str(self.path.resolve().relative_to(ROOT))
        except ValueError:
            return str(self.path)

    def files(self) -> list[str]:
        out = []
        for p in sorted(self.path.rglob("*")):
            if p.is_file():
                out.append(self.rel(p))
        for name in ("summary.md", "known_good.json", "README.md"):
            if name not in out:
                out.append(name)
        return sorted(out)


def slug_path(text: str) -> str:
    """A path component: keep the ids' own spelling (cu130-torch2.11-py312), drop anything path-like."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", str(text)).strip("-.") or "unknown"


# --- rendering ---------------------------------------------------------------------------------------


def _fmt_runtime(s) -> str:
    if s is None:
        return "n/a"
    s = float(s)
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _suite_line(name: str, s: dict | None) -> str:
    title = SUITE_TITLES.get(name, name)
    if not s:
        return f"- {title}: NOT RUN"
    c = s.get("counts") or {}
    parts = [_fmt_runtime(s.get("runtime_s"))]
    if c:
        parts.append(f"{c.get('passed', 0)} passed, {c.get('failed', 0) + c.get('errors', 0)} failed, "
                     f"{c.get('skipped', 0)} skipped")
    line = f"- {title}: {s.get('status', '?')} ({'; '.join(parts)})"
    for note in s.get("notes") or []:
        line += f"\n  - {note}"
    for reason in (c.get("skip_reasons") or [])[:5]:
        line += f"\n  - skipped: {reason}"
    for f in (c.get("failures") or [])[:10]:
        line += f"\n  - failed: {f}"
    return line


def render_summary(state: dict, files: list[str]) -> str:
    e = state.get("env") or {}
    gpu = e.get("gpu") or "no GPU"
    if e.get("gpu_count", 0) > 1:
        gpu = f"{e['gpu_count']} x {gpu}"
    lines = [
        f"# NSA GPU run: {state.get('cell')} on {state.get('gpu_slug')}",
        "",
        "```",
        f"GPU Host: {e.get('host', 'unknown')} / {gpu} / Driver {e.get('driver') or 'unknown'}",
        f"Commit: {state.get('commit')}" + (" (uncommitted changes)" if state.get("dirty") else ""),
        f"Torch/Triton/CUDA: torch {e.get('torch')}, triton {e.get('triton')}, cuda {e.get('cuda')}",
        f"Python: {e.get('python')}; cell: {state.get('cell')}; flash-attn: {e.get('flash_attn') or 'not installed'}",
        "```",
    ]
    if e.get("env_error"):
        lines += ["", f"**Environment report failed**: {e['env_error']} (see env.json)"]
    lock = state.get("lock") or {}
    if lock:
        chk = lock.get("check") or {}
        drift = (f"; installed vs lock: {chk.get('matching', 0)} matching, {chk.get('missing', 0)} missing, "
                 f"{chk.get('wrong_version', 0)} other version, {chk.get('extra', 0)} extra") if chk else ""
        lines += ["", f"Lock: {lock.get('path')} (sha256 {str(lock.get('sha256'))[:16]}...){drift}"]
        if (state.get("image") or {}).get("digest"):
            lines.append(f"Image: {state['image'].get('name') or ''} {state['image']['digest']}")
    lines += ["", "## Tests", ""]
    for name in ("gpu_parity", "backward"):
        lines.append(_suite_line(name, state.get("suites", {}).get(name)))
    for name, s in sorted(state.get("suites", {}).items()):
        if name not in ("gpu_parity", "backward", "bench"):
            lines.append(_suite_line(name, s))
    lines += ["", "## Benches", ""]
    benches = state.get("benches") or {}
    if not benches:
        lines.append("- not run")
    for name, b in sorted(benches.items()):
        head = f"- {name} bench: {b.get('status')} ({_fmt_runtime(b.get('runtime_s'))})"
        if b.get("note"):
            head += f": {b['note']}"
        lines.append(head)
        for s in b.get("summary") or []:
            lines.append(f"  - {s}")
    gate = state.get("gate")
    if gate:
        lines.append(f"- Bench gate ({gate.get('class')}, allowance {gate.get('allowance', 0):.0%}): "
                     f"{gate.get('status')}")
        for s in gate.get("lines") or []:
            lines.append(f"  - {s}")
    if "bench" in state.get("suites", {}):
        lines.append(_suite_line("bench", state["suites"]["bench"]))
    steps = state.get("steps") or []
    if steps:
        lines += ["", "## Steps", ""]
        for s in steps:
            note = f" - {s['note']}" if s.get("note") else ""
            log = f" [{s['log']}]" if s.get("log") else ""
            lines.append(f"- {s['name']}: {s['status']} ({_fmt_runtime(s.get('seconds'))}){log}{note}")
    kg = known_good_record(state, artifact_dir="")
    lines += ["", f"## Verdict: {status_text(kg)}", "", kg["reason"], "", "## Artifacts", ""]
    lines += [f"- {f}" for f in files]
    return "\n".join(lines) + "\n"


FILE_HELP = {
    "env.json": "environment report (`python -m nsa.env --json`)",
    "lock-check.json": "installed packages vs the cell's lock (`python -m nsa.env --check-lock`)",
    "nvidia-smi.txt": "`nvidia-smi` output",
    "telemetry.json": "routing counters (nsa.telemetry) of the routing probe",
    "summary.md": "the report in the seeds' template",
    "known_good.json": "this run's entry for KNOWN_GOOD.md (`nox -s publish`)",
    "state.json": "the record summary.md and known_good.json are rendered from",
    "bench-headline.json": "headline figures (ci/evidence/bench_headline.py), medians over repeats",
    "gate.json": "headline figures vs bench/baselines.json",
    "README.md": "this index",
}


def render_index(state: dict, files: list[str]) -> str:
    lines = [f"# artifacts/{state.get('commit')}/{state.get('cell')}/{state.get('gpu_slug')}", "",
             "Written by the nox GPU sessions (docs/gpu-suites.md). Start with summary.md.", "",
             "| file | what |", "|---|---|"]
    for f in files:
        what = FILE_HELP.get(f)
        if what is None:
            if f.startswith("junit-"):
                what = f"JUnit XML of the {f[6:-4]} suite"
            elif f.startswith("logs/"):
                what = "stdout+stderr of one step"
            elif f.endswith(".csv"):
                what = "bench CSV"
            elif f.endswith(".json") and f.startswith("bench-"):
                what = "bench metadata sidecar (environment, arguments, rows)"
            else:
                what = ""
        lines.append(f"| {f} | {what} |")
    return "\n".join(lines) + "\n"


KNOWN_GOOD, HOST_ENV = "known-good", "passes-on-host"


def lock_differences(lock_check: dict | None) -> int | None:
    """How many packages of the cell's lock are missing or at another version; None when not checked."""
    if not lock_check or lock_check.get("error") or "missing" not in lock_check:
        return None
    return int(lock_check.get("missing") or 0) + int(lock_check.get("wrong_version") or 0)


def verdict(entry: dict) -> tuple[str, str]:
    """(status, reason) of a run from its suites, GPUs and lock check. Known-good: every suite passed and
    every package of the cell's lock was installed at its locked version (extra packages are listed, not
    fatal). Suites that passed on an environment that is not the lock: passes-on-host."""
    suites = entry.get("suites") or {}
    failed = sorted(n for n, s in suites.items() if s.get("status") != PASS)
    missing = [n for n in REQUIRED_SUITES if n not in suites]
    if failed:
        return "failing", "suites not passing: " + ", ".join(f"{n} ({suites[n].get('status')})" for n in failed)
    if missing:
        return "incomplete", "suites not run: " + ", ".join(missing)
    if not entry.get("gpu_count"):
        return "incomplete", "no GPU in the environment report"
    check = entry.get("lock_check")
    differ = lock_differences(check)
    passed = "all suites passed: " + ", ".join(sorted(suites))
    if differ is None:
        return HOST_ENV, f"{passed}; the installed set was not checked against the cell's lock"
    if differ:
        return HOST_ENV, (f"{passed}; {differ} package(s) of the cell's lock missing or at another version "
                          f"({check.get('missing', 0)} missing, {check.get('wrong_version', 0)} other version)")
    extra = f"; {check['extra']} extra package(s) installed" if check.get("extra") else ""
    return KNOWN_GOOD, f"{passed}, every package of the cell's lock at its locked version{extra}"


def status_text(entry: dict) -> str:
    """How KNOWN_GOOD.md shows a status: `passes on host environment (N packages differ)`."""
    if entry.get("status") != HOST_ENV:
        return str(entry.get("status"))
    differ = lock_differences(entry.get("lock_check"))
    return f"passes on host environment ({'lock not checked' if differ is None else f'{differ} packages differ'})"


def known_good_record(state: dict, artifact_dir: str) -> dict:
    """The run's entry for KNOWN_GOOD.md; its status comes from verdict()."""
    e = state.get("env") or {}
    suites = state.get("suites") or {}
    headline = {}
    gate = state.get("gate") or {}
    for row in gate.get("rows") or []:
        headline[row["figure"]] = round(float(row["value"]), 4)
    entry = {
        "schema": KG_SCHEMA,
        "cell": state.get("cell"),
        "gpu": e.get("gpu"),
        "gpu_slug": state.get("gpu_slug"),
        "gpu_count": e.get("gpu_count", 0),
        "sm": e.get("sm"),
        "driver": e.get("driver"),
        "host": e.get("host"),
        "commit": state.get("commit"),
        "dirty": state.get("dirty"),
        "date": state.get("updated") or now_iso(),
        "versions": {k: e.get(k) for k in ("python", "torch", "triton", "cuda", "cudnn", "flash_attn")},
        "lock": {k: (state.get("lock") or {}).get(k) for k in ("path", "sha256")},
        "lock_check": (state.get("lock") or {}).get("check"),
        "image_digest": (state.get("image") or {}).get("digest"),
        "suites": {n: {"status": s.get("status"), "runtime_s": s.get("runtime_s"),
                       **{k: (s.get("counts") or {}).get(k) for k in ("passed", "failed", "skipped")}}
                   for n, s in sorted(suites.items())},
        "bench_gate": gate.get("status"),
        "headline": headline,
        "artifacts": artifact_dir,
    }
    entry["status"], entry["reason"] = verdict(entry)
    return entry
