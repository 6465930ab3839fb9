"""The bench gate: headline figures against stored baselines for the same GPU class.

    python -m ci.evidence.bench_gate check HEADLINE.json [--baselines bench/baselines.json] [--gpu-class C]
                                 [--strict] [--json OUT]
    python -m ci.evidence.bench_gate promote HEADLINE.json [--baselines ...] [--gpu-class C] --commit SHA
                                 [--artifact PATH] [--note TEXT]

HEADLINE.json comes from bench/bench_headline.py: each figure is the median over repeats. A figure
regresses when it is worse than its baseline by more than the allowance (bench/baselines.json's
policy.allowance, or the figure's own "allowance"): for "lower is better", value > baseline * (1 + a).
`check` exits 1 on any regression. The GPU sessions measure a failed figure again in a second process
(`second_opinion`): it fails the gate only when that measurement fails too. A GPU class or figure with no
baseline is reported as NO-BASELINE (exit 0; `--strict` makes it exit 1). A figure named in the policy's
"informational" (figure -> why) is RECORDED with its baseline and ratio but never fails nor lacks a baseline:
one too noisy between machines to judge a change by. `promote` writes the run's figures
as the class's baselines, recording where each number came from (commit, date, host, GPU, torch, artifact
path).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BASELINES = ROOT / "bench" / "baselines.json"
SCHEMA = "nsa-bench-baselines/1"
DEFAULT_ALLOWANCE = 0.15
PASS, FAIL, NO_BASELINE, RECORDED = "PASS", "FAIL", "NO-BASELINE", "RECORDED"


def gpu_class(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; None/'' -> 'cpu'. The class is the exact model."""
    return re.sub(r"^nvidia-", "", re.sub(r"[^a-z0-9]+", "-", (name or "").lower()).strip("-")) or "cpu"


def load_baselines(path: str | Path = DEFAULT_BASELINES) -> dict:
    path = Path(path)
    if not path.exists():
        return {"schema": SCHEMA, "policy": {"allowance": DEFAULT_ALLOWANCE}, "classes": {}}
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    return data


def compare(figures: dict, baselines: dict, cls: str) -> dict:
    """{'status', 'class', 'allowance', 'rows': [{figure, value, baseline, ratio, limit, status, source}]}."""
    default_allow = float(baselines.get("policy", {}).get("allowance", DEFAULT_ALLOWANCE))
    informational = baselines.get("policy", {}).get("informational", {})
    stored = baselines.get("classes", {}).get(cls, {}).get("figures", {})
    rows, floors = [], baselines.get("acceptance", {})  # the seeds' absolute figures: one limit for every GPU
    for name, fig in sorted(figures.items()):
        fig = fig if isinstance(fig, dict) else {"value": fig}
        value, base = float(fig["value"]), floors.get(name) or stored.get(name)
        row = {"figure": name, "value": value, "baseline": None, "ratio": None, "limit": None,
               "status": NO_BASELINE, "source": None, "unit": fig.get("unit", "ms")}
        if base is not None:
            b, allow = float(base["value"]), float(base.get("allowance", default_allow))
            better = base.get("better", fig.get("better") or "lower")
            limit = b * (1 + allow) if better == "lower" else b * (1 - allow)
            ok = value <= limit if better == "lower" else value >= limit
            row.update(baseline=b, ratio=value / b if b else None, limit=limit, allowance=allow, better=better,
                       status=PASS if ok else FAIL, source=base.get("source"))
        if name in informational:
            row.update(status=RECORDED, why=informational[name])
        rows.append(row)
    return {"status": _status(rows), "class": cls, "allowance": default_allow, "rows": rows}


def _status(rows: list[dict]) -> str:
    statuses = {r["status"] for r in rows if r["status"] != RECORDED}
    return FAIL if FAIL in statuses else (NO_BASELINE if NO_BASELINE in statuses or not rows else PASS)


def second_opinion(result: dict, retry_figures: dict, baselines: dict, cls: str) -> dict:
    """result with each failed figure replaced by its measurement in a second process (retry_figures): a
    figure bound by host speed (the eager decode step) moved by up to 2x between two processes of the same
    code on one machine, so a regression counts only when it holds in both. The first value stays in the row."""
    again = {r["figure"]: r for r in compare(retry_figures, baselines, cls)["rows"]}
    rows = [{**r, **{k: again[r["figure"]][k] for k in ("value", "ratio", "status")}, "first_value": r["value"]}
            if r["status"] == FAIL and r["figure"] in again else r for r in result["rows"]]
    out = {**result, "rows": rows, "status": _status(rows)}
    return {**out, "lines": describe(out)}


def describe(result: dict) -> list[str]:
    """One line per figure, for logs and summary.md."""
    out = []
    for r in result["rows"]:
        head = f"{r['figure']}: {r['value']:.4f} {r.get('unit', 'ms')}"
        if r["status"] == RECORDED:
            vs = f" (x{r['ratio']:.3f} of baseline {r['baseline']:.4f})" if r["baseline"] is not None else ""
            out.append(f"{head}{vs} RECORDED, not gated: {r['why']}")
            continue
        out.append(f"{head}, no baseline for {result['class']} ({r['status']})" if r["baseline"] is None else
                   f"{head} vs baseline {r['baseline']:.4f} (x{r['ratio']:.3f}, limit {r['limit']:.4f}, allowance "
                   f"{r['allowance']:.0%}, {r.get('better', 'lower')} is better) {r['status']}"
                   + (f" (second process; the first measured {r['first_value']:.4f})" if "first_value" in r else ""))
    return out


def promote(headline: dict, baselines: dict, cls: str, *, commit: str, artifact: str | None = None,
            note: str | None = None) -> dict:
    """Store the headline figures as the class's baselines, each with where it came from."""
    if headline.get("slowdown", 1.0) != 1.0:
        raise ValueError("refusing to promote figures measured with NSA_TEST_SLOWDOWN set")
    source = {"commit": commit, **{k: headline.get(k) for k in ("date", "host", "gpu", "torch", "dtype", "size")},
              "artifact": artifact, "note": note, "statistic": "median over repeats of the mean ms per call"}
    entry = baselines.setdefault("classes", {}).setdefault(cls, {"figures": {}})
    for name, fig in headline["figures"].items():
        entry["figures"][name] = {"value": round(float(fig["value"]), 6), "better": fig.get("better", "lower"),
                                  "unit": fig.get("unit", "ms"), "repeats": len(fig.get("repeats", [])),
                                  "source": source}
    return baselines


def check(headline: dict, baselines: dict, cls: str) -> dict:
    """compare() of a headline JSON's figures, with its slowdown factor and describe()'s lines."""
    result = {**compare(headline["figures"], baselines, cls), "slowdown": headline.get("slowdown", 1.0)}
    return {**result, "lines": describe(result)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=("check", "promote"))
    ap.add_argument("headline")
    ap.add_argument("--baselines", default=str(DEFAULT_BASELINES))
    ap.add_argument("--gpu-class", default=None, help="default: from the headline's GPU name")
    ap.add_argument("--strict", action="store_true", help="check: a missing baseline fails too")
    ap.add_argument("--json", default=None, help="check: write the comparison here")
    for opt in ("--commit", "--artifact", "--note"):
        ap.add_argument(opt, default=None, help="promote (--commit required)")
    args = ap.parse_args(argv)
    if args.cmd == "promote" and not args.commit:
        ap.error("promote needs --commit SHA: every stored number records the commit it came from")
    headline = json.loads(Path(args.headline).read_text())
    cls = args.gpu_class or gpu_class(headline.get("gpu"))
    baselines = load_baselines(args.baselines)
    if args.cmd == "promote":
        promote(headline, baselines, cls, commit=args.commit, artifact=args.artifact, note=args.note)
        Path(args.baselines).write_text(json.dumps(baselines, indent=2) + "\n")
        print(f"bench gate: baselines for {cls} written to {args.baselines}")
        return 0
    result = check(headline, baselines, cls)
    print("".join(f"gate: {line}\n" for line in result["lines"]) + f"gate: {result['status']} ({cls}, allowance "
          f"{result['allowance']:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return int(result["status"] == FAIL or (args.strict and result["status"] == NO_BASELINE))


if __name__ == "__main__":
    sys.exit(main())
