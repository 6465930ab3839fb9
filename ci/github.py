"""GitHub Actions inputs from requirements/matrix.toml: the one emitter of the workflows' matrices.

    python -m ci.github gpu [--cells A,B] [--gpus a100,h100] [--images-lock images.lock.json]
    python -m ci.github images [--cells A,B]          # every cell's image build
    python -m ci.github cells [--cpu | --gpu-only]    # cell ids, one per line
    python -m ci.github build-args --cell ID [--without-flash-attn]   # KEY=VALUE: ci.images.make_plan's
    ... --github-output NAME   appends NAME=<value> to $GITHUB_OUTPUT as well

The GPU matrix pairs each GPU cell with the GPU classes whose compute capability the cell was built for
(`gpu_archs`), and carries the minimum NVIDIA driver for the cell's CUDA version and the runner label
(`cuda12`, `cuda13`) a host must carry to run it (docs/runners.md explains the labels).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ci import images
from ci.matrix import Cell, Matrix, MatrixError, load

# GPU class (runner label) -> compute capability it needs kernels for.
GPU_CLASSES: dict[str, str] = {"a100": "8.0", "h100": "9.0"}


def runs_on(gpu: str, cuda_label: str, scale_sets: bool = False) -> list[str]:
    """The runner labels a GPU job asks for (docs/runners.md). Actions Runner Controller scale sets are
    addressed by their name alone, so with scale_sets the job asks for the set `nsa-<gpu>-<cudaN>`."""
    if scale_sets:
        return [f"nsa-{gpu}-{cuda_label}"]
    return ["self-hosted", "linux", "x64", "gpu", gpu, cuda_label]


def gpu_matrix(matrix: Matrix, cells: list[Cell], gpus: list[str] | None = None, scale_sets: bool = False) -> dict:
    gpus = gpus or list(GPU_CLASSES)
    unknown = [g for g in gpus if g not in GPU_CLASSES]
    if unknown:
        raise MatrixError("--gpus", [f"unknown GPU class(es) {unknown}; known: {sorted(GPU_CLASSES)}"])
    include = []
    for cell in (c for c in cells if not c.cpu_only):
        ga, floor = matrix.min_driver(cell.cuda)
        label = f"cuda{cell.cuda.split('.')[0]}"
        for gpu in gpus:
            if GPU_CLASSES[gpu] in cell.gpu_archs:
                include.append({"cell": cell.id, "gpu": gpu, "python": cell.python, "torch": cell.torch,
                                "triton": cell.triton, "cuda": cell.cuda, "cuda_label": label,
                                "runs_on": runs_on(gpu, label, scale_sets), "min_driver": ga,
                                "min_driver_compat": floor})
    return {"include": include}


def images_matrix(cells: list[Cell]) -> dict:
    return {"include": [{"cell": c.id, "python": c.python, "cpu_only": c.cpu_only} for c in cells]}


def build_args(matrix: Matrix, cell: Cell, flash_attn: bool = True) -> dict[str, str]:
    """What images.yml passes to `docker build`: exactly the plan's build arguments (ci.images.make_plan)."""
    return images.make_plan(matrix, cell, flash_attn=flash_attn).build_args


def attach_images(gpu: dict, lock: dict[str, Any]) -> None:
    """Give each GPU matrix entry the image pinned by digest in an images lock (images.yml's format:
    {cell: {"image": "ghcr.io/<owner>/nsa", "digest": "sha256:..."}}); a missing cell is an error."""
    missing = []
    for entry in gpu["include"]:
        rec = lock.get(entry["cell"])
        digest = rec.get("digest", "") if isinstance(rec, dict) else ""
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or not rec.get("image"):
            missing.append(entry["cell"])
            continue
        entry["image"] = f"{rec['image']}@{digest}"
    if missing:
        raise MatrixError("images lock", [f"no valid digest for cell(s) {sorted(set(missing))}"])


def _write_output(name: str, text: str) -> None:
    target = os.environ.get("GITHUB_OUTPUT")
    if not target:
        raise MatrixError("--github-output", ["needs $GITHUB_OUTPUT"])
    with open(target, "a", encoding="utf-8") as fh:
        fh.write(f"{name}<<NSA_EOF\n{text}\nNSA_EOF\n" if "\n" in text else f"{name}={text}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.github", description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["gpu", "images", "cells", "build-args"])
    ap.add_argument("--cells", "--cell", dest="cells", default="", help="comma-separated cell ids (default: all)")
    ap.add_argument("--gpus", default="", help=f"GPU classes (default: {','.join(GPU_CLASSES)})")
    ap.add_argument("--cpu", action="store_true", help="cells: only CPU cells")
    ap.add_argument("--gpu-only", action="store_true", help="cells: only GPU cells")
    ap.add_argument("--without-flash-attn", dest="flash_attn", action="store_false", help="build-args")
    ap.add_argument("--images-lock", type=Path, help="gpu: pin each entry's image by digest from this lock")
    ap.add_argument("--scale-sets", action="store_true",
                    default=os.environ.get("NSA_RUNNER_SCALE_SETS", "") in ("1", "true"),
                    help="gpu: target Actions Runner Controller scale sets by name (default: $NSA_RUNNER_SCALE_SETS)")
    ap.add_argument("--github-output", metavar="NAME", help="append NAME=<value> to $GITHUB_OUTPUT")
    args = ap.parse_args(argv)
    try:
        matrix = load()
        wanted = [c for c in re.split(r"[,\s]+", args.cells) if c]
        cells = [matrix.get(c) for c in wanted] if wanted else matrix.cells
        if args.kind == "cells":
            cells = [c for c in cells if not (args.cpu and not c.cpu_only) and not (args.gpu_only and c.cpu_only)]
            text = "\n".join(c.id for c in cells)
        elif args.kind == "build-args":
            if len(cells) != 1:
                raise MatrixError("--cell", ["build-args needs exactly one cell"])
            text = "\n".join(f"{k}={v}" for k, v in build_args(matrix, cells[0], args.flash_attn).items())
        elif args.kind == "images":
            text = json.dumps(images_matrix(cells), separators=(",", ":"))
        else:
            out = gpu_matrix(matrix, cells, [g for g in re.split(r"[,\s]+", args.gpus) if g], args.scale_sets)
            if not out["include"]:
                raise MatrixError("gpu", ["the GPU matrix is empty (no GPU cell for the requested GPU classes)"])
            if args.images_lock:
                attach_images(out, json.loads(args.images_lock.read_text(encoding="utf-8")))
            text = json.dumps(out, separators=(",", ":"))
        if not text:
            raise MatrixError(args.kind, ["no cell matches"])
        if args.github_output:
            _write_output(args.github_output, text)
    except (MatrixError, KeyError, OSError, json.JSONDecodeError, images.ImageError) as exc:
        print(f"ci.github: error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
