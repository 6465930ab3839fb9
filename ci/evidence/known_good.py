"""Merge runs' known_good.json files into KNOWN_GOOD.md and known_good.json at the repository root.

    python -m ci.evidence.known_good [FILES_OR_DIRS ...] [--out-dir .]     (nox -s publish -- ...)

Inputs: known_good.json files or folders holding them (default: artifacts/), and the root known_good.json.
Refused, with a message: an entry without an ISO 8601 date with a UTC offset, one dated in the future beyond
CLOCK_SKEW, a CI run that is not a push or schedule run on main. Every verdict is decided again by
ci.evidence.artifacts.verdict; per (cell, GPU set) the newest entry wins, and when it is not known-good the
table keeps the last known-good commit beside it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from ci.evidence import artifacts as A

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "nsa-known-good/1"
TABLE_SCHEMA = "nsa-known-good-table/1"
CLOCK_SKEW = _dt.timedelta(minutes=10)


def _entries(doc: dict) -> list[dict]:
    if doc.get("schema") in (SCHEMA, TABLE_SCHEMA):
        return list(doc.get("entries", [])) if doc["schema"] == TABLE_SCHEMA else [doc]
    raise ValueError(f"not a known_good.json (schema {doc.get('schema')!r}; accepted: {SCHEMA}, {TABLE_SCHEMA})")


def find_inputs(args: list[str], root: Path = ROOT) -> list[Path]:
    paths: list[Path] = []
    for p in map(Path, args or [str(root / "artifacts")]):
        if not p.exists():
            raise FileNotFoundError(f"no such file or directory: {p}")
        paths += sorted(p.rglob("known_good.json")) if p.is_dir() else [p]
    return paths


def refusal(entry: dict, now: _dt.datetime) -> str | None:
    """Why an entry may not enter the table at all, or None."""
    date = A.parse_date(entry.get("date"))
    if date is None:
        return f"date {entry.get('date')!r} is not an ISO 8601 time with a UTC offset"
    if date > now + CLOCK_SKEW:
        return f"dated {entry['date']}, in the future (now {now.isoformat(timespec='seconds')}, allowance {CLOCK_SKEW})"
    gh = entry.get("github")
    if gh and (gh.get("event") not in A.CERTIFYING_EVENTS or gh.get("ref") != A.MAIN_REF):
        return (f"a {gh.get('event')} run on {gh.get('ref')}: evidence for that change, not for this table "
                f"(accepted: local runs, push or schedule runs on {A.MAIN_REF})")
    return None


def merge(docs: list[dict], now: _dt.datetime | None = None, refused: list[str] | None = None) -> list[dict]:
    """Newest admitted entry per (cell, GPU set); `last_known_good` remembers the newest passing one."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    best: dict[tuple, dict] = {}
    good: dict[tuple, dict] = {}

    def newer(e, than):
        return than is None or A.parse_date(e.get("date")) >= A.parse_date(than.get("date"))

    for doc in docs:
        for e in _entries(doc):
            why = refusal(e, now)
            if why:
                (refused if refused is not None else []).append(f"{e.get('cell')} x {e.get('gpu_slug')} "
                                                                f"({e.get('commit')}): {why}")
                continue
            e = {**e, "overlay": A.overlay_facts(e.get("overlay")), **dict(zip(("status", "reason"), A.verdict(e)))}
            k = (str(e.get("cell")), str(e.get("gpu_slug") or e.get("gpu")))
            if newer(e, best.get(k)):
                best[k] = e
            if e["status"] == A.KNOWN_GOOD and newer(e, good.get(k)):
                good[k] = e
            prev = e.get("last_known_good") or {}
            if A.parse_date(prev.get("date")) and refusal(prev, now) is None and newer(prev, good.get(k)):
                good[k] = prev
    out = []
    for k in sorted(best):
        e, g = dict(best[k]), good.get(k)
        e.pop("last_known_good", None)
        if e["status"] != A.KNOWN_GOOD and g is not None:
            e["last_known_good"] = {"commit": g.get("commit"), "date": g.get("date")}
        out.append(e)
    return out


SECTIONS = (  # (status, title, what); None: every other status
    (A.KNOWN_GOOD, "Known-good", "Every planned suite ran and passed in one run of a clean committed tree, locally or "
     "in a push or schedule run on main, with every package of the cell's lock at its locked version (extra "
     "packages are listed, not fatal)."),
    (A.HOST_ENV, "Passes on a host environment", "As known-good, but packages of the lock were missing or at other "
     "versions: evidence that the code works there, not that the cell's lock does."),
    (A.EVIDENCE, "Passes, evidence only", "Every suite passed, but the run cannot certify its commit: uncommitted "
     "changes, an unchecked tree, an unknown commit, or no run id (older records)."),
    (None, "Failing or incomplete", "The newest run of these failed a suite, was cut off, or did not run them all."),
)


# GPU classes CI targets, and why a class has no run where none is recorded.
GPU_CLASSES = {"A100": "no A100 runner or machine has run the suites yet", "H100": "", "H200": ""}


def coverage(entries: list[dict], cells: list[str]) -> list[str]:
    """Per GPU class: the cells proven known-good, those with other results, and how many were never run."""
    lines = ["", "## Coverage", "", "Which GPU cells of the matrix each GPU class has proven.", ""]
    for cls, why in GPU_CLASSES.items():
        seen = {e["cell"]: e["status"] for e in entries if cls in str(e.get("gpu")).upper()}
        good = sorted(c for c, s in seen.items() if s == A.KNOWN_GOOD)
        other = sorted(f"{c} ({s})" for c, s in seen.items() if s != A.KNOWN_GOOD)
        note = f" ({why})" if why else ""
        lines.append(f"- **{cls}**: known-good: {', '.join(good) or 'none'}; other results: "
                     f"{', '.join(other) or 'none'}; {len(set(cells) - set(seen))} of {len(cells)} GPU cells not "
                     f"run{note}")
    return lines


def render_md(entries: list[dict], cells: list[str] | None = None) -> str:
    from ci.matrix import load

    cells = cells if cells is not None else [c.id for c in load().cells if not c.cpu_only]
    lines = ["# Known-good configurations", "",
             "Cell (requirements/matrix.toml) x GPU, from the GPU sessions' artifacts (docs/gpu-suites.md).",
             "Regenerate with `nox -s publish` (ci/evidence/known_good.py); do not edit.", *coverage(entries, cells)]
    named = {s for s, *_ in SECTIONS if s}
    for status, title, what in SECTIONS:
        rows = [_row(e) for e in entries if e.get("status") == status or (status is None and e["status"] not in named)]
        lines += ["", f"## {title}", "", what, "",
                  "| Cell | GPU | Status | Date | Commit | Versions | Lock | Suites | Headline figures |",
                  "|---|---|---|---|---|---|---|---|---|", *(rows or ["| - | - | none | | | | | | |"])]
    return "\n".join(lines) + "\n"


def headline_unit(name: str) -> str:
    """The unit of a headline figure, from its name (the bench headline's naming): times end in _ms, rates
    name tok_per_s, everything else (speedup_*, *_over_*) is a ratio."""
    if name.endswith("_ms"):
        return "ms"
    return "tok/s" if "tok_per_s" in name else "x"


def _row(e: dict) -> str:
    v, chk = e.get("versions") or {}, e.get("lock_check") or {}
    gpu = (f"{e['gpu_count']} x " if (e.get("gpu_count") or 1) > 1 else "") + str(e.get("gpu") or "?")
    gpu += f" (driver {e['driver']})" if e.get("driver") else ""
    status = f"**{A.status_text(e)}**" if e.get("status") == A.KNOWN_GOOD else A.status_text(e)
    if e.get("last_known_good"):
        lk = e["last_known_good"]
        status += f" (last known-good: {str(lk.get('commit'))[:12]}, {str(lk.get('date'))[:10]})"
    versions = (f"torch {v.get('torch')}, triton {v.get('triton')}, CUDA {v.get('cuda')}, "
                f"Python {v.get('python')}, flash-attn {v.get('flash_attn') or 'none'}")
    lock = (f"{chk.get('matching', '?')} as locked, {chk.get('missing', '?')} missing, "
            f"{chk.get('wrong_version', '?')} other version, {chk.get('extra', '?')} extra") if chk else "not checked"
    if e.get("overlay"):  # ci/sessions/overlay.py: the host's Python plus the lock's own wheels
        lock += f"; overlay venv: {len(e['overlay']['install'])} package(s) from the lock's wheels over the host's"
    suites = ", ".join(f"{n} {s.get('status')}" for n, s in sorted((e.get("suites") or {}).items()))
    head = ", ".join(f"{n} {val:g} {headline_unit(n)}" for n, val in sorted((e.get("headline") or {}).items()))
    head += f" (gate {e['bench_gate']})" if e.get("bench_gate") else ""
    commit = str(e.get("commit"))[:12] + (" (dirty)" if e.get("dirty") else "")
    return (f"| {e.get('cell')} | {gpu} | {status} | {str(e.get('date'))[:10]} | {commit} | {versions} | {lock} "
            f"| {suites} | {head or '-'} |")


def publish(inputs: list[Path], out_dir: Path = ROOT, now: _dt.datetime | None = None,
            refused: list[str] | None = None) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = out_dir / "known_good.json"
    keep = existing.exists() and existing.resolve() not in {p.resolve() for p in inputs}
    docs = [json.loads(p.read_text()) for p in [existing] * keep + [Path(p) for p in inputs]]
    entries = merge(docs, now, refused)
    (out_dir / "known_good.json").write_text(json.dumps({"schema": TABLE_SCHEMA, "entries": entries}, indent=2) + "\n")
    (out_dir / "KNOWN_GOOD.md").write_text(render_md(entries))
    return entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="*", help="known_good.json files or directories (default: artifacts/)")
    ap.add_argument("--out-dir", default=str(ROOT))
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)
    inputs = [p for p in find_inputs(args.inputs) if p.resolve() != (out_dir / "known_good.json").resolve()]
    refused: list[str] = []
    entries = publish(inputs, out_dir, refused=refused)
    print("".join(f"publish: refused {why}\n" for why in refused), end="", file=sys.stderr)
    print(f"publish: {len(inputs)} input(s), {len(refused)} entr(y/ies) refused -> {len(entries)} entr(y/ies) in "
          f"{out_dir / 'KNOWN_GOOD.md'}")
    for e in entries:
        print(f"  {e.get('cell')} x {e.get('gpu_slug')}: {e.get('status')} ({e.get('commit')}, {e.get('date')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
