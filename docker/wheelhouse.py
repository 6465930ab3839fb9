"""Fill docker/wheelhouse for an offline build (`nox -s images -- CELL --offline`).

    python docker/wheelhouse.py CELL [--without-flash-attn] [--only NAME,NAME] [--dest DIR]

Every wheel of the cell's lock (hash-checked, for the cell's Python and platform, from the cell's package
index and pip's configured ones) and, for a cell that installs upstream's flash-attn wheel, that wheel;
with --only, just those packages of the lock. A cell that compiles flash-attn needs its source package too,
which pip cannot download without building its metadata (that needs torch): the script says which file to
put beside the wheels, or build --without-flash-attn.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ci.locks import LockError, download_wheels, flash_lock_path  # noqa: E402
from ci.matrix import MatrixError, load  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cell")
    ap.add_argument("--without-flash-attn", dest="flash_attn", action="store_false")
    ap.add_argument("--only", help="comma-separated packages of the lock")
    ap.add_argument("--dest", type=Path, default=ROOT / "docker" / "wheelhouse")
    args = ap.parse_args(argv)
    try:
        matrix = load()
        cell = matrix.get(args.cell)
        args.dest.mkdir(parents=True, exist_ok=True)
        url = matrix.index_url(cell)
        only = {n for n in args.only.split(",") if n} if args.only else None
        source = cell.flash_attn.source if args.flash_attn and only is None else "none"
        sdist = args.dest / f"flash_attn-{cell.flash_attn.version}.tar.gz"  # the build checks its sha256
        if source == "source" and not sdist.exists():  # said before any download: the build needs it
            sys.exit(f"wheelhouse: {cell.id} compiles flash-attn: put {sdist.name} "
                     f"(sha256 in {flash_lock_path(matrix, cell.id).name}) in {args.dest}, or pass "
                     "--without-flash-attn here and to the build")
        download_wheels(matrix, cell, args.dest, ["--extra-index-url", url] if url else [], only)
        if source == "wheel":
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes",
                            "--only-binary=:all:", "--python-version", cell.python.replace(".", ""), "--platform",
                            "linux_x86_64", "-d", str(args.dest), "-r", str(flash_lock_path(matrix, cell.id))],
                           check=True)
    except (MatrixError, LockError, KeyError, subprocess.CalledProcessError) as exc:
        print(f"wheelhouse: error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    wheels = sorted(args.dest.glob("*.whl"))
    print(f"wheelhouse: {len(wheels)} wheels ({sum(w.stat().st_size for w in wheels) / 1e6:.0f} MB) in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
