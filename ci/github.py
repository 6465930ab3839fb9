"""The GPU workflow's matrix from requirements/matrix.toml (the images workflow's is the image plan's cells).

    python -m ci.github gpu [--cells A,B] [--gpus a100,h100] [--images-lock images.lock.json]   # JSON, one line

The GPU matrix pairs each GPU cell with the GPU classes whose compute capability the cell was built for
(`gpu_archs`), with the minimum NVIDIA driver for the cell's CUDA and the runner label (`cuda12`, `cuda13`)
a host must carry to run it (docs/runners.md), and, from an images lock, the image and digest to run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ci.matrix import Cell, Matrix, MatrixError, load

GPU_CLASSES: dict[str, str] = {"a100": "8.0", "h100": "9.0"}  # runner label -> compute capability


def runs_on(gpu: str, cuda_label: str, scale_sets: bool = False) -> list[str]:
    """The runner labels a GPU job asks for (docs/runners.md). Actions Runner Controller scale sets are
    addressed by their name alone, so with scale_sets the job asks for the set `nsa-<gpu>-<cudaN>`."""
    return [f"nsa-{gpu}-{cuda_label}"] if scale_sets else ["self-hosted", "linux", "x64", "gpu", gpu, cuda_label]


def gpu_matrix(matrix: Matrix, cells: list[Cell], gpus: list[str] | None = None, scale_sets: bool = False) -> dict:
    gpus = gpus or list(GPU_CLASSES)
    if unknown := [g for g in gpus if g not in GPU_CLASSES]:
        raise MatrixError("--gpus", [f"unknown GPU class(es) {unknown}; known: {sorted(GPU_CLASSES)}"])
    include = []
    for cell in (c for c in cells if not c.cpu_only):
        (ga, floor), label = matrix.min_driver(cell.cuda), f"cuda{cell.cuda.split('.')[0]}"
        include += [{"cell": cell.id, "gpu": gpu, "python": cell.python, "torch": cell.torch, "triton": cell.triton,
                     "cuda": cell.cuda, "cuda_label": label, "runs_on": runs_on(gpu, label, scale_sets),
                     "min_driver": ga, "min_driver_compat": floor}
                    for gpu in gpus if GPU_CLASSES[gpu] in cell.gpu_archs]
    return {"include": include}


def attach_images(gpu: dict, lock: dict[str, Any]) -> None:
    """Give each GPU matrix entry its image repository and digest from an images lock (gpu.yml's plan writes
    {cell: {"image": "ghcr.io/<owner>/<repo>", "digest": "sha256:..."}}); a cell without both is an error."""
    missing = set()
    for entry in gpu["include"]:
        rec = lock.get(entry["cell"]) if isinstance(lock.get(entry["cell"]), dict) else {}
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(rec.get("digest"))) or not rec.get("image"):
            missing.add(entry["cell"])
        entry["image"], entry["digest"] = rec.get("image"), rec.get("digest")
    if missing:
        raise MatrixError("images lock", [f"no valid digest for cell(s) {sorted(missing)}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.github", description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["gpu"])
    ap.add_argument("--cells", "--cell", dest="cells", default="", help="comma-separated cell ids (default: all)")
    ap.add_argument("--gpus", default="", help=f"GPU classes (default: {','.join(GPU_CLASSES)})")
    ap.add_argument("--images-lock", type=Path, help="gpu: each entry's image and digest from this lock")
    ap.add_argument("--scale-sets", action="store_true",
                    default=os.environ.get("NSA_RUNNER_SCALE_SETS") in ("1", "true"),
                    help="gpu: target Actions Runner Controller scale sets by name (default: $NSA_RUNNER_SCALE_SETS)")
    args = ap.parse_args(argv)
    try:
        matrix = load()
        cells = [matrix.get(c) for c in re.split(r"[,\s]+", args.cells) if c] or matrix.cells
        out = gpu_matrix(matrix, cells, [g for g in re.split(r"[,\s]+", args.gpus) if g], args.scale_sets)
        if not out["include"]:
            raise MatrixError("gpu", ["the GPU matrix is empty (no GPU cell for the requested GPU classes)"])
        if args.images_lock:
            attach_images(out, json.loads(args.images_lock.read_text(encoding="utf-8")))
    except (MatrixError, KeyError, OSError, json.JSONDecodeError) as exc:
        print(f"ci.github: error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
