"""Emit GitHub Actions matrices (JSON) from requirements/matrix.toml, the one source of truth.

    python ci/gh_matrix.py gpu      [--cells A,B] [--gpus a100,h100]   # cells x GPU classes, GPU cells only
    python ci/gh_matrix.py images   [--cells A,B]                      # every cell's image build
    python ci/gh_matrix.py cells    [--cpu | --gpu-only]               # cell ids, one per line
    python ci/gh_matrix.py build-args --cells ID                       # KEY=VALUE docker build args
    python ci/gh_matrix.py gpu --images-lock images.lock.json          # adds `image` (repo@digest)
    ... --github-output NAME   appends NAME=<json> to $GITHUB_OUTPUT instead of printing

The GPU matrix pairs each non-CPU cell with the GPU classes whose compute capability the cell was built
for (`gpu_archs`), and carries the minimum NVIDIA driver for the cell's CUDA version and the runner
label (`cuda12`, `cuda13`) a host must carry to run it (docs/runners.md explains the labels).
The cells come from `ci.matrix` (the validated loader) when it offers a loader function, else straight
from the TOML file with tomllib.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MATRIX = ROOT / "requirements" / "matrix.toml"

# GPU class (runner label) -> compute capability it needs kernels for.
GPU_CLASSES: dict[str, str] = {"a100": "8.0", "h100": "9.0"}

# Minimum Linux driver of each CUDA toolkit's GA release (NVIDIA CUDA toolkit release notes, "CUDA
# Toolkit and Corresponding Driver Versions"). A driver of the same major family also runs newer minor
# releases through minor-version compatibility (MINOR_COMPAT_FLOOR), with limits (no newer PTX JIT).
TOOLKIT_GA_DRIVER: dict[str, str] = {
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}
MINOR_COMPAT_FLOOR: dict[str, str] = {"12": "525.60.13", "13": "580.65.06"}


class MatrixError(ValueError):
    """The matrix file is missing, malformed, or a cell lacks what the workflows need."""


def _load_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise MatrixError(f"matrix file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{path}: invalid TOML: {exc}") from exc


def _cells_from_toml(path: Path) -> list[dict[str, Any]]:
    data = _load_toml(path)
    raw = data.get("cells", data.get("cell"))
    if raw is None:
        raise MatrixError(f"{path}: no [[cells]] (or [[cell]]) tables")
    if isinstance(raw, dict):  # [cells.<id>] tables
        raw = [{"id": key, **value} for key, value in raw.items()]
    if not isinstance(raw, list) or not all(isinstance(c, dict) for c in raw):
        raise MatrixError(f"{path}: cells must be a list of tables")
    return [dict(c) for c in raw]


def _cells_from_loader(path: Path) -> list[dict[str, Any]] | None:
    """Cells from ci.matrix's validated loader (`load(path) -> Matrix` with `.cells`); None when that
    module or its dependencies (packaging) are not importable here, e.g. a bare runner's python3."""
    sys.path.insert(0, str(ROOT))
    try:
        from ci import matrix as loader  # noqa: PLC0415 - optional, owned by the environments engineer
    except ImportError:
        return None
    finally:
        sys.path.remove(str(ROOT))
    load = getattr(loader, "load", None)
    if not callable(load):
        return None
    try:
        matrix = load(path)
    except ValueError as exc:  # ci.matrix.MatrixError lists every problem
        raise MatrixError(str(exc)) from exc
    cells = []
    for cell in getattr(matrix, "cells", []):
        d = cell.to_json() if hasattr(cell, "to_json") else dict(cell)
        d["gpu_archs"] = list(d.get("gpu_archs") or [])
        cells.append(d)
    return cells


def load_cells(path: Path = DEFAULT_MATRIX, use_loader: bool = True) -> list[dict[str, Any]]:
    """All cells of the matrix, validated for the fields the workflows use (and by ci.matrix, when it is
    importable and use_loader is true)."""
    cells = _cells_from_loader(path) if use_loader and path.exists() else None
    if cells is None:
        cells = _cells_from_toml(path)
    seen: set[str] = set()
    for i, cell in enumerate(cells):
        cid = cell.get("id")
        if not isinstance(cid, str) or not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", cid):
            raise MatrixError(f"{path}: cell #{i}: missing or invalid id {cid!r} (lowercase, digits, ._-)")
        if cid in seen:
            raise MatrixError(f"{path}: duplicate cell id {cid!r}")
        seen.add(cid)
        for key in ("python", "torch"):
            if key not in cell:
                raise MatrixError(f"{path}: cell {cid!r} lacks {key!r}")
    return cells


def is_gpu_cell(cell: dict[str, Any]) -> bool:
    if "cpu_only" in cell:
        return not bool(cell["cpu_only"])
    return bool(cell.get("cuda"))


def cuda_version(cell: dict[str, Any]) -> str:
    cuda = str(cell.get("cuda") or "")
    m = re.fullmatch(r"(?:cu)?(\d{2})(\d)|(\d+)\.(\d+)(?:\.\d+)?", cuda)
    if not m:
        raise MatrixError(f"cell {cell['id']!r}: unreadable CUDA version {cuda!r} (want '12.8' or 'cu128')")
    major, minor = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return f"{int(major)}.{int(minor)}"


def min_driver(cuda: str) -> tuple[str, str]:
    """(driver of the toolkit's GA release, minor-version-compatibility floor) for a CUDA version."""
    major = cuda.split(".")[0]
    if major not in MINOR_COMPAT_FLOOR:
        raise MatrixError(f"CUDA {cuda}: no known driver floor (known majors: {sorted(MINOR_COMPAT_FLOOR)})")
    ga = TOOLKIT_GA_DRIVER.get(cuda)
    if ga is None:  # a minor release newer than this table: the newest known of its major is the floor
        known = [v for v in TOOLKIT_GA_DRIVER if v.split(".")[0] == major]
        ga = TOOLKIT_GA_DRIVER[max(known, key=lambda v: int(v.split(".")[1]))]
    return ga, MINOR_COMPAT_FLOOR[major]


def _arch_set(cell: dict[str, Any]) -> set[str] | None:
    """Compute capabilities the cell targets as 'M.m' strings; None when the cell does not say."""
    archs = cell.get("gpu_archs")
    if archs is None or archs == "all":
        return None
    if isinstance(archs, str):
        archs = re.split(r"[;,\s]+", archs.strip())
    out = set()
    for a in archs:
        a = str(a).strip().lower().removesuffix("+ptx").removeprefix("sm_").removeprefix("compute_")
        if not a:
            continue
        if re.fullmatch(r"\d+\.\d+", a):
            out.add(a)
        elif re.fullmatch(r"\d{2,3}[a-z]?", a):  # '80', '90a', '100'
            digits = a.rstrip("abcdefghijklmnopqrstuvwxyz")
            out.add(f"{digits[:-1]}.{digits[-1]}")
        else:
            raise MatrixError(f"cell {cell['id']!r}: cannot read GPU arch {a!r}")
    return out


def runs_on(gpu: str, cuda_label: str, scale_sets: bool = False) -> list[str]:
    """The runner labels a GPU job asks for (docs/runners.md). Actions Runner Controller scale sets are
    addressed by their name alone, so with scale_sets the job asks for the set `nsa-<gpu>-<cudaN>`."""
    if scale_sets:
        return [f"nsa-{gpu}-{cuda_label}"]
    return ["self-hosted", "linux", "x64", "gpu", gpu, cuda_label]


def gpu_matrix(
    cells: list[dict[str, Any]], gpus: list[str] | None = None, scale_sets: bool = False
) -> dict[str, list[dict[str, Any]]]:
    gpus = gpus or list(GPU_CLASSES)
    unknown = [g for g in gpus if g not in GPU_CLASSES]
    if unknown:
        raise MatrixError(f"unknown GPU class(es) {unknown}; known: {sorted(GPU_CLASSES)}")
    include = []
    for cell in cells:
        if not is_gpu_cell(cell):
            continue
        cuda = cuda_version(cell)
        ga, floor = min_driver(cuda)
        archs = _arch_set(cell)
        for gpu in gpus:
            if archs is not None and GPU_CLASSES[gpu] not in archs:
                continue
            include.append(
                {
                    "cell": cell["id"],
                    "gpu": gpu,
                    "python": str(cell["python"]),
                    "torch": str(cell["torch"]),
                    "triton": str(cell.get("triton", "")),
                    "cuda": cuda,
                    "cuda_label": f"cuda{cuda.split('.')[0]}",
                    "runs_on": runs_on(gpu, f"cuda{cuda.split('.')[0]}", scale_sets),
                    "min_driver": ga,
                    "min_driver_compat": floor,
                }
            )
    return {"include": include}


def images_matrix(cells: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    include = []
    for cell in cells:
        include.append(
            {
                "cell": cell["id"],
                "python": str(cell["python"]),
                "cpu_only": not is_gpu_cell(cell),
                "base_image": str(cell.get("base_image", "")),
            }
        )
    return {"include": include}


def attach_images(matrix: dict[str, list[dict[str, Any]]], lock: dict[str, Any]) -> None:
    """Give each GPU matrix entry the image pinned by digest in an images lock (images.yml's format:
    {cell: {"image": "ghcr.io/<owner>/nsa", "digest": "sha256:..."}}); a missing cell is an error."""
    missing = []
    for entry in matrix["include"]:
        rec = lock.get(entry["cell"])
        digest = rec.get("digest", "") if isinstance(rec, dict) else ""
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or not rec.get("image"):
            missing.append(entry["cell"])
            continue
        entry["image"] = f"{rec['image']}@{digest}"
    if missing:
        raise MatrixError(f"images lock has no valid digest for cell(s) {sorted(set(missing))}")


# Dockerfile ARG name -> its value for a cell (docker/Dockerfile's ARGs). Only ARGs the Dockerfile
# declares and the cell fills are passed; the workflow adds REVISION, CREATED and SOURCE_URL.
def _fa(cell: dict[str, Any], key: str) -> str | None:
    fa = cell.get("flash_attn")
    return str(fa.get(key) or "") or None if isinstance(fa, dict) else None


def _lock_sha256(cell: dict[str, Any]) -> str | None:
    lock = ROOT / "requirements" / "locks" / f"{cell['id']}.txt"
    return hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None


BUILD_ARGS: dict[str, Any] = {
    "CELL": lambda c: c["id"],
    "PYTHON": lambda c: str(c["python"]),
    "BUILD_BASE": lambda c: c.get("base_image"),
    "RUNTIME_BASE": lambda c: c.get("runtime_image") or c.get("base_image"),
    "LOCK_SHA256": _lock_sha256,
    "TORCH_VERSION": lambda c: str(c["torch"]),
    "CUDA_VERSION": lambda c: cuda_version(c) if is_gpu_cell(c) else "none",
    "TRITON_VERSION": lambda c: str(c.get("triton") or "") or None,
    "FLASH_ATTN_VERSION": lambda c: _fa(c, "version"),
    "FLASH_ATTN_SOURCE": lambda c: _fa(c, "source"),
    "GPU_ARCHS": lambda c: _arch_list(c),
    "TORCH_CUDA_ARCH_LIST": lambda c: _arch_list(c),
}


def _arch_list(cell: dict[str, Any]) -> str | None:
    archs = _arch_set(cell) if is_gpu_cell(cell) else None
    return ";".join(sorted(archs, key=float)) if archs else None


def dockerfile_args(dockerfile: Path) -> set[str]:
    names = set()
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)", line)
        if m:
            names.add(m.group(1))
    return names


def build_args(cell: dict[str, Any], dockerfile: Path) -> dict[str, str]:
    """The docker build args for a cell: those of BUILD_ARGS the Dockerfile declares and the cell fills."""
    declared = dockerfile_args(dockerfile) if dockerfile.exists() else set(BUILD_ARGS)
    out = {}
    for name, get in BUILD_ARGS.items():
        if name in declared:
            value = get(cell)
            if value:
                out[name] = str(value)
    return out


def _select(cells: list[dict[str, Any]], wanted: str | None) -> list[dict[str, Any]]:
    if not wanted:
        return cells
    names = [w for w in re.split(r"[,\s]+", wanted) if w]
    ids = {c["id"] for c in cells}
    missing = [n for n in names if n not in ids]
    if missing:
        raise MatrixError(f"unknown cell(s) {missing}; known: {sorted(ids)}")
    return [c for c in cells if c["id"] in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["gpu", "images", "cells", "build-args"])
    ap.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX)
    ap.add_argument("--cells", default="", help="comma-separated cell ids (default: all)")
    ap.add_argument("--gpus", default="", help=f"GPU classes (default: {','.join(GPU_CLASSES)})")
    ap.add_argument("--cpu", action="store_true", help="cells: only CPU cells")
    ap.add_argument("--gpu-only", action="store_true", help="cells: only GPU cells")
    ap.add_argument("--images-lock", type=Path, help="gpu: pin each entry's image by digest from this lock")
    ap.add_argument(
        "--scale-sets",
        action="store_true",
        default=os.environ.get("NSA_RUNNER_SCALE_SETS", "") in ("1", "true"),
        help="gpu: target Actions Runner Controller scale sets by name (default: $NSA_RUNNER_SCALE_SETS)",
    )
    ap.add_argument("--dockerfile", type=Path, default=ROOT / "docker" / "Dockerfile")
    ap.add_argument("--github-output", metavar="NAME", help="append NAME=<json> to $GITHUB_OUTPUT")
    args = ap.parse_args(argv)
    try:
        cells = _select(load_cells(args.matrix), args.cells)
        if args.kind == "cells":
            if args.cpu:
                cells = [c for c in cells if not is_gpu_cell(c)]
            if args.gpu_only:
                cells = [c for c in cells if is_gpu_cell(c)]
            if not cells:
                raise MatrixError("no cell matches")
            print("\n".join(c["id"] for c in cells))
            return 0
        if args.kind == "build-args":
            if len(cells) != 1:
                raise MatrixError("build-args needs exactly one cell (--cells ID)")
            text = "\n".join(f"{k}={v}" for k, v in build_args(cells[0], args.dockerfile).items())
            if args.github_output:
                _write_output(args.github_output, text, multiline=True)
            print(text)
            return 0
        if args.kind == "gpu":
            gpus = [g for g in re.split(r"[,\s]+", args.gpus) if g] or None
            out = gpu_matrix(cells, gpus, scale_sets=args.scale_sets)
            if not out["include"]:
                raise MatrixError("the GPU matrix is empty (no GPU cell for the requested GPU classes)")
            if args.images_lock:
                try:
                    lock = json.loads(args.images_lock.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError) as exc:
                    raise MatrixError(f"cannot read images lock {args.images_lock}: {exc}") from exc
                attach_images(out, lock)
        else:
            out = images_matrix(cells)
    except MatrixError as exc:
        print(f"gh_matrix: error: {exc}", file=sys.stderr)
        return 2
    if args.github_output:
        try:
            _write_output(args.github_output, json.dumps(out, separators=(",", ":")))
        except MatrixError as exc:
            print(f"gh_matrix: error: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(out, indent=2))
    return 0


def _write_output(name: str, text: str, multiline: bool = False) -> None:
    target = os.environ.get("GITHUB_OUTPUT")
    if not target:
        raise MatrixError("--github-output needs $GITHUB_OUTPUT")
    with open(target, "a", encoding="utf-8") as fh:
        if multiline:
            fh.write(f"{name}<<NSA_EOF\n{text}\nNSA_EOF\n")
        else:
            fh.write(f"{name}={text}\n")


if __name__ == "__main__":
    sys.exit(main())
