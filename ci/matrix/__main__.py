"""`python -m ci.matrix`: validate, list, show and table the configuration matrix."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ci.matrix import DEFAULT_PATH, Cell, Matrix, MatrixError, load
from ci.matrix.explain import explain, table, write_tables


def describe(m: Matrix, c: Cell) -> dict[str, Any]:
    """The cell, where its packages come from, and `why`: the upstream facts behind each of its choices."""
    return {**c.to_json(), "index_url": m.index_url(c), "flash_attn_url": m.flash_wheel_url(c),
            "flash_attn_none": m.flash_none_reason(c), "why": explain(m, c)}


def _show_text(d: dict[str, Any]) -> str:
    why = d.pop("why")
    return "\n".join([*(f"{k:14} {v}" for k, v in d.items()), "why:", *(f"  {k:12} {v}" for k, v in why.items())])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", type=Path, default=DEFAULT_PATH, help="matrix file (default: %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("validate", help="exit 1 listing every impossible cell")
    sub.add_parser("list", help="one line per cell")
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
            quick = {cell: py for py, cell in m.quickstart.items()}
            for c in m.cells:
                fa = c.flash_attn
                fa_s = "no flash-attn" if fa.source == "none" else f"flash-attn {fa.version} ({fa.source})"
                cuda = "CPU" if c.cpu_only else f"CUDA {c.cuda}"
                qs = f"  Quick start for {quick[c.id]}" if c.id in quick else ""
                print(f"{c.id:24} Python {c.python}  {cuda:9}  torch {c.torch:11} triton {c.triton:6} {fa_s}{qs}")
        elif args.cmd == "table":
            if args.write:
                print("\n".join(f"updated {p}" for p in write_tables(m)) or "the tables are up to date")
            else:
                print(table(m))
        else:
            d = describe(m, m.get(args.cell))
            print(json.dumps(d, indent=2) if args.json else _show_text(d))
    except MatrixError as e:
        print(e, file=sys.stderr)
        return 1
    except KeyError as e:
        print(f"error: cell: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
