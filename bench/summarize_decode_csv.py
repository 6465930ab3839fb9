"""Summarize a bench_decode.py CSV: latency, tokens/s, K/V bytes read against dense, per-branch share.

    python bench/summarize_decode_csv.py decode.csv [--markdown]

Per-branch share is each branch's time alone over the sum of the branch times measured
(cmp, topk = selection scores + top-n, sel, win); branches not measured in the run's
--branch_force_mode are shown as "-". Reads the JSON sidecar (decode.json) when present for the header.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nsa.benchutil import fmt_bytes, print_table, read_csv, sidecar_path  # noqa: E402

BRANCH_COLS = ("cmp_ms", "topk_ms", "sel_ms", "win_ms")
REQUIRED = ("S", "step_ms", "tok_per_s", "kv_bytes", "dense_kv_bytes", "dense_ms")


def _num(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def summarize(rows):
    out = []
    for r in rows:
        step, dense = _num(r["step_ms"]), _num(r["dense_ms"])
        kv, dkv = _num(r["kv_bytes"]), _num(r["dense_kv_bytes"])
        br = {c: _num(r.get(c)) for c in BRANCH_COLS}
        measured = [v for v in br.values() if math.isfinite(v)]
        total = sum(measured)
        share = {c: (v / total if math.isfinite(v) and total > 0 else float("nan")) for c, v in br.items()}
        out.append({
            "S": int(_num(r["S"])), "step_ms": step, "layer_step_ms": _num(r.get("layer_step_ms")),
            "tok_per_s": _num(r["tok_per_s"]), "kv_bytes": kv, "dense_kv_bytes": dkv,
            "kv_ratio": kv / dkv if dkv > 0 else float("nan"), "dense_ms": dense,
            "speedup": dense / step if step > 0 else float("nan"), **{f"share_{c[:-3]}": v for c, v in share.items()},
        })
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table instead of rich/plain")
    args = p.parse_args(argv)
    rows = read_csv(args.csv)
    if not rows:
        print(f"{args.csv}: no rows", file=sys.stderr)
        return 1
    missing = [c for c in REQUIRED if c not in rows[0]]
    if missing:
        print(f"{args.csv}: not a bench_decode.py CSV (missing columns {missing})", file=sys.stderr)
        return 1
    title = f"decode summary: {args.csv}"
    side = sidecar_path(args.csv)
    if side.exists():
        try:
            meta = json.loads(side.read_text()).get("meta", {})
            title += (f" | {meta.get('device_name')} | torch {meta.get('torch')} cuda {meta.get('cuda')} "
                      f"| commit {meta.get('git_commit')}")
        except (OSError, ValueError):
            pass
    r0 = rows[0]
    title += (f" | B={r0.get('B')} Hq={r0.get('heads')} Hkv={r0.get('groups')} dk={r0.get('dk')} dv={r0.get('dv')} "
              f"{r0.get('dtype')} mode={r0.get('branch_force_mode')}")
    f = lambda x, p=3: "-" if not math.isfinite(x) else f"{x:.{p}f}"  # noqa: E731
    pct = lambda x: "-" if not math.isfinite(x) else f"{100 * x:.0f}%"  # noqa: E731
    cols = ["S", "step ms", "layer ms", "tok/s", "KV read", "dense KV", "read/dense", "dense ms", "dense/nsa",
            "cmp", "topk", "sel", "win"]
    table = [[s["S"], f(s["step_ms"]), f(s["layer_step_ms"]), f(s["tok_per_s"], 0), fmt_bytes(s["kv_bytes"]),
              fmt_bytes(s["dense_kv_bytes"]), f(s["kv_ratio"], 2), f(s["dense_ms"]), f(s["speedup"], 2),
              pct(s["share_cmp"]), pct(s["share_topk"]), pct(s["share_sel"]), pct(s["share_win"])]
             for s in summarize(rows)]
    if args.markdown:
        print(f"**{title}**\n")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in table:
            print("| " + " | ".join(str(v) for v in r) + " |")
    else:
        print_table(title, cols, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
