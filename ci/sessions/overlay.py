"""A cell's exact lock on a prepared GPU host: an overlay virtual environment.

A GPU host (a cloud or rented machine) often has the cell's torch, triton and CUDA libraries already, and
other versions of a few small packages. `make` builds a venv over the host's Python that sees the host's
packages (every site directory on the host interpreter's sys.path, in its order, after the venv's own; the
host's Python may itself be a venv) and installs into it, by hash and offline, the lock's own wheels for
every locked package the host lacks or has at another version; then `pip check`. The venv holds exactly the
lock plus the host's extra packages, which is what the GPU sessions' lock check calls known-good; they run
in it with `VENV/bin/nox --no-venv -s gpu_parity backward bench`.

    python -m ci.sessions.overlay plan CELL [--python PY]               what differs; changes nothing
    python -m ci.sessions.overlay download CELL --have FILE --dest DIR  the lock's wheels for what differs
    python -m ci.sessions.overlay make CELL VENV --wheels DIR [--python PY]

`--have` is the host's `pip list --format=freeze`, so that a machine that reaches PyPI can fetch the wheels
for a GPU host that does not. Which packages differ is decided by `nsa_env.drift.check_lock`, the function the
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
from nsa_env.drift import check_lock

MARKER = "nsa-overlay.json"
SITES_CODE = ("import json, os, sys; print(json.dumps([p for p in sys.path if os.path.basename(p) in "
              "('site-packages', 'dist-packages') and os.path.isdir(p)]))")
ROOT = Path(__file__).resolve().parents[2]


def installed(python: str) -> dict[str, str]:
    """name -> version of what `python` imports: nsa-env's view (the first on sys.path wins, as for imports)."""
    code = "import json, nsa_env.drift as e; print(json.dumps(e.installed_distributions()))"
    return json.loads(subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout)


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
    # No pip of its own (ensurepip would bring its own pip and setuptools, shadowing the host's): the host's
    # pip works on the venv through --python.
    subprocess.run([python, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)  # always from scratch
    vpy, pip = str(venv / "bin" / "python"), [python, "-m", "pip", "--python", str(venv / "bin" / "python")]
    sites = json.loads(subprocess.run([python, "-c", SITES_CODE], capture_output=True, text=True, check=True).stdout)
    own = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    # addsitedir also runs the host's own .pth files, as the host's interpreter does.
    Path(own, "nsa-host-site.pth").write_text(f"import site; list(map(site.addsitedir, {sites!r}))\n")
    p = plan(cell_id, installed(vpy))
    if p["install"]:
        pins = parse_lock(lock_path(load(), cell_id).read_text())
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            for name, _, _ in p["install"]:
                pin = pins[name]
                f.write(f"{name}=={pin.version} " + " ".join(f"--hash=sha256:{h}" for h in pin.hashes) + "\n")
        # --ignore-installed: the host's copy of a package must not satisfy the lock's other version.
        subprocess.run([*pip, "install", "-q", "--no-index", "--find-links", str(wheels), "--no-deps",
                        "--require-hashes", "--ignore-installed", "--no-compile", "-r", f.name], check=True)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    after = plan(cell_id, installed(vpy))
    record = {**p, "base_python": python, "host_sites": sites,
              "after": {k: after[k] for k in ("install", "matching", "extra")},
              "pip_check": {"returncode": check.returncode, "output": check.stdout.strip().splitlines()[:50]}}
    (venv / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.sessions.overlay", description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=("plan", "download", "make"), help="see this module's docstring")
    ap.add_argument("cell")
    ap.add_argument("venv", type=Path, nargs="?", help="make: the venv to create")
    ap.add_argument("--python", default=sys.executable, help="the host's interpreter (default: this one)")
    ap.add_argument("--have", type=Path, help="download: the host's `pip list --format=freeze`")
    ap.add_argument("--dest", type=Path, help="download: where the wheels go")
    ap.add_argument("--wheels", type=Path, help="make: folder of the lock's wheels (download's --dest)")
    args = ap.parse_args(argv)
    needs = {"download": ("have", "dest"), "make": ("venv", "wheels")}.get(args.cmd, ())
    if [n for n in needs if getattr(args, n) is None]:
        ap.error(f"{args.cmd} needs " + " and ".join(f"--{n}" if n != "venv" else "VENV" for n in needs))
    if args.cmd == "make":
        rec = make(args.cell, args.venv, args.wheels, args.python)
        print(f"{args.venv}: {len(rec['install'])} package(s) from the lock's wheels over {args.python}; "
              f"{len(rec['after']['install'])} still differ; pip check exit {rec['pip_check']['returncode']}")
        print("".join(f"  pip check: {line}\n" for line in rec["pip_check"]["output"]), end="")
        return int(bool(rec["after"]["install"] or rec["pip_check"]["returncode"]))
    p = plan(args.cell, read_freeze(args.have) if args.cmd == "download" else installed(args.python))
    if args.cmd == "download":
        m = load()
        files = download_wheels(m, m.get(args.cell), args.dest, only={n for n, _, _ in p["install"]})
        print(f"{len(files)} wheel(s) in {args.dest} for {len(p['install'])} package(s)")
        return 0
    print(f"{args.cell}: {p['matching']} as locked, {len(p['install'])} to install, {p['extra']} extra")
    print("".join(f"  {n:28} locked {want:14} installed {have or '-'}\n" for n, want, have in p["install"]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
