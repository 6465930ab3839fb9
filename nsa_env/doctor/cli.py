"""`nsa-env doctor` / `python -m nsa_env.doctor`: run the checks on this machine and print them."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from nsa_env import report
from nsa_env.doctor import run_checks
from nsa_env.doctor.core import DEFAULT_HEAD_DIMS, Outcome


def _read_logs(paths: list[str]) -> str:
    parts = []
    for p in paths:
        if p == "-":
            parts.append(sys.stdin.read())
        else:
            with open(p, errors="replace") as f:
                parts.append(f.read())
    return "\n".join(parts)


def _print(outcomes: list[Outcome]) -> None:
    findings = [f for o in outcomes for f in o.findings]
    for x in findings:
        print(f"[{x.severity.upper()}] {x.code}: {x.problem}\n    fix: {x.fix}")
    passed = [o.check for o in outcomes if o.status == "passed"]
    skipped = [o for o in outcomes if o.status == "not applicable"]
    if passed:
        print(f"passed: {', '.join(passed)}")
    if skipped:
        print("not applicable here:")
        for o in skipped:
            print(f"  {o.check:22} {o.note}")
    if not findings:
        print("doctor: nothing wrong found")
    else:
        count = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
        print(f"doctor: {count['error']} error(s), {count['warning']} warning(s), {count['info']} info")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nsa-env doctor", description="Explain common environment and install "
                                 "failures, each with its fix (docs/environments.md lists the check codes).")
    ap.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    ap.add_argument("--head-dim", type=int, action="append", dest="head_dims",
                    help="head dims you will use (default: 128 and 192); repeat for several")
    ap.add_argument("--log", action="append", default=[], metavar="FILE",
                    help="output of a failed install or run to explain too ('-': stdin); repeatable")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    dims = tuple(args.head_dims or DEFAULT_HEAD_DIMS)
    if any(d <= 0 for d in dims):
        ap.error(f"--head-dim must be positive, got {dims}")
    try:
        log = _read_logs(args.log)
    except OSError as e:
        ap.error(f"--log: {e}")
    outcomes = run_checks(report.collect(), dims, log)
    findings = [f for o in outcomes for f in o.findings]
    if args.json:
        print(json.dumps([asdict(x) for x in findings], indent=2))
    else:
        _print(outcomes)
    return 1 if any(x.severity == "error" for x in findings) else 0

