"""Docker images from requirements/matrix.toml: `python -m ci.images plan|bake|build|repo [CELL ...]` (--help).

make_plan() is the one source of a cell's build arguments: `nox -s images` builds with them, the images
workflow bakes them (docs/images.md). Image repository: image_repo(). Local tags <repo>:<cell> and
<repo>:<cell>-<12 hex of the commit>. The docker client is $NSA_DOCKER (default `docker`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ci.locks import LockError, flash_lock_path, lock_path, parse_lock
from ci.matrix import Cell, Matrix, MatrixError, load

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "docker/Dockerfile"
REPOSITORY = "nsa-project/nsa"  # this project on GitHub: the default source label and image repository
# Removed from CPU images (Dockerfile ARG PRUNE, relative to site-packages): Triton's CUDA toolchain and AMD
# libraries (the interpreter, TRITON_INTERPRET=1, uses neither) and torch's C++ test binaries: ~290 MB.
CPU_PRUNE = ("triton/backends/nvidia/bin", "triton/backends/nvidia/lib", "triton/backends/amd/lib", "torch/test")


class ImageError(RuntimeError):
    """A plan or a build that cannot be made."""


@dataclass(frozen=True)
class ImagePlan:
    cell: str
    cpu_only: bool
    flash_attn_pinned: str  # how the flash-attn bits are pinned
    lock: str  # path relative to the repository
    lock_sha256: str  # "" when the lock is missing
    tags: tuple[str, ...]
    min_driver: str  # "" for CPU
    build_args: dict[str, str]
    labels: dict[str, str]


def image_repo(environ=os.environ) -> str:
    """The one image repository: $NSA_IMAGE_REPO, else ghcr.io/<$GITHUB_REPOSITORY>, else ours; lower-cased
    because registries refuse upper-case repository names (GitHub owners may have them)."""
    return (environ.get("NSA_IMAGE_REPO") or f"ghcr.io/{environ.get('GITHUB_REPOSITORY') or REPOSITORY}").lower()


def git(*args: str, root: Path = ROOT) -> str:
    res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    return res.stdout.strip() if res.returncode == 0 else ""


def created(root: Path = ROOT) -> str:
    """The created label: SOURCE_DATE_EPOCH, else the commit's date (a rebuild of a commit is identical)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH") or git("log", "-1", "--format=%ct", root=root)
    when = dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc) if epoch else dt.datetime.now(dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def source_url(environ=os.environ) -> str:
    return f"{environ.get('GITHUB_SERVER_URL', 'https://github.com')}/{environ.get('GITHUB_REPOSITORY') or REPOSITORY}"


def make_plan(matrix: Matrix, cell: Cell, *, root: Path = ROOT, repo: str | None = None, rev: str | None = None,
              date: str | None = None, build_base: str | None = None, runtime_base: str | None = None,
              offline: bool = False, max_jobs: int = 4, flash_attn: bool = True) -> ImagePlan:
    """The build of one cell: its build arguments (the only place they are made), tags, labels, size."""
    rev = rev or os.environ.get("GITHUB_SHA") or git("rev-parse", "HEAD", root=root) or "unknown"
    date, repo = date or created(root), repo or image_repo()
    build_base, runtime_base = build_base or cell.base_image, runtime_base or cell.runtime_image
    lock = root / lock_path(matrix, cell.id).relative_to(matrix.path.parent.parent)
    lock_sha = hashlib.sha256(lock.read_bytes()).hexdigest() if lock.is_file() else ""
    locked = parse_lock(lock.read_text()) if lock.is_file() else {}
    fa_source = cell.flash_attn.source if flash_attn else "none"
    fa_version = cell.flash_attn.version if fa_source != "none" else "none"
    args = {
        # Python from deadsnakes on Ubuntu bases (CUDA's included), else the base's own python3.X
        "CELL": cell.id, "PYTHON": cell.python,
        "PYTHON_SOURCE": "deadsnakes" if build_base.startswith(("nvidia/cuda", "ubuntu")) else "system",
        "BUILD_BASE": build_base, "RUNTIME_BASE": runtime_base, "LOCK_SHA256": lock_sha,
        "OFFLINE": "1" if offline else "0", "TORCH_INDEX_URL": matrix.index_url(cell),
        "TORCH_VERSION": locked["torch"].version if "torch" in locked else cell.torch, "CUDA_VERSION": cell.cuda,
        "TRITON_VERSION": locked["triton"].version if "triton" in locked else cell.triton,
        "FLASH_ATTN_SOURCE": fa_source, "FLASH_ATTN_VERSION": fa_version, "SOURCE_URL": source_url(),
        "REVISION": rev, "CREATED": date, "IMAGE_VERSION": f"{cell.id}-{rev[:12]}",
        **({"PRUNE": " ".join(CPU_PRUNE)} if cell.cpu_only else
           dict.fromkeys(("GPU_ARCHS", "TORCH_CUDA_ARCH_LIST"), ";".join(sorted(cell.gpu_archs, key=float)))),
        **({"MAX_JOBS": str(max_jobs)} if fa_source == "source" else {}),
    }
    pin = flash_lock_path(matrix, cell.id).name
    pinned = ("left out of this build (--without-flash-attn)" if not flash_attn else matrix.flash_none_reason(cell)
              if fa_source == "none" else f"upstream wheel by URL and sha256 ({pin})" if fa_source == "wheel" else
              f"compiled in the image from flash_attn-{fa_version}.tar.gz (sha256 "
              f"{matrix.flash_sdist_sha256(fa_version)[:12]}..., {pin})")
    labels = {"org.opencontainers.image.source": args["SOURCE_URL"], "org.opencontainers.image.revision": rev,
        "org.opencontainers.image.created": date, "org.opencontainers.image.version": args["IMAGE_VERSION"],
        "nsa.cell": cell.id, "nsa.lock.sha256": lock_sha, "nsa.python": cell.python,
        "nsa.torch": args["TORCH_VERSION"], "nsa.cuda": cell.cuda, "nsa.triton": args["TRITON_VERSION"],
        "nsa.flash-attn": fa_version, "nsa.flash-attn.source": fa_source,
    }
    ga, floor = ("", "") if cell.cpu_only else matrix.min_driver(cell.cuda)
    min_drv = f"{ga} (CUDA {cell.cuda}; {floor} with minor-version compatibility)" if ga else ""
    short = rev[:12] if re.fullmatch(r"[0-9a-f]{12,40}", rev) else rev
    return ImagePlan(cell.id, cell.cpu_only, pinned, str(lock.relative_to(root)), lock_sha,
                     (f"{repo}:{cell.id}", f"{repo}:{cell.id}-{short}"), min_drv, args, labels)


def format_plan(plans: list[ImagePlan]) -> str:
    return "\n".join(f"{p.cell}\n  tags        {'  '.join(p.tags)}\n  lock        {p.lock}  sha256 "
                     f"{p.lock_sha256 or 'MISSING (run nox -s lock -- ' + p.cell + ')'}\n  flash-attn  "
                     f"{p.flash_attn_pinned}\n  min driver  {p.min_driver or 'none (CPU)'}\n"
                     + "".join(f"  {k:<20} {v}\n" for k, v in p.build_args.items() if k not in ("CELL", "LOCK_SHA256"))
                     for p in plans)


def bake_target(cell: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", cell)  # bake target names allow no dots


def bake_file(plans: list[ImagePlan]) -> dict[str, Any]:
    """A `docker buildx bake` definition (JSON) with one target per plan, group `default` holding them all:
    the plan's build arguments and nothing else. No tags: the images workflow pushes by digest and moves
    tags itself after the image's checks."""
    targets = {bake_target(p.cell): {"context": ".", "dockerfile": DOCKERFILE, "target": "runtime",
                                     "args": p.build_args} for p in plans}
    return {"group": {"default": {"targets": list(targets)}}, "target": targets}


def build_command(plan: ImagePlan, *, offline: bool) -> list[str]:
    if not plan.lock_sha256:
        raise ImageError(f"cell {plan.cell}: no lock at {plan.lock} (run `nox -s lock -- {plan.cell}`)")
    # `docker build`, not bake: Debian's docker.io client (CI's image checks) has BuildKit but no buildx.
    # Its BuildKit accepts only the host or no network; offline builds prove themselves with none.
    return [*shlex.split(os.environ.get("NSA_DOCKER", "docker")), "build", "--progress", "plain", "-f", DOCKERFILE,
            "--target", "runtime", "--network", "none" if offline else "host",
            *(x for k, v in plan.build_args.items() for x in ("--build-arg", f"{k}={v}")),
            *(x for t in plan.tags for x in ("-t", t)), "."]


def run(cmd: list[str]) -> None:
    print("+ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})


def build(plans: list[ImagePlan], *, offline: bool, dry_run: bool) -> None:
    for i, plan in enumerate(plans, 1):
        print(f"[{i}/{len(plans)}] building {plan.tags[0]} (offline={offline})", flush=True)
        cmd = build_command(plan, offline=offline)
        if dry_run:
            print(shlex.join(cmd))
        else:
            run(cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.images", description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["plan", "bake", "build", "repo"])
    ap.add_argument("cells", nargs="*", help="cell ids (default: every cell)")
    ap.add_argument("--repo", help=f"image repository (default {image_repo()})")
    ap.add_argument("--build-base", help="override the cell's base_image (e.g. nsa-base:noble)")
    ap.add_argument("--runtime-base", help="override the cell's runtime_image")
    ap.add_argument("--offline", action="store_true", help="install from docker/wheelhouse (docker/wheelhouse.py)")
    ap.add_argument("--without-flash-attn", dest="flash_attn", action="store_false",
                    help="leave flash-attn out (FLASH_ATTN_SOURCE=none; the labels say so)")
    ap.add_argument("--max-jobs", type=int, default=int(os.environ.get("MAX_JOBS", "4")),
                    help="parallel compile jobs for flash-attn from source (~4 GB of memory each)")
    ap.add_argument("--json", action="store_true", help="plan: as JSON")
    ap.add_argument("--dry-run", action="store_true", help="build: print the docker commands only")
    args = ap.parse_args(argv)
    kw = dict(repo=args.repo, build_base=args.build_base, runtime_base=args.runtime_base, offline=args.offline,
              max_jobs=args.max_jobs, flash_attn=args.flash_attn)
    try:
        if args.cmd == "repo":
            print(args.repo or image_repo())
            return 0
        matrix = load()
        plans = [make_plan(matrix, c, **kw) for c in ([matrix.get(c) for c in args.cells] or matrix.cells)]
        if args.cmd == "build":
            build(plans, offline=args.offline, dry_run=args.dry_run)
        else:
            print(json.dumps(bake_file(plans), indent=2) if args.cmd == "bake" else
                  json.dumps([asdict(p) for p in plans], indent=2) if args.json else format_plan(plans))
    except (ImageError, LockError, MatrixError, OSError, subprocess.CalledProcessError, KeyError) as exc:
        print(f"ci.images: error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
