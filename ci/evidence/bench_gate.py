"""The bench gate: headline figures against stored baselines for the same GPU class.

    python -m ci.evidence.bench_gate check HEADLINE.json [--baselines bench/baselines.json] [--gpu-class C]
                                 [--strict] [--json OUT]
    python -m ci.evidence.bench_gate promote HEADLINE.json [--baselines ...] [--gpu-class C] --commit SHA
                                 [--artifact PATH] [--note TEXT]

HEADLINE.json comes from ci/evidence/bench_headline.py: each figure is the median over repeats. A figure
regresses when it is worse than its baseline by more than the allowance (bench/baselines.json's
policy.allowance, or the figure's own "allowance"): for "lower is better", value > baseline * (1 + a).
`check` exits 1 on any regression. A GPU class or figure with no baseline is reported as NO-BASELINE
(exit 0; `--strict` makes it exit 1). `promote` writes the run's figures as the class's baselines,
recording where each number came from (commit, date, host, GPU, torch, artifact path).
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

PASS, FAIL, NO_BASELINE = "PASS", "FAIL", "NO-BASELINE"


def gpu_class(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; None/'' -> 'cpu'. The class is the exact model."""
    if not name:
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return re.sub(r"^nvidia-", "", slug) or "cpu"


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
    policy = baselines.get("policy", {})
    default_allow = float(policy.get("allowance", DEFAULT_ALLOWANCE))
    stored = baselines.get("classes", {}).get(cls, {}).get("figures", {})
    rows = []
    for name, fig in sorted(figures.items()):
        value = float(fig["value"] if isinstance(fig, dict) else fig)
        base = stored.get(name)
        row = {"figure": name, "value": value, "baseline": None, "ratio": None, "limit": None,
               "status": NO_BASELINE, "source": None, "unit": fig.get("unit", "ms") if isinstance(fig, dict) else "ms"}
        if base is not None:
            b = float(base["value"])
            allow = float(base.get("allowance", default_allow))
            better = base.get("better", (fig.get("better") if isinstance(fig, dict) else None) or "lower")
            if better == "lower":
                limit = b * (1 + allow)
                ok = value <= limit
            else:
                limit = b * (1 - allow)
                ok = value >= limit
            row.update(baseline=b, ratio=value / b if b else None, limit=limit, allowance=allow, better=better,
                       status=PASS if ok else FAIL, source=base.get("source"))
        rows.append(row)
    statuses = {r["status"] for r in rows}
    status = FAIL if FAIL in statuses else (NO_BASELINE if NO_BASELINE in statuses or not rows else PASS)
    return {"status": status, "class": cls, "allowance": default_allow, "rows": rows}


def describe(result: dict) -> list[str]:
    """One line per figure, for logs and summary.md."""
    lines = []
    for r in result["rows"]:
        unit = r.get("unit", "ms")
        if r["baseline"] is None:
            lines.append(f"{r['figure']}: {r['value']:.4f} {unit}, no baseline for {result['class']} ({r['status']})")
        else:
            lines.append(f"{r['figure']}: {r['value']:.4f} {unit} vs baseline {r['baseline']:.4f} "
                         f"(x{r['ratio']:.3f}, limit {r['limit']:.4f}, allowance {r['allowance']:.0%}, "
                         f"{r.get('better', 'lower')} is better) {r['status']}")
    return lines


def promote(headline: dict, baselines: dict, cls: str, *, commit: str, artifact: str | None = None,
            note: str | None = None) -> dict:
    """Store the headline figures as the class's baselines, each with where it came from."""
    source = {"commit": commit, "date": headline.get("date"), "host": headline.get("host"),
              "gpu": headline.get("gpu"), "torch": headline.get("torch"), "dtype": headline.get("dtype"),
              "size": headline.get("size"), "artifact": artifact, "note": note,
              "statistic": "median over repeats of the mean ms per call"}
    if headline.get("slowdown", 1.0) != 1.0:
        raise ValueError("refusing to promote figures measured with NSA_TEST_SLOWDOWN set")
    entry = baselines.setdefault("classes", {}).setdefault(cls, {"figures": {}})
    for name, fig in headline["figures"].items():
        entry["figures"][name] = {"value": round(float(fig["value"]), 6), "better": fig.get("better", "lower"),
                                  "unit": fig.get("unit", "ms"), "repeats": len(fig.get("repeats", [])),
                                  "source": source}
    return baselines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("check", "promote"):
        p = sub.add_parser(name)
        p.add_argument("headline")
        p.add_argument("--baselines", default=str(DEFAULT_BASELINES))
        p.add_argument("--gpu-class", default=None, help="default: from the headline's GPU name")
        if name == "check":
            p.add_argument("--strict", action="store_true", help="a missing baseline fails too")
            p.add_argument("--json", default=None, help="write the comparison here")
        else:
            p.add_argument("--commit", required=True)
            p.add_argument("--artifact", default=None)
            p.add_argument("--note", default=None)
    args = ap.parse_args(argv)
    headline = json.loads(Path(args.headline).read_text())
    cls = args.gpu_class or gpu_class(headline.get("gpu"))
    baselines = load_baselines(args.baselines)
    if args.cmd == "promote":
        promote(headline, baselines, cls, commit=args.commit, artifact=args.artifact, note=args.note)
        Path(args.baselines).write_text(json.dumps(baselines, indent=2) + "\n")
        print(f"bench gate: baselines for {cls} written to {args.baselines}")
        return 0
    result = compare(headline["figures"], baselines, cls)
    result["slowdown"] = headline.get("slowdown", 1.0)
    for line in describe(result):
        print(f"gate: {line}")
    print(f"gate: {result['status']} ({cls}, allowance {result['allowance']:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if result["status"] == FAIL or (args.strict and result["status"] == NO_BASELINE):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
