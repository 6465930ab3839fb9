"""Lock drift: the installed distributions against a cell's lock (missing, extra, wrong version), and the
triton torch pins. The lock is read by nsa_env.lockfile, the parser ci/ uses too.

An installed nsa carries no locks: the lock is a path given on the command line, or a cell id looked up
in the checkout that holds the current directory (requirements/locks/<cell>.txt), and nowhere else.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from nsa_env import upstream
from nsa_env.lockfile import parse_lock

# Not part of any lock: the installer itself and this project (installed with --no-deps after the lock).
LOCK_IGNORED = ("pip", "nsa")
CELL_ID = re.compile(r"^(cpu|cu\d+)-torch[\d.]+-py\d+$")


def installed_distributions() -> dict[str, str]:
    out: dict[str, str] = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name:
            out.setdefault(canonicalize_name(name), d.version)  # first on sys.path wins, as for imports
    return out


def _same(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:  # a non-PEP 440 version: compare the text
        return a == b


def check_lock(
    lock_text: str, installed: dict[str, str], variant: str | None = None, triton_pin: str | None = None
) -> dict[str, Any]:
    """Compare installed distributions with a lock. `variant` (cpu, cu130) accepts a local label that
    names the same build: the lock's torch 2.11.0 (PyPI's CUDA 13.0 build) is installed 2.11.0+cu130
    from PyTorch's index. A URL wheel's +cu12torch2.8... label is upstream's renaming of the built wheel:
    the installed metadata says plain 2.8.3, so its public version is what is compared.
    `triton_pin` (report.expected_triton(): "3.6.0" or a range such as "~=3.8.0"): an installed triton
    outside torch's pin is drift too, whatever the lock says. LockError for a line that does not parse."""
    locked = {name: p.version.split("+")[0] if p.url else p.version for name, p in parse_lock(lock_text).items()}
    result: dict[str, Any] = {
        "missing": [],
        "extra": [],
        "wrong_version": [],
        "local_label": [],
        "ignored": [],
        "matching": 0,
    }
    for name, want in sorted(locked.items()):
        have = installed.get(name)
        if have is None:
            result["missing"].append({"name": name, "locked": want})
        elif _same(have, want):
            result["matching"] += 1
        else:
            pub_have, _, label_have = have.partition("+")
            pub_want, _, label_want = want.partition("+")
            same_build = _same(pub_have, pub_want) and (
                not label_have or label_have == variant or (label_want and not label_have)
            )
            entry = {"name": name, "locked": want, "installed": have}
            result["local_label" if same_build else "wrong_version"].append(entry)
    for name, have in sorted(installed.items()):
        if name in locked:
            continue
        (result["ignored"] if name in LOCK_IGNORED else result["extra"]).append(
            {"name": name, "installed": have}
        )
    have_triton = installed.get("triton")
    result["torch_triton"] = None
    if triton_pin and have_triton and not upstream.pin_matches(have_triton, triton_pin):
        result["torch_triton"] = {"torch": installed.get("torch"), "triton": have_triton, "torch_pins": triton_pin}
    result["drift"] = bool(result["missing"] or result["extra"] or result["wrong_version"] or result["torch_triton"])
    return result


def find_checkout(start: Path | None = None) -> Path | None:
    """The checkout holding `start` (default: the current directory): the nearest folder, `start` or
    above, with requirements/matrix.toml. None outside a checkout."""
    here = (start or Path.cwd()).resolve()
    return next((d for d in (here, *here.parents) if (d / "requirements" / "matrix.toml").is_file()), None)


def find_lock(cell_or_path: str, start: Path | None = None) -> Path:
    """A lock given as a path (any existing file), or as a cell id: requirements/locks/<cell>.txt of the
    checkout that holds the current directory. FileNotFoundError saying what was looked for otherwise."""
    p = Path(cell_or_path)
    if p.is_file():
        return p
    if not CELL_ID.match(cell_or_path):
        raise FileNotFoundError(f"--check-lock: {cell_or_path!r} is neither a lock file nor a cell id "
                                "({cpu|cuXYZ}-torchM.m-pyXY)")
    root = find_checkout(start)
    if root is None:
        raise FileNotFoundError(
            f"--check-lock {cell_or_path}: the current directory ({(start or Path.cwd())}) is not inside a "
            "checkout of this project (no requirements/matrix.toml here or above), and an installed nsa "
            "carries no locks; run it from the checkout, or pass the lock's path")
    lock = root / "requirements" / "locks" / f"{cell_or_path}.txt"
    if not lock.is_file():
        raise FileNotFoundError(f"--check-lock: no lock {lock.relative_to(root)} in the checkout {root}; "
                                "pass a cell id of requirements/matrix.toml or a lock's path")
    return lock


def print_drift(lock: Path, res: dict[str, Any]) -> None:
    print(f"lock {lock}: {res['matching']} matching")
    for title, key in (
        ("version drift", "wrong_version"),
        ("missing (in the lock, not installed)", "missing"),
        ("extra (installed, not in the lock)", "extra"),
        ("same release, other local label (not drift)", "local_label"),
    ):
        if res[key]:
            print(f"{title}: {len(res[key])}")
            for e in res[key]:
                print(
                    f"  {e['name']:28} locked {e.get('locked', '-'):16} installed {e.get('installed', '-')}"
                )
    if res.get("torch_triton"):
        tt = res["torch_triton"]
        pin = upstream.pin_specifier(tt["torch_pins"])
        print(f"torch/triton mismatch: triton {tt['triton']} is outside torch {tt['torch']}'s pin triton{pin}")
    print("DRIFT" if res["drift"] else "no drift")

