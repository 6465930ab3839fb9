"""A cell's exact lock on a prepared GPU host: an overlay virtual environment.

A GPU host (a cloud machine, a lent one) often has the cell's torch, triton and CUDA libraries already, and
other versions of a few small packages. `make` builds a venv over the host's Python that sees the host's
packages (--system-site-packages) and installs into it, by hash and offline, the lock's own wheels for
every locked package the host lacks or has at another version; then `pip check`. The venv holds exactly the
lock plus the host's extra packages, which is what the GPU sessions' lock check calls known-good; they run
in it with `VENV/bin/nox --no-venv -s gpu_parity backward bench`.

    python -m ci.sessions.overlay plan CELL [--python PY]               what differs; changes nothing
    python -m ci.sessions.overlay download CELL --have FILE --dest DIR  the lock's wheels for what differs
    python -m ci.sessions.overlay make CELL VENV --wheels DIR [--python PY]

`--have` is the host's `pip list --format=freeze`, so that a machine that reaches PyPI can fetch the wheels
for a GPU host that does not. Which packages differ is decided by `nsa.env.check_lock`, the function the
GPU sessions' verdict uses (a torch 2.11.0+cu130 matches a cu130 cell's 2.11.0).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name

from ci.locks import download_wheels, lock_path, parse_lock
from ci.matrix import load
from nsa.env import check_lock

MARKER = "nsa-overlay.json"
LIST_CODE = ("import importlib.metadata as m, json; d = {}\n"
             "for x in m.distributions():\n    d.setdefault(x.metadata['Name'], x.version)\nprint(json.dumps(d))")


def installed(python: str) -> dict[str, str]:
    """name -> version of what `python` imports (the first on its sys.path wins, as for imports)."""
    out = subprocess.run([python, "-c", LIST_CODE], capture_output=True, text=True, check=True).stdout
    return {canonicalize_name(k): v for k, v in json.loads(out).items() if k}


def read_freeze(path: Path) -> dict[str, str]:
    pins = (line.split("==", 1) for line in path.read_text().splitlines() if "==" in line)
    return {canonicalize_name(name.strip()): version.strip() for name, version in pins}


def plan(cell_id: str, have: dict[str, str]) -> dict:
    """{'install': [(name, locked, installed or None)], 'matching': N, 'extra': N} for a host with `have`."""
    text = lock_path(load(), cell_id).read_text()
    res = check_lock(text, have, variant=cell_id.split("-", 1)[0])
    todo = [(e["name"], e["locked"], e.get("installed")) for e in res["missing"] + res["wrong_version"]]
    return {"cell": cell_id, "install": sorted(todo), "matching": res["matching"] + len(res["local_label"]),
            "extra": len(res["extra"])}


def make(cell_id: str, venv: Path, wheels: Path, python: str) -> dict:
    """Create the overlay venv, install what differs from `wheels` (hash-checked, no index), `pip check`."""
    p = plan(cell_id, installed(python))
    subprocess.run([python, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    vpy = str(venv / "bin" / "python")
    if p["install"]:
        pins = parse_lock(lock_path(load(), cell_id).read_text())
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            for name, _, _ in p["install"]:
                pin = pins[name]
                f.write(f"{name}=={pin.version} " + " ".join(f"--hash=sha256:{h}" for h in pin.hashes) + "\n")
        # --ignore-installed: the host's copy of a package must not satisfy the lock's other version.
        subprocess.run([vpy, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "--no-deps",
                        "--require-hashes", "--ignore-installed", "--no-compile", "-r", f.name], check=True)
    check = subprocess.run([vpy, "-m", "pip", "check"], capture_output=True, text=True)
    after = plan(cell_id, installed(vpy))
    record = {**p, "base_python": python, "after": {k: after[k] for k in ("install", "matching", "extra")},
              "pip_check": {"returncode": check.returncode, "output": check.stdout.strip().splitlines()[:50]}}
    (venv / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.sessions.overlay", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="what differs between a Python's packages and the cell's lock")
    dl = sub.add_parser("download", help="the lock's wheels for what a host (pip freeze) lacks or has otherwise")
    mk = sub.add_parser("make", help="create the overlay venv and install the lock's wheels into it")
    for p in (pl, dl, mk):
        p.add_argument("cell")
    for p in (pl, mk):
        p.add_argument("--python", default=sys.executable, help="the host's interpreter (default: this one)")
    dl.add_argument("--have", type=Path, required=True, help="the host's `pip list --format=freeze`")
    dl.add_argument("--dest", type=Path, required=True)
    mk.add_argument("venv", type=Path)
    mk.add_argument("--wheels", type=Path, required=True, help="folder of the lock's wheels (download's --dest)")
    args = ap.parse_args(argv)
    if args.cmd == "make":
        rec = make(args.cell, args.venv, args.wheels, args.python)
        left = rec["after"]["install"]
        print(f"{args.venv}: {len(rec['install'])} package(s) from the lock's wheels over {args.python}; "
              f"{len(left)} still differ; pip check exit {rec['pip_check']['returncode']}")
        for line in rec["pip_check"]["output"]:
            print(f"  pip check: {line}")
        return 1 if left or rec["pip_check"]["returncode"] else 0
    have = read_freeze(args.have) if args.cmd == "download" else installed(args.python)
    p = plan(args.cell, have)
    if args.cmd == "download":
        args.dest.mkdir(parents=True, exist_ok=True)
        m = load()
        files = download_wheels(m, m.get(args.cell), args.dest, only={n for n, _, _ in p["install"]})
        print(f"{len(files)} wheel(s) in {args.dest} for {len(p['install'])} package(s)")
        return 0
    print(f"{args.cell}: {p['matching']} as locked, {len(p['install'])} to install, {p['extra']} extra")
    for name, want, have in p["install"]:
        print(f"  {name:28} locked {want:14} installed {have or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
