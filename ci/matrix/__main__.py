"""`python -m ci.matrix`: validate, list, show and table the configuration matrix."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ci.matrix import DEFAULT_PATH, MatrixError, load
from ci.matrix.explain import explain, table, write_tables


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", type=Path, default=DEFAULT_PATH, help="matrix file (default: %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("validate", help="exit 1 listing every impossible cell")
    sub.add_parser("list", help="one line per cell, with the package index its torch comes from")
    sh = sub.add_parser("show", help="one cell")
    sh.add_argument("cell")
    sh.add_argument("--json", action="store_true")
    tb = sub.add_parser("table", help="the matrix as the Markdown table of README.md and docs/environments.md")
    tb.add_argument("--write", action="store_true", help="update the table in those documents")
    args = ap.parse_args(argv)
    try:
        m = load(args.matrix)
        if args.cmd == "validate":
            print(f"{args.matrix.name}: {len(m.cells)} cells valid")
        elif args.cmd == "list":
            for c in m.cells:
                fa = c.flash_attn
                fa_s = "no flash-attn" if fa.source == "none" else f"flash-attn {fa.version} ({fa.source})"
                cuda = "CPU" if c.cpu_only else f"CUDA {c.cuda}"
                qs = "".join(f"  Quick start for {py}" for py, cell in m.quickstart.items() if cell == c.id)
                print(f"{c.id:24} Python {c.python}  {cuda:9}  torch {c.torch:11} triton {c.triton:6} {fa_s:30} "
                      f"index {m.index_url(c) or 'PyPI'}{qs}")
        elif args.cmd == "table":
            print(("\n".join(f"updated {p}" for p in write_tables(m)) or "the tables are up to date")
                  if args.write else table(m))
        else:
            # The cell, where its packages come from, and `why`: the upstream facts behind each of its choices.
            c = m.get(args.cell)
            d = {**{k: v for k, v in asdict(c).items() if k != "raw"}, "variant": c.variant,
                 "index_url": m.index_url(c), "flash_attn_url": m.flash_wheel_url(c),
                 "flash_attn_none": m.flash_none_reason(c)}
            why = explain(m, c)
            print(json.dumps({**d, "why": why}, indent=2) if args.json else "\n".join(
                [*(f"{k:14} {v}" for k, v in d.items()), "why:", *(f"  {k:12} {v}" for k, v in why.items())]))
    except MatrixError as e:
        print(e, file=sys.stderr)
        return 1
    except KeyError as e:
        print(f"error: cell: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
