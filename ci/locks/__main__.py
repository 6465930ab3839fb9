"""`python -m ci.locks`: regenerate, check or look for newer versions of the hash-pinned locks."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ci.locks import LockError, check, compile_cell, compile_universal, parse_lock, universal_targets, uv_bin
from ci.matrix import DEFAULT_PATH, MatrixError, load, outdated


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.locks", description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", help="cell ids, 'bootstrap', 'tools' (default: all)")
    ap.add_argument("--check", action="store_true", help="fail if any lock is stale (offline)")
    ap.add_argument("--outdated", action="store_true",
                    help="ask PyPI what is newer than the matrix and the tool locks (exit 1 when anything is)")
    ap.add_argument("--matrix", type=Path, default=DEFAULT_PATH)
    args = ap.parse_args(argv)
    if args.outdated:
        return outdated.main(["--matrix", str(args.matrix)])
    try:
        matrix = load(args.matrix)
    except MatrixError as e:
        print(e, file=sys.stderr)
        return 1
    universal = universal_targets(matrix)
    ids = {c.id for c in matrix.cells}
    unknown = [t for t in args.targets if t not in ids and t not in universal]
    if unknown:
        print(
            f"error: targets: unknown {unknown}; known: {sorted(ids)} + {sorted(universal)}", file=sys.stderr
        )
        return 2
    if args.check:
        problems = check(matrix, args.targets or None)
        for p in problems:
            print(f"STALE {p}", file=sys.stderr)
        n = len(args.targets) if args.targets else len(ids) + len(universal)
        print(f"locks: {n} checked, {len(problems)} problem(s)")
        return 1 if problems else 0
    targets = args.targets or [c.id for c in matrix.cells] + list(universal)
    uv = uv_bin()
    failed = 0
    for i, t in enumerate(targets, 1):
        start = time.monotonic()
        print(f"[{i}/{len(targets)}] locking {t} ...", flush=True)
        try:
            if t in universal:
                out = compile_universal(t, *universal[t], uv=uv)
            else:
                out = compile_cell(matrix, matrix.get(t), uv=uv)
        except LockError as e:
            failed += 1
            print(f"  FAILED: {e}", file=sys.stderr)
            continue
        n = len(parse_lock(out.read_text()))
        rel = out.relative_to(matrix.path.parent.parent)
        print(f"  wrote {rel} ({n} packages, {time.monotonic() - start:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
