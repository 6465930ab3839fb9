"""`python -m ci.locks`: regenerate, check or look for newer versions of the hash-pinned locks."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ci.locks import LockError, check, compile_cell, compile_universal, resolve_check, universal_targets, uv_bin
from ci.matrix import DEFAULT_PATH, MatrixError, load, outdated


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.locks", description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", help="cell ids, 'bootstrap', 'tools', 'lint' (default: all)")
    ap.add_argument("--check", action="store_true", help="fail if any lock is stale, malformed or edited (offline)")
    ap.add_argument("--resolve", action="store_true",
                    help="with --check: also resolve each lock's inputs again from its pins (needs the indexes)")
    ap.add_argument("--upgrade", action="store_true", help="relock afresh, not from the current pins")
    ap.add_argument("--outdated", action="store_true",
                    help="ask PyPI what is newer than the matrix and the tool locks (exit 1 when anything is)")
    ap.add_argument("--matrix", type=Path, default=DEFAULT_PATH)
    args = ap.parse_args(argv)
    if args.outdated:
        return outdated.main(["--matrix", str(args.matrix)])
    if args.resolve and not args.check:
        ap.error("--resolve: only with --check")
    try:
        matrix = load(args.matrix)
    except MatrixError as e:
        print(e, file=sys.stderr)
        return 1
    tools, ids = universal_targets(matrix), [c.id for c in matrix.cells]
    if unknown := [t for t in args.targets if t not in ids and t not in tools]:
        print(f"error: targets: unknown {unknown}; known: {sorted(ids)} + {sorted(tools)}", file=sys.stderr)
        return 2
    targets, start, failed = args.targets or ids + list(tools), time.monotonic(), 0
    if args.check:
        problems = check(matrix, args.targets) + (resolve_check(matrix, args.targets) if args.resolve else [])
        print("".join(f"LOCK {p}\n" for p in problems), end="", file=sys.stderr)
        print(f"locks: {len(targets)} checked{' and resolved again' if args.resolve else ''}, "
              f"{len(problems)} problem(s), {time.monotonic() - start:.1f} s")
        return 1 if problems else 0
    for i, t in enumerate(targets, 1):
        print(f"[{i}/{len(targets)}] locking {t} ...", flush=True)
        try:
            out = compile_universal(t, *tools[t], uv_bin(), args.upgrade) if t in tools else \
                compile_cell(matrix, matrix.get(t), uv_bin(), args.upgrade)
            print(f"  wrote {out.relative_to(matrix.path.parent.parent)} ({time.monotonic() - start:.1f} s)")
        except LockError as e:
            failed += 1
            print(f"  FAILED: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
