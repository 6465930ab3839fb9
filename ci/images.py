"""Docker images from requirements/matrix.toml: the build plan, the builds, and the checks of a built image.

    python -m ci.images plan [CELL ...] [--json]      # what would be built: tags, bases, flash-attn, size
    python -m ci.images build [CELL ...]              # build (all cells without CELL); BuildKit
           [--offline] [--registry R] [--name N] [--build-base IMG] [--runtime-base IMG] [--max-jobs N]
           [--without-flash-attn] [--push] [--dry-run]
    python -m ci.images wheelhouse CELL [--dest DIR]  # download the lock's wheels for an offline build
    python -m ci.images check-labels CELL --inspect FILE   # `docker image inspect` JSON vs the plan
    (`nox -s images -- --plan`, `nox -s images -- CELL`, `nox -s images -- --ci` call these.)

make_plan() is the one source of a cell's build arguments: `nox -s images` builds with them and the
images workflow passes the same (`python -m ci.github build-args`). Tags: `<registry>/<name>:<cell>` and
`<registry>/<name>:<cell>-<git sha>` (12 hex digits). Labels: OCI source, revision, created (the commit's
date, so that a rebuild of the same commit is identical), cell, sha256 of the lock, and the torch / CUDA /
triton / flash-attn versions. The docker client is $NSA_DOCKER (default `docker`); BuildKit is on.
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
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ci.locks import LockError, download_wheels, flash_lock_path, lock_path, parse_lock
from ci.matrix import Cell, Matrix, MatrixError, load

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
WHEELHOUSE = ROOT / "docker" / "wheelhouse"
DEFAULT_REGISTRY = os.environ.get("NSA_IMAGE_REGISTRY", "ghcr.io/nsa-project")
DEFAULT_NAME = os.environ.get("NSA_IMAGE_NAME", "nsa")
CPU_SIZE_LIMIT = 1_500_000_000  # bytes: the CPU runtime image must stay at or below 1.5 GB

# Removed from CPU images (Dockerfile ARG PRUNE, relative to site-packages): Triton's CUDA toolchain and AMD
# libraries (the interpreter, TRITON_INTERPRET=1, uses neither) and torch's C++ test binaries: ~290 MB.
CPU_PRUNE = ("triton/backends/nvidia/bin", "triton/backends/nvidia/lib", "triton/backends/amd/lib", "torch/test")

# Expected uncompressed image sizes (GB), for the plan and the workflow's size guard: the runtime base plus
# the venv (torch with the nvidia-* CUDA libraries it pulls from PyPI, triton, flash-attn) plus, on GPU
# images, gcc and the Python headers Triton compiles its launcher with. The CPU figure and the CUDA 13
# venv are measured in CI (docs/images.md); the cudnn-runtime base figure is an estimate.
BASE_SIZE_GB = {"cudnn-runtime": 3.6, "cudnn8-runtime": 3.6, "runtime": 2.7, "base": 0.25, "os": 0.05}
VENV_SIZE_GB = {"cpu": 1.25, "12": 5.6, "13": 4.8}
FLASH_ATTN_SIZE_GB = 0.8
TOOLCHAIN_SIZE_GB = 0.3


class ImageError(RuntimeError):
    """A plan that cannot be made or a built image that does not match its plan."""


@dataclass(frozen=True)
class ImagePlan:
    cell: str
    cpu_only: bool
    flash_attn_pinned: str  # how the flash-attn bits are pinned
    lock: str  # path relative to the repository
    lock_sha256: str  # "" when the lock is missing
    tags: tuple[str, ...]
    expected_size_gb: float
    min_driver: str  # "" for CPU
    build_args: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    # What the build installs, as its build arguments say.
    python = property(lambda self: self.build_args["PYTHON"])
    python_source = property(lambda self: self.build_args["PYTHON_SOURCE"])  # system | deadsnakes
    build_base = property(lambda self: self.build_args["BUILD_BASE"])
    runtime_base = property(lambda self: self.build_args["RUNTIME_BASE"])
    torch = property(lambda self: self.build_args["TORCH_VERSION"])
    cuda = property(lambda self: self.build_args["CUDA_VERSION"])  # "none" for CPU
    triton = property(lambda self: self.build_args["TRITON_VERSION"])
    flash_attn_source = property(lambda self: self.build_args["FLASH_ATTN_SOURCE"])  # none | wheel | source
    flash_attn_version = property(lambda self: self.build_args["FLASH_ATTN_VERSION"])  # "none" without it
    gpu_archs = property(lambda self: tuple(filter(None, self.build_args.get("GPU_ARCHS", "").split(";"))))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- inputs ------------------------------------------------------------------------------------------


def git(*args: str, root: Path = ROOT) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    except OSError:
        return None
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None


def revision(root: Path = ROOT) -> str:
    """The commit's full sha; NSA_REVISION or GITHUB_SHA win; 'unknown' outside a repository with commits."""
    env = os.environ
    return env.get("NSA_REVISION") or env.get("GITHUB_SHA") or git("rev-parse", "HEAD", root=root) or "unknown"


def created(root: Path = ROOT) -> str:
    """RFC 3339 date for the created label: SOURCE_DATE_EPOCH, else the commit's date, else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH") or git("log", "-1", "--format=%ct", root=root)
    when = dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc) if epoch else dt.datetime.now(dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def source_url() -> str:
    """The repository URL for the source label: NSA_SOURCE_URL, else GitHub's own variables, else ours."""
    if os.environ.get("NSA_SOURCE_URL"):
        return os.environ["NSA_SOURCE_URL"]
    if os.environ.get("GITHUB_REPOSITORY"):
        return f"{os.environ.get('GITHUB_SERVER_URL', 'https://github.com')}/{os.environ['GITHUB_REPOSITORY']}"
    return "https://github.com/nsa-project/nsa"


# --- the plan ----------------------------------------------------------------------------------------


def python_source(build_base: str) -> str:
    """deadsnakes for Ubuntu bases (CUDA images included), else the base's own python3.X."""
    return "deadsnakes" if build_base.startswith(("nvidia/cuda", "ubuntu")) else "system"


def _flavor(image: str) -> str:
    tag = image.rsplit(":", 1)[-1]
    for flavor in ("cudnn8-runtime", "cudnn-runtime", "runtime", "base"):
        if f"-{flavor}-" in f"-{tag}-":
            return flavor
    return "os"


def expected_size_gb(cell: Cell, runtime_base: str, flash: bool) -> float:
    if cell.cpu_only:
        return round(0.15 + VENV_SIZE_GB["cpu"], 2)
    size = BASE_SIZE_GB[_flavor(runtime_base)] + VENV_SIZE_GB.get(cell.cuda.split(".")[0], 6.0) + TOOLCHAIN_SIZE_GB
    return round(size + (FLASH_ATTN_SIZE_GB if flash else 0.0), 1)


def make_plan(
    matrix: Matrix,
    cell: Cell,
    *,
    root: Path = ROOT,
    registry: str = DEFAULT_REGISTRY,
    name: str = DEFAULT_NAME,
    rev: str | None = None,
    date: str | None = None,
    build_base: str | None = None,
    runtime_base: str | None = None,
    offline: bool = False,
    max_jobs: int = 4,
    flash_attn: bool = True,
) -> ImagePlan:
    """The build of one cell: its build arguments (the only place they are made), tags, labels, size."""
    rev = rev or revision(root)
    date = date or created(root)
    build_base = build_base or cell.base_image
    runtime_base = runtime_base or cell.runtime_image
    lock = lock_path(matrix, cell.id)
    lock = root / lock.relative_to(matrix.path.parent.parent)
    lock_sha = hashlib.sha256(lock.read_bytes()).hexdigest() if lock.is_file() else ""
    locked = parse_lock(lock.read_text()) if lock.is_file() else {}
    fa = cell.flash_attn
    fa_source = fa.source if flash_attn else "none"
    fa_version = fa.version if fa_source != "none" else "none"
    args: dict[str, str] = {
        "CELL": cell.id,
        "PYTHON": cell.python,
        "PYTHON_SOURCE": python_source(build_base),
        "BUILD_BASE": build_base,
        "RUNTIME_BASE": runtime_base,
        "LOCK_SHA256": lock_sha,
        "OFFLINE": "1" if offline else "0",
        "TORCH_INDEX_URL": matrix.index_url(cell),
        "TORCH_VERSION": locked["torch"].version if "torch" in locked else cell.torch,
        "CUDA_VERSION": cell.cuda,
        "TRITON_VERSION": locked["triton"].version if "triton" in locked else cell.triton,
        "FLASH_ATTN_SOURCE": fa_source,
        "FLASH_ATTN_VERSION": fa_version,
        "SOURCE_URL": source_url(),
        "REVISION": rev,
        "CREATED": date,
        "IMAGE_VERSION": f"{cell.id}-{rev[:12]}",
    }
    if cell.cpu_only:
        args["PRUNE"] = " ".join(CPU_PRUNE)
    else:
        args["GPU_ARCHS"] = args["TORCH_CUDA_ARCH_LIST"] = ";".join(sorted(cell.gpu_archs, key=float))
    if not flash_attn:
        pinned = "left out of this build (--without-flash-attn)"
    elif fa_source == "none":
        pinned = matrix.flash_none_reason(cell)
    else:
        pin = flash_lock_path(matrix, cell.id).name
        if fa_source == "wheel":
            pinned = f"upstream wheel by URL and sha256 ({pin})"
        else:
            sdist = matrix.flash_sdist_sha256(fa.version)
            args["MAX_JOBS"] = str(max_jobs)
            pinned = f"compiled in the image from flash_attn-{fa.version}.tar.gz (sha256 {sdist[:12]}..., {pin})"
    labels = {
        "org.opencontainers.image.source": args["SOURCE_URL"],
        "org.opencontainers.image.revision": rev,
        "org.opencontainers.image.created": date,
        "org.opencontainers.image.version": args["IMAGE_VERSION"],
        "nsa.cell": cell.id,
        "nsa.lock.sha256": lock_sha,
        "nsa.python": cell.python,
        "nsa.torch": args["TORCH_VERSION"],
        "nsa.cuda": cell.cuda,
        "nsa.triton": args["TRITON_VERSION"],
        "nsa.flash-attn": fa_version,
        "nsa.flash-attn.source": fa_source,
    }
    min_drv = ""
    if not cell.cpu_only:
        ga, floor = matrix.min_driver(cell.cuda)
        min_drv = f"{ga} (CUDA {cell.cuda}; {floor} with minor-version compatibility)"
    short = rev[:12] if re.fullmatch(r"[0-9a-f]{12,40}", rev) else rev
    return ImagePlan(
        cell=cell.id,
        cpu_only=cell.cpu_only,
        flash_attn_pinned=pinned,
        lock=str(lock.relative_to(root)),
        lock_sha256=lock_sha,
        tags=(f"{registry}/{name}:{cell.id}", f"{registry}/{name}:{cell.id}-{short}"),
        expected_size_gb=expected_size_gb(cell, runtime_base, fa_source != "none"),
        min_driver=min_drv,
        build_args=args,
        labels=labels,
    )


def make_plans(cell_ids: list[str] | None = None, **kw: Any) -> list[ImagePlan]:
    try:
        matrix = load()
        cells = [matrix.get(c) for c in cell_ids] if cell_ids else matrix.cells
    except (MatrixError, KeyError) as exc:
        raise ImageError(str(exc.args[0] if isinstance(exc, KeyError) else exc)) from None
    return [make_plan(matrix, c, **kw) for c in cells]


def format_plan(plans: list[ImagePlan]) -> str:
    lines = []
    for p in plans:
        lines += [
            f"{p.cell}",
            f"  tags          {'  '.join(p.tags)}",
            f"  build base    {p.build_base}   (python {p.python}: {p.python_source})",
            f"  runtime base  {p.runtime_base}",
            f"  torch {p.torch}  cuda {p.cuda}  triton {p.triton}  gpu archs {','.join(p.gpu_archs) or '-'}"
            + (f"  index {p.build_args['TORCH_INDEX_URL']}" if p.build_args["TORCH_INDEX_URL"] else ""),
            f"  flash-attn    {p.flash_attn_version} ({p.flash_attn_source}): {p.flash_attn_pinned}",
            f"  lock          {p.lock}  sha256 {p.lock_sha256 or 'MISSING (run nox -s lock -- ' + p.cell + ')'}",
            f"  size          ~{p.expected_size_gb} GB expected"
            + ("  (limit 1.5 GB)" if p.cpu_only else "")
            + (f"   min NVIDIA driver {p.min_driver}" if p.min_driver else ""),
        ]
    return "\n".join(lines)


# --- building ----------------------------------------------------------------------------------------


def docker_cmd() -> list[str]:
    return shlex.split(os.environ.get("NSA_DOCKER", "docker"))


def build_command(plan: ImagePlan, *, offline: bool, extra_tags: list[str] | None = None) -> list[str]:
    if not plan.lock_sha256:
        raise ImageError(f"cell {plan.cell}: no lock at {plan.lock} (run `nox -s lock -- {plan.cell}`)")
    # BuildKit of the docker.io daemon accepts only host or none; offline builds prove it with none.
    cmd = [*docker_cmd(), "build", "--progress", "plain", "-f", str(DOCKERFILE.relative_to(ROOT)),
           "--target", "runtime", "--network", "none" if offline else "host"]
    for key, value in plan.build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    for tag in [*plan.tags, *(extra_tags or [])]:
        cmd += ["-t", tag]
    return [*cmd, "."]


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    print("+ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "1"}, **kw)


def wheelhouse(matrix: Matrix, plan: ImagePlan, dest: Path, only: set[str] | None = None) -> list[Path]:
    """Download every wheel of the lock (hash-checked, for the cell's Python and platform, from the cell's
    package index and pip's configured ones) and flash-attn's wheel or source package into dest; with
    `only`, just those packages of the lock."""
    dest.mkdir(parents=True, exist_ok=True)
    index = ["--extra-index-url", plan.build_args["TORCH_INDEX_URL"]] if plan.build_args["TORCH_INDEX_URL"] else []
    download_wheels(matrix, matrix.get(plan.cell), dest, index, only)
    if only is not None:
        return sorted(dest.glob("*.whl"))
    if plan.flash_attn_source == "wheel":
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--progress-bar", "off", "--require-hashes",
             "--only-binary=:all:", "--python-version", plan.python.replace(".", ""), "--platform", "linux_x86_64",
             "-d", str(dest), "-r", str(flash_lock_path(matrix, plan.cell))])
    if plan.flash_attn_source == "source":
        fetch_sdist("flash-attn", plan.flash_attn_version, matrix.flash_sdist_sha256(plan.flash_attn_version), dest)
    return sorted(dest.glob("*.whl"))


def fetch_sdist(name: str, version: str, sha256: str, dest: Path) -> Path:
    """A source package from the package index (PEP 691 JSON), checked against its sha256. Not through
    `pip download`, which would build the package's metadata, and flash-attn's needs torch to do that."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    wanted = f"{name.replace('-', '_')}-{version}.tar.gz"
    url = next((f["url"] for f in files if f["filename"] == wanted), None)
    if url is None:
        raise ImageError(f"{index}/{name}/ has no {wanted}")
    with urllib.request.urlopen(url, timeout=600) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ImageError(f"{wanted}: sha256 {hashlib.sha256(data).hexdigest()} is not the pinned {sha256}")
    (dest / wanted).write_bytes(data)
    return dest / wanted


def image_size(tag: str) -> int:
    return int(run([*docker_cmd(), "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True).stdout)


def build(plans: list[ImagePlan], *, offline: bool, push: bool, dry_run: bool) -> None:
    for i, plan in enumerate(plans, 1):
        cmd = build_command(plan, offline=offline)
        print(f"[{i}/{len(plans)}] building {plan.tags[0]} (offline={offline})", flush=True)
        if dry_run:
            print(shlex.join(cmd))
            continue
        start = time.monotonic()
        run(cmd)
        size = image_size(plan.tags[0])
        print(
            f"[{i}/{len(plans)}] {plan.tags[0]}: {size / 1e9:.2f} GB in {time.monotonic() - start:.0f} s "
            f"(expected ~{plan.expected_size_gb} GB)",
            flush=True,
        )
        if plan.cpu_only and size > CPU_SIZE_LIMIT:
            raise ImageError(f"{plan.tags[0]} is {size / 1e9:.2f} GB, above the CPU limit of 1.5 GB")
        if push:
            for tag in plan.tags:
                run([*docker_cmd(), "push", tag])


# --- checks of a built image ----------------------------------------------------------------------------


def check_labels(plan: ImagePlan, labels: dict[str, str]) -> list[str]:
    """Differences between an image's labels and the plan's (revision/created only need to be present)."""
    problems = []
    for key, want in plan.labels.items():
        got = labels.get(key)
        if key in ("org.opencontainers.image.revision", "org.opencontainers.image.created",
                   "org.opencontainers.image.version"):
            if not got:
                problems.append(f"label {key} is missing or empty")
        elif got != want:
            problems.append(f"label {key}: image has {got!r}, plan wants {want!r}")
    if labels.get("org.opencontainers.image.created") and not re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", labels["org.opencontainers.image.created"]
    ):
        problems.append("label org.opencontainers.image.created is not an RFC 3339 UTC date")
    return problems


# --- command line ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.images", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=DEFAULT_REGISTRY, help="default $NSA_IMAGE_REGISTRY or %(default)s")
    common.add_argument("--name", default=DEFAULT_NAME)
    common.add_argument("--build-base", help="override the cell's base_image (e.g. nsa-base:noble)")
    common.add_argument("--runtime-base", help="override the cell's runtime_image")
    common.add_argument("--offline", action="store_true", help="install from docker/wheelhouse only")
    common.add_argument("--without-flash-attn", dest="flash_attn", action="store_false",
                        help="leave flash-attn out (FLASH_ATTN_SOURCE=none; the labels say so)")
    common.add_argument("--max-jobs", type=int, default=int(os.environ.get("MAX_JOBS", "4")),
                        help="parallel compile jobs for flash-attn from source (~4 GB of memory each)")
    p_plan = sub.add_parser("plan", parents=[common], help="print the build plan")
    p_plan.add_argument("cells", nargs="*")
    p_plan.add_argument("--json", action="store_true")
    p_build = sub.add_parser("build", parents=[common], help="build images (all cells without CELL)")
    p_build.add_argument("cells", nargs="*")
    p_build.add_argument("--push", action="store_true")
    p_build.add_argument("--dry-run", action="store_true", help="print the docker commands only")
    p_wh = sub.add_parser("wheelhouse", parents=[common], help="download a cell's wheels for --offline")
    p_wh.add_argument("cell")
    p_wh.add_argument("--dest", type=Path, default=WHEELHOUSE)
    p_wh.add_argument("--only", help="comma-separated packages of the lock (e.g. to bring a host to it)")
    p_lab = sub.add_parser("check-labels", parents=[common], help="compare an image's labels with the plan")
    p_lab.add_argument("cell")
    p_lab.add_argument("--inspect", type=Path, required=True, help="output of `docker image inspect IMAGE`")
    args = ap.parse_args(argv)
    kw = dict(registry=args.registry, name=args.name, build_base=args.build_base, runtime_base=args.runtime_base,
              offline=args.offline, max_jobs=args.max_jobs, flash_attn=args.flash_attn)
    try:
        if args.cmd == "plan":
            plans = make_plans(args.cells, **kw)
            print(json.dumps([p.to_json() for p in plans], indent=2) if args.json else format_plan(plans))
        elif args.cmd == "build":
            build(make_plans(args.cells, **kw), offline=args.offline, push=args.push, dry_run=args.dry_run)
        elif args.cmd == "wheelhouse":
            (plan,) = make_plans([args.cell], **kw)
            only = {n for n in args.only.split(",") if n} if args.only else None
            wheels = wheelhouse(load(), plan, args.dest, only)
            size = sum(w.stat().st_size for w in wheels)
            print(f"wheelhouse: {len(wheels)} wheels, {size / 1e6:.0f} MB in {args.dest}")
        else:
            (plan,) = make_plans([args.cell], **kw)
            inspect = json.loads(args.inspect.read_text())
            labels = (inspect[0] if isinstance(inspect, list) else inspect)["Config"]["Labels"] or {}
            problems = check_labels(plan, labels)
            for p in problems:
                print(f"ci.images: label mismatch: {p}", file=sys.stderr)
            if not problems:
                print(f"ci.images: labels: all {len(plan.labels)} match the plan (lock {plan.lock_sha256[:12]})")
            return 1 if problems else 0
    except (ImageError, LockError, OSError, subprocess.CalledProcessError, json.JSONDecodeError, KeyError) as exc:
        print(f"ci.images: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
