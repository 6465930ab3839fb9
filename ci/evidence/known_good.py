"""Merge runs' known_good.json files into KNOWN_GOOD.md and known_good.json at the repository root.

    python -m ci.evidence.known_good [FILES_OR_DIRS ...] [--out-dir .]     (nox -s publish -- ...)

Inputs: known_good.json files (ci/evidence/artifacts.py writes one per run directory) or directories searched for
them; default: artifacts/*/*/*/known_good.json. The existing root known_good.json is merged too, so
earlier entries stay. One entry per (cell, GPU set): the newest by date wins (a later input on a tie).
Every entry's status is decided again here by ci.evidence.artifacts.verdict: a cell is known-good on a GPU only
when every suite of that run passed with every package of the cell's lock installed at its locked version;
suites that passed on another environment are `passes on host environment (N packages differ)`. When the
newest run is not known-good, the table keeps the last known-good commit beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ci.evidence.artifacts import HOST_ENV, KNOWN_GOOD, status_text, verdict

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "nsa-known-good/1"
TABLE_SCHEMA = "nsa-known-good-table/1"


def _entries(doc: dict) -> list[dict]:
    if doc.get("schema") == TABLE_SCHEMA:
        return list(doc.get("entries", []))
    if doc.get("schema") == SCHEMA:
        return [doc]
    raise ValueError(f"not a known_good.json (schema {doc.get('schema')!r})")


def find_inputs(args: list[str], root: Path = ROOT) -> list[Path]:
    paths: list[Path] = []
    for a in args or [str(root / "artifacts")]:
        p = Path(a)
        if p.is_dir():
            paths += sorted(p.rglob("known_good.json"))
        elif p.exists():
            paths.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {a}")
    return paths


def key(entry: dict) -> tuple[str, str]:
    return (str(entry.get("cell")), str(entry.get("gpu_slug") or entry.get("gpu")))


def merge(docs: list[dict]) -> list[dict]:
    """Newest entry per (cell, GPU set); `last_known_good` remembers the newest passing one when that differs."""
    best: dict[tuple, dict] = {}
    good: dict[tuple, dict] = {}
    for doc in docs:
        for e in _entries(doc):
            e = {**e, **dict(zip(("status", "reason"), verdict(e)))}
            k = key(e)
            if k not in best or str(e.get("date", "")) >= str(best[k].get("date", "")):
                best[k] = e
            newer = k not in good or str(e.get("date", "")) >= str(good[k].get("date", ""))
            if e.get("status") == KNOWN_GOOD and newer:
                good[k] = e
            prev = e.get("last_known_good")
            if prev and (k not in good or str(prev.get("date", "")) > str(good[k].get("date", ""))):
                good[k] = prev
    out = []
    for k in sorted(best):
        e = dict(best[k])
        g = good.get(k)
        if e.get("status") != KNOWN_GOOD and g is not None:
            e["last_known_good"] = {"commit": g.get("commit"), "date": g.get("date")}
        elif e.get("status") == KNOWN_GOOD:
            e.pop("last_known_good", None)
        out.append(e)
    return out


SECTIONS = (
    (KNOWN_GOOD, "Known-good", "Every suite passed with every package of the cell's lock installed at its locked "
     "version (in the cell's image, a venv made from its lock, or a host brought to the lock). Extra packages "
     "are listed, not fatal."),
    (HOST_ENV, "Passes on a host environment", "Every suite passed, but on an environment that is not the "
     "cell's lock: packages of the lock were missing or at other versions. Evidence that the code works "
     "there, not that the cell's lock does."),
    (None, "Failing or incomplete", "The newest run of these failed a suite or did not run them all."),
)


def render_md(entries: list[dict]) -> str:
    lines = [
        "# Known-good configurations",
        "",
        "Cell (requirements/matrix.toml) x GPU, from the GPU sessions' artifacts (docs/gpu-suites.md).",
        "Regenerate with `nox -s publish` (ci/evidence/known_good.py); do not edit.",
    ]
    for status, title, what in SECTIONS:
        rows = [e for e in entries if e.get("status") == status or (status is None and e.get("status") not in
                                                                     (KNOWN_GOOD, HOST_ENV))]
        lines += ["", f"## {title}", "", what, "",
                  "| Cell | GPU | Status | Date | Commit | Versions | Lock | Suites | Headline figures |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [_row(e) for e in rows] or ["| - | - | none | | | | | | |"]
    return "\n".join(lines) + "\n"


def _row(e: dict) -> str:
    v = e.get("versions") or {}
    gpu = e.get("gpu") or "?"
    if (e.get("gpu_count") or 1) > 1:
        gpu = f"{e['gpu_count']} x {gpu}"
    if e.get("driver"):
        gpu += f" (driver {e['driver']})"
    status = status_text(e)
    status = f"**{status}**" if e.get("status") == KNOWN_GOOD else status
    if e.get("last_known_good"):
        lk = e["last_known_good"]
        status += f" (last known-good: {lk.get('commit')}, {str(lk.get('date'))[:10]})"
    versions = (f"torch {v.get('torch')}, triton {v.get('triton')}, CUDA {v.get('cuda')}, "
                f"Python {v.get('python')}, flash-attn {v.get('flash_attn') or 'none'}")
    chk = e.get("lock_check") or {}
    lock = (f"{chk.get('matching', '?')} as locked, {chk.get('missing', '?')} missing, "
            f"{chk.get('wrong_version', '?')} other version, {chk.get('extra', '?')} extra") if chk else "not checked"
    suites = ", ".join(f"{n} {s.get('status')}" for n, s in sorted((e.get("suites") or {}).items()))
    head = ", ".join(f"{n} {val:g} ms" for n, val in sorted((e.get("headline") or {}).items()))
    if e.get("bench_gate"):
        head += f" (gate {e['bench_gate']})"
    commit = str(e.get("commit")) + (" (dirty)" if e.get("dirty") else "")
    return (f"| {e.get('cell')} | {gpu} | {status} | {str(e.get('date'))[:10]} | {commit} | {versions} | {lock} "
            f"| {suites} | {head or '-'} |")


def publish(inputs: list[Path], out_dir: Path = ROOT) -> list[dict]:
    docs = []
    existing = out_dir / "known_good.json"
    if existing.exists() and existing.resolve() not in {p.resolve() for p in inputs}:
        docs.append(json.loads(existing.read_text()))
    for p in inputs:
        docs.append(json.loads(Path(p).read_text()))
    entries = merge(docs)
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
    entries = publish(inputs, out_dir)
    print(f"publish: {len(inputs)} input(s) -> {len(entries)} entr(y/ies) in {out_dir / 'KNOWN_GOOD.md'}")
    for e in entries:
        print(f"  {e.get('cell')} x {e.get('gpu_slug')}: {e.get('status')} ({e.get('commit')}, {e.get('date')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
