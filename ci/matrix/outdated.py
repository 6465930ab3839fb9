"""What PyPI has that is newer than the configuration matrix and the tool locks.

    python -m ci.matrix.outdated            # or: nox -s lock -- --outdated
    python -m ci.matrix.outdated --record tests/ci/data/pypi   # save PyPI's answers, trimmed, for the tests

Asks PyPI's JSON API (https://pypi.org/pypi/<name>/json; NSA_PYPI_JSON_URL for a mirror of it) about torch
(patch releases of the matrix's minors: cells to move; newer minors: cells to add, per CPython with a Linux
x86_64 wheel, named from the CUDA of PyPI's build), triton (newer than every cell's), flash-attn (newer than
[upstream.flash_attn], with the sdist's sha256) and the packages the tool locks' inputs name (newer than
their lock's pin). Pre-releases and fully yanked releases do not count. Exit 0 when nothing is new, 1 when
something is (each with what to do), 2 when PyPI cannot be asked. The weekly `outdated` workflow runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ci.matrix import DEFAULT_PATH, Matrix, MatrixError, load, universal_targets
from nsa_env.lockfile import iter_lock

PYPI_JSON = "https://pypi.org/pypi"
KEEP_OLDER = 4  # `record` keeps at least a package's last few final releases
Fetch = Callable[[str], dict[str, Any]]


@dataclass
class Finding:
    what: str  # "torch", "triton", "flash-attn" or a tool's name
    baseline: str  # what the matrix or lock has
    newest: str  # PyPI's newest final release
    new: list[str]  # releases newer than the baseline (empty: up to date)
    todo: list[str]  # what to do, one line each


def fetch_pypi(name: str, base: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """PyPI's JSON document of a project."""
    base = (base or os.environ.get("NSA_PYPI_JSON_URL") or PYPI_JSON).rstrip("/")
    request = urllib.request.Request(f"{base}/{name}/json", headers={"Accept": "application/json",
                                                                      "User-Agent": "nsa-ci-outdated"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def _releases(doc: dict[str, Any]):
    """(raw version, Version, its files that are not yanked) of every release with a PEP 440 version."""
    for raw, files in doc.get("releases", {}).items():
        try:
            yield raw, Version(raw), [f for f in files if not f.get("yanked")]
        except InvalidVersion:
            continue


def final_releases(doc: dict[str, Any]) -> list[Version]:
    """Final (not pre-, not dev-) releases with at least one file that is not yanked, oldest first."""
    return sorted(v for _, v, files in _releases(doc) if files and not (v.is_prerelease or v.is_devrelease))


def _files(doc: dict[str, Any], version: Version) -> list[dict[str, Any]]:
    """The files of a release that are not yanked."""
    return next((files for _, v, files in _releases(doc) if v == version), [])


def _mm(v: Version) -> str:
    return f"{v.major}.{v.minor}"


# --- torch -------------------------------------------------------------------------------------------


def linux_pythons(doc: dict[str, Any], version: Version) -> list[str]:
    """CPython versions ("3.12") with a manylinux x86_64 wheel of this torch release (no free-threaded)."""
    tags = (re.fullmatch(r"torch-[^-]+-cp(\d)(\d+)-cp\d+-manylinux[^-]*x86_64\.whl", f.get("filename", ""))
            for f in _files(doc, version))
    return sorted({f"{m.group(1)}.{m.group(2)}" for m in tags if m}, key=Version)


def pypi_build(doc: dict[str, Any], version: Version) -> tuple[str, str]:
    """(CUDA "13.2", triton pin "~=3.9.0") of PyPI's build, read from Requires-Dist. PyPI's JSON document
    carries the metadata of the newest release only: ("", "") for any other."""
    info = doc.get("info", {})
    if info.get("version") != str(version):
        return "", ""
    cuda = triton = ""
    for line in info.get("requires_dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if name in ("cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu11") \
                and exact and not cuda:
            cuda = ".".join(exact[0].split(".")[:2])
        elif name == "triton":
            triton = str(req.specifier)
    return cuda, triton


def check_torch(matrix: Matrix, doc: dict[str, Any]) -> Finding:
    known = sorted(Version(v) for v in matrix.upstream.get("torch", {}))
    newest_known = known[-1]
    newest_per_minor = {_mm(v): v for v in known}  # sorted: the last patch of each minor wins
    releases = final_releases(doc)
    new, todo = [], []
    for v in releases:
        mm = _mm(v)
        if mm in newest_per_minor and v > newest_per_minor[mm]:
            cells = ", ".join(c.id for c in matrix.cells if c.torch_mm == mm) or "no cell"
            new, todo = new + [str(v)], todo + [f"torch {v}: a patch release of {mm}: add [upstream.torch.\"{v}\"] "
                                                f"and move {cells} to it"]
        elif v > newest_known and (v.major, v.minor) > (newest_known.major, newest_known.minor):
            new, todo = new + [str(v)], todo + [_new_minor(v, doc)]
    return Finding("torch", str(newest_known), str(releases[-1]) if releases else "?", new, todo)


def _new_minor(v: Version, doc: dict[str, Any]) -> str:
    pythons = linux_pythons(doc, v)
    cuda, triton = pypi_build(doc, v)
    if not cuda:
        return (f"torch {v}: a new release with Linux wheels for CPython {', '.join(pythons) or '?'}; its CUDA and "
                f"triton pin: `echo torch=={v} | uv pip compile - --python-platform x86_64-manylinux_2_28 "
                f"--python-version {pythons[-1] if pythons else '3.12'}`, then add [upstream.torch.\"{v}\"] and a cell "
                "per Python (docs/environments.md, \"Add a cell\")")
    variant = "cu" + cuda.replace(".", "")
    cells = ", ".join(f"{variant}-torch{_mm(v)}-py{p.replace('.', '')}" for p in pythons)
    return (f"torch {v}: PyPI's build is CUDA {cuda}, pins triton{triton or ' (none)'}, has Linux wheels for CPython "
            f"{', '.join(pythons)}: add [upstream.torch.\"{v}\"] and the cells {cells}")


# --- triton, flash-attn ---------------------------------------------------------------------------------


def check_triton(matrix: Matrix, doc: dict[str, Any]) -> Finding:
    pinned = max((Version(c.triton) for c in matrix.cells if c.triton != "none"), default=Version("0"))
    releases = final_releases(doc)
    new = [str(v) for v in releases if v > pinned]
    todo = [f"triton {v}: no cell has it; torch pins triton, so it arrives with the torch release that requires "
            "it (see torch above)" for v in new]
    return Finding("triton", str(pinned), str(releases[-1]) if releases else "?", new, todo)


def check_flash_attn(matrix: Matrix, doc: dict[str, Any]) -> Finding:
    known = max((Version(v) for v in matrix.upstream.get("flash_attn", {})), default=Version("0"))
    releases = final_releases(doc)
    new, todo = [], []
    for v in releases:
        if v <= known:
            continue
        sdist = next((f for f in _files(doc, v) if f.get("packagetype") == "sdist"), None)
        sha = (sdist or {}).get("digests", {}).get("sha256", "")
        new.append(str(v))
        todo.append(f"flash-attn {v}: add [upstream.flash_attn.\"{v}\"] (sdist_sha256 = \"{sha or '?'}\", its "
                    "upstream wheels, cxx_std from its setup.py), then point the GPU cells at it and relock")
    return Finding("flash-attn", str(known), str(releases[-1]) if releases else "?", new, todo)


# --- tools -------------------------------------------------------------------------------------------


def tool_pins(matrix: Matrix) -> dict[str, dict[str, Version]]:
    """Each package named in a tool lock's input -> {lock name: the newest version that lock pins}."""
    out: dict[str, dict[str, Version]] = {}
    for lock_name, (in_file, lock) in universal_targets(matrix).items():
        locked: dict[str, Version] = {}
        for r in iter_lock(lock.read_text()):  # a universal lock may pin a name once per Python range
            locked[r.name] = max(locked.get(r.name, Version(r.version)), Version(r.version))
        for line in in_file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name = canonicalize_name(Requirement(line).name)
            if name in locked:
                out.setdefault(name, {})[lock_name] = locked[name]
    return out


def check_tool(name: str, pins: dict[str, Version], doc: dict[str, Any]) -> Finding:
    releases = final_releases(doc)
    oldest = min(pins.values())
    newest = releases[-1] if releases else None
    stale = sorted(lock for lock, v in pins.items() if newest and v < newest)
    where = ", ".join(f"{lock} {v}" for lock, v in sorted(pins.items()))
    new = [str(v) for v in releases if v > oldest and stale]
    todo = [f"{name} {newest}: newer than {where}: `nox -s lock -- {' '.join(stale)}`"] if stale else []
    return Finding(name, where, str(newest) if newest else "?", new[-1:], todo)


# --- the report ----------------------------------------------------------------------------------------


def outdated(matrix: Matrix, fetch: Fetch) -> list[Finding]:
    return [check_torch(matrix, fetch("torch")), check_triton(matrix, fetch("triton")),
            check_flash_attn(matrix, fetch("flash-attn")),
            *(check_tool(name, pins, fetch(name)) for name, pins in sorted(tool_pins(matrix).items()))]


def trim(name: str, doc: dict[str, Any], floor: Version) -> dict[str, Any]:
    """PyPI's document cut down to what this module reads: releases from `floor` on, and of their files
    the names and yanked flags (torch: its manylinux x86_64 wheels; flash-attn: the sdist with its digest);
    Requires-Dist of torch's newest release."""
    keep = ("filename", "yanked", "packagetype") + (("digests",) if name == "flash-attn" else ())
    wanted = {"torch": lambda f: re.search(r"manylinux[^-]*x86_64\.whl$", f.get("filename", "")),
              "flash-attn": lambda f: f.get("packagetype") == "sdist"}.get(name)
    releases = {raw: [{k: ({"sha256": f[k]["sha256"]} if k == "digests" else f[k]) for k in keep if k in f}
                      for f in ([f for f in doc["releases"][raw] if wanted(f)] if wanted else doc["releases"][raw][:1])]
                for raw, version, _ in _releases(doc) if version >= floor}
    info = {"version": doc["info"]["version"]}
    if name == "torch":
        info["requires_dist"] = [r for r in doc["info"].get("requires_dist") or []
                                 if re.match(r"(triton|cuda-toolkit|nvidia-cuda-runtime)\b", r)]
    return {"info": info, "releases": releases}


def record(matrix: Matrix, dest: Path, fetch: Fetch) -> list[Path]:
    """Save PyPI's answers for every package this module asks about, trimmed, as dest/<name>.json."""
    floors = {"torch": min(Version(v) for v in matrix.upstream["torch"]),
              "triton": min(Version(c.triton) for c in matrix.cells if c.triton != "none"),
              "flash-attn": min(Version(v) for v in matrix.upstream.get("flash_attn", {}))}
    floors |= {name: min(pins.values()) for name, pins in tool_pins(matrix).items()}
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name, floor in sorted(floors.items()):
        doc = fetch(name)
        floor = min(floor, *final_releases(doc)[-KEEP_OLDER:])  # and a few older releases, for the tests
        path = dest / f"{name}.json"
        path.write_text(json.dumps(trim(name, doc, floor), indent=1, sort_keys=True) + "\n")
        out.append(path)
    return out


def recorded(directory: Path) -> Fetch:
    """A fetch that answers from documents saved by `record` (tests: no network)."""
    return lambda name: json.loads((directory / f"{name}.json").read_text())


def render(findings: list[Finding]) -> str:
    lines = [f"{f.what:18} {'matrix/lock: ' + f.baseline:52} PyPI: {f.newest:14} "
             f"{'NEW: ' + ', '.join(f.new) if f.new else 'up to date'}" for f in findings]
    todo = [t for f in findings for t in f.todo]
    lines += (["", "To do:"] + [f"  - {t}" for t in todo] if todo else []) + [""]
    lines.append(f"outdated: {sum(bool(f.new) for f in findings)} of {len(findings)} packages have newer releases"
                 if todo else f"outdated: all {len(findings)} packages are up to date")
    return "\n".join(lines)


def main(argv: list[str] | None = None, fetch: Fetch | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.matrix.outdated", description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", type=Path, default=DEFAULT_PATH)
    ap.add_argument("--record", type=Path, metavar="DIR", help="save PyPI's answers, trimmed, as DIR/<name>.json")
    args = ap.parse_args(argv)
    try:
        matrix = load(args.matrix)
        if args.record:
            paths = record(matrix, args.record, fetch or fetch_pypi)
            print(f"recorded {len(paths)} documents in {args.record}")
            return 0
        findings = outdated(matrix, fetch or fetch_pypi)
    except MatrixError as e:
        print(e, file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors; a bad document is a ValueError
        base = os.environ.get("NSA_PYPI_JSON_URL") or PYPI_JSON
        print(f"outdated: cannot ask PyPI's JSON API ({base}): {e}", file=sys.stderr)
        return 2
    print(render(findings))
    return 1 if any(f.new for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
