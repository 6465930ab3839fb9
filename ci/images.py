"""Docker images from requirements/matrix.toml: the build plan, the builds, and the checks of a built image.

    python -m ci.images plan [CELL ...] [--json]      # what would be built: tags, bases, flash-attn, size
    python -m ci.images build [CELL ...]              # build (all cells without CELL); BuildKit
           [--offline] [--registry R] [--name N] [--build-base IMG] [--runtime-base IMG] [--max-jobs N]
           [--push] [--dry-run]
    python -m ci.images wheelhouse CELL [--dest DIR]  # download the lock's wheels for an offline build
    python -m ci.images check-labels CELL --inspect FILE   # `docker image inspect` JSON vs the plan
    python -m ci.images check-installed CELL --freeze FILE # `pip freeze --all` inside the image vs the lock
    (`nox -s images -- --plan`, `nox -s images -- CELL`, `nox -s images -- --ci` call these.)

Tags: `<registry>/<name>:<cell>` and `<registry>/<name>:<cell>-<git sha>` (12 hex digits). Labels: OCI
source, revision, created (the commit's date, so that a rebuild of the same commit is identical), cell,
sha256 of the lock, and the torch / CUDA / triton / flash-attn versions. The docker client is $NSA_DOCKER
(default `docker`); BuildKit is switched on with DOCKER_BUILDKIT=1.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
WHEELHOUSE = ROOT / "docker" / "wheelhouse"
DEFAULT_REGISTRY = os.environ.get("NSA_IMAGE_REGISTRY", "ghcr.io/nsa-project")
DEFAULT_NAME = os.environ.get("NSA_IMAGE_NAME", "nsa")
SOURCE_URL = os.environ.get("NSA_SOURCE_URL", "https://github.com/nsa-project/nsa")
CPU_SIZE_LIMIT = 1_500_000_000  # bytes: the CPU runtime image must stay at or below 1.5 GB (issue 5)

# sha256 of flash-attn's source package on PyPI, for cells that compile it (matrix source = "source").
# Read with pip's own hash check (`pip download --no-deps --require-hashes` against a wrong hash prints
# the real one). A matrix entry `[upstream.flash_attn."X".sdist_sha256]` takes precedence.
FLASH_ATTN_SDIST_SHA256: dict[str, str] = {
    "2.8.3": "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d",
}

# Removed from CPU images (Dockerfile ARG PRUNE, relative to site-packages): Triton's CUDA toolchain and AMD
# libraries (the interpreter, TRITON_INTERPRET=1, uses neither) and torch's C++ test binaries: ~290 MB.
CPU_PRUNE = ("triton/backends/nvidia/bin", "triton/backends/nvidia/lib", "triton/backends/amd/lib", "torch/test")

# Expected uncompressed image sizes (GB), for the plan and the workflow's size guard. The CPU figure is
# measured (docs/images.md); the GPU figures are estimates: the runtime base image plus the venv (torch
# and the nvidia-* CUDA libraries it pulls from PyPI, triton, flash-attn) plus the compiler Triton needs.
BASE_SIZE_GB = {"cudnn-runtime": 3.6, "cudnn8-runtime": 3.6, "runtime": 2.7, "base": 0.25}
VENV_SIZE_GB = {"cpu": 1.25, "12": 5.6, "13": 5.9}
FLASH_ATTN_SIZE_GB = 0.8
TOOLCHAIN_SIZE_GB = 0.35  # python from the archive or deadsnakes, gcc and headers for Triton


class ImageError(RuntimeError):
    """A plan that cannot be made or a built image that does not match its plan."""


@dataclass(frozen=True)
class ImagePlan:
    cell: str
    cpu_only: bool
    python: str
    python_source: str  # "system" (the base's python) or "deadsnakes" (Ubuntu bases)
    torch: str
    cuda: str  # "none" for CPU
    triton: str
    flash_attn_version: str  # "none" when the cell has none
    flash_attn_source: str  # none | wheel | source
    flash_attn_pinned: str  # how the flash-attn bits are pinned
    gpu_archs: tuple[str, ...]
    build_base: str
    runtime_base: str
    lock: str  # path relative to the repository
    lock_sha256: str  # "" when the lock is missing
    tags: tuple[str, ...]
    expected_size_gb: float
    min_driver: str  # "" for CPU
    build_args: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_archs"] = list(self.gpu_archs)
        d["tags"] = list(self.tags)
        return d


# --- inputs ------------------------------------------------------------------------------------------


def load_matrix(path: Path | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The validated cells (ci.matrix) and the matrix's upstream tables."""
    from ci import matrix as m  # noqa: PLC0415 - needs packaging; imported late so --help works anywhere

    path = path or m.DEFAULT_PATH
    try:
        loaded = m.load(path)
        cells = m.load_cells(path)
    except m.MatrixError as exc:
        raise ImageError(str(exc)) from exc
    return cells, loaded.upstream


def lock_path(cell_id: str, root: Path = ROOT) -> Path:
    return root / "requirements" / "locks" / f"{cell_id}.txt"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*(==|@)\s*([^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> dict[str, str]:
    """{canonical name: version} of a hash-pinned lock; URL requirements give the wheel file's version."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _REQ.match(line)
        if not m:
            continue
        name, op, value = canonical(m[1]), m[2], m[3]
        if op == "@":
            wheel = value.rsplit("/", 1)[-1].replace("%2B", "+").replace("%2b", "+")
            value = wheel.split("-")[1] if wheel.endswith(".whl") and "-" in wheel else value
        out[name] = value
    return out


def git(*args: str, root: Path = ROOT) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    except OSError:
        return None
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None


def revision(root: Path = ROOT) -> str:
    """The commit's full sha; NSA_REVISION or GITHUB_SHA win; 'unknown' outside a repository with commits."""
    return (
        os.environ.get("NSA_REVISION")
        or os.environ.get("GITHUB_SHA")
        or git("rev-parse", "HEAD", root=root)
        or ("unknown")
    )


def created(root: Path = ROOT) -> str:
    """RFC 3339 date for the created label: SOURCE_DATE_EPOCH, else the commit's date, else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH") or git("log", "-1", "--format=%ct", root=root)
    when = dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc) if epoch else dt.datetime.now(dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the plan ----------------------------------------------------------------------------------------


def python_source(cell: dict[str, Any], build_base: str) -> str:
    explicit = cell.get("python_source")
    if explicit:
        return str(explicit)
    return "deadsnakes" if build_base.startswith(("nvidia/cuda", "ubuntu")) else "system"


def _flavor(image: str) -> str:
    tag = image.rsplit(":", 1)[-1]
    for flavor in ("cudnn8-runtime", "cudnn-runtime", "runtime", "base"):
        if f"-{flavor}-" in f"-{tag}-":
            return flavor
    return "os"


def expected_size_gb(cell: dict[str, Any], runtime_base: str) -> float:
    if cell.get("cpu_only"):
        return round(0.15 + VENV_SIZE_GB["cpu"], 2)
    major = str(cell["cuda"]).split(".")[0]
    size = BASE_SIZE_GB.get(_flavor(runtime_base), 0.3) + VENV_SIZE_GB.get(major, 6.0) + TOOLCHAIN_SIZE_GB
    if (cell.get("flash_attn") or {}).get("source", "none") != "none":
        size += FLASH_ATTN_SIZE_GB
    return round(size, 1)


def torch_cuda_arch_list(archs: list[str]) -> str:
    return ";".join(sorted({str(a) for a in archs}, key=float))


def make_plan(
    cell: dict[str, Any],
    upstream: dict[str, Any] | None = None,
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
) -> ImagePlan:
    upstream = upstream or {}
    cid = cell["id"]
    rev = rev or revision(root)
    date = date or created(root)
    build_base = build_base or cell.get("base_image") or ""
    runtime_base = runtime_base or cell.get("runtime_image") or build_base
    if not build_base:
        raise ImageError(f"cell {cid}: no base_image in the matrix and none given (--build-base)")
    lock = lock_path(cid, root)
    lock_sha = file_sha256(lock) if lock.is_file() else ""
    locked = parse_lock(lock.read_text()) if lock.is_file() else {}
    cpu = bool(cell.get("cpu_only"))
    cuda = "none" if cpu else str(cell["cuda"])
    fa = cell.get("flash_attn") or {"source": "none"}
    fa_source = str(fa.get("source", "none"))
    fa_version = str(fa.get("version") or "none") if fa_source != "none" else "none"
    args: dict[str, str] = {
        "CELL": cid,
        "PYTHON": str(cell["python"]),
        "PYTHON_SOURCE": python_source(cell, build_base),
        "BUILD_BASE": build_base,
        "RUNTIME_BASE": runtime_base,
        "LOCK_SHA256": lock_sha,
        "OFFLINE": "1" if offline else "0",
        "TORCH_VERSION": locked.get("torch", str(cell["torch"])),
        "CUDA_VERSION": cuda,
        "TRITON_VERSION": locked.get("triton", str(cell.get("triton") or "none")),
        "FLASH_ATTN_SOURCE": fa_source,
        "FLASH_ATTN_VERSION": fa_version,
        "SOURCE_URL": SOURCE_URL,
        "REVISION": rev,
        "CREATED": date,
        "IMAGE_VERSION": f"{cid}-{rev[:12]}",
    }
    if cpu:
        args["PRUNE"] = " ".join(CPU_PRUNE)
    elif cell.get("gpu_archs"):
        args["GPU_ARCHS"] = torch_cuda_arch_list(list(cell["gpu_archs"]))
        args["TORCH_CUDA_ARCH_LIST"] = args["GPU_ARCHS"]
    if cpu and cell.get("torch_index") and not offline:
        args["PIP_EXTRA_INDEX_URL"] = str(cell["torch_index"])
    pinned = "none"
    if fa_source == "wheel":
        if "flash-attn" in locked:
            pinned = "wheel by URL and sha256 in the lock"
        else:
            args["FLASH_ATTN_WHEEL_URL"] = str(fa.get("url") or "")
            pinned = "wheel by URL only: sha256 not recorded in matrix.toml yet (the build prints it)"
            if not args["FLASH_ATTN_WHEEL_URL"]:
                raise ImageError(f"cell {cid}: flash-attn wheel has no URL (matrix upstream table)")
    elif fa_source == "source":
        sdist = str((upstream.get("flash_attn", {}).get(fa_version) or {}).get("sdist_sha256") or "")
        sdist = sdist or FLASH_ATTN_SDIST_SHA256.get(fa_version, "")
        if not sdist:
            raise ImageError(f"cell {cid}: no sha256 known for the flash-attn {fa_version} source package")
        args["FLASH_ATTN_SDIST_SHA256"] = sdist
        args["MAX_JOBS"] = str(max_jobs)
        pinned = f"compiled in the image from flash_attn-{fa_version}.tar.gz (sha256 {sdist[:12]}...)"
    labels = {
        "org.opencontainers.image.source": SOURCE_URL,
        "org.opencontainers.image.revision": rev,
        "org.opencontainers.image.created": date,
        "org.opencontainers.image.version": args["IMAGE_VERSION"],
        "nsa.cell": cid,
        "nsa.lock.sha256": lock_sha,
        "nsa.python": args["PYTHON"],
        "nsa.torch": args["TORCH_VERSION"],
        "nsa.cuda": cuda,
        "nsa.triton": args["TRITON_VERSION"],
        "nsa.flash-attn": fa_version,
        "nsa.flash-attn.source": fa_source,
    }
    min_drv = ""
    if not cpu:
        from ci.gh_matrix import cuda_version, min_driver  # noqa: PLC0415 - one table of drivers

        ga, floor = min_driver(cuda_version(cell))
        min_drv = f"{ga} (CUDA {cuda_version(cell)}; {floor} with minor-version compatibility)"
    short = rev[:12] if re.fullmatch(r"[0-9a-f]{12,40}", rev) else rev
    return ImagePlan(
        cell=cid,
        cpu_only=cpu,
        python=args["PYTHON"],
        python_source=args["PYTHON_SOURCE"],
        torch=args["TORCH_VERSION"],
        cuda=cuda,
        triton=args["TRITON_VERSION"],
        flash_attn_version=fa_version,
        flash_attn_source=fa_source,
        flash_attn_pinned=pinned,
        gpu_archs=tuple(str(a) for a in cell.get("gpu_archs") or ()),
        build_base=build_base,
        runtime_base=runtime_base,
        lock=str(lock.relative_to(root)),
        lock_sha256=lock_sha,
        tags=(f"{registry}/{name}:{cid}", f"{registry}/{name}:{cid}-{short}"),
        expected_size_gb=expected_size_gb(cell, runtime_base),
        min_driver=min_drv,
        build_args=args,
        labels=labels,
    )


def make_plans(cell_ids: list[str] | None = None, **kw: Any) -> list[ImagePlan]:
    cells, upstream = load_matrix()
    known = {c["id"]: c for c in cells}
    unknown = [c for c in cell_ids or [] if c not in known]
    if unknown:
        raise ImageError(f"unknown cell(s) {unknown}; cells: {', '.join(known)}")
    chosen = [known[c] for c in cell_ids] if cell_ids else cells
    return [make_plan(c, upstream, **kw) for c in chosen]


def format_plan(plans: list[ImagePlan]) -> str:
    lines = []
    for p in plans:
        lines += [
            f"{p.cell}",
            f"  tags          {'  '.join(p.tags)}",
            f"  build base    {p.build_base}   (python {p.python}: {p.python_source})",
            f"  runtime base  {p.runtime_base}",
            f"  torch {p.torch}  cuda {p.cuda}  triton {p.triton}  gpu archs {','.join(p.gpu_archs) or '-'}",
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
    cmd = [
        *docker_cmd(),
        "build",
        "--progress",
        "plain",
        "-f",
        str(DOCKERFILE.relative_to(ROOT)),
        "--target",
        "runtime",
    ]
    # BuildKit of the docker.io daemon accepts only host or none; offline builds prove it with none.
    cmd += ["--network", "none" if offline else "host"]
    for key, value in plan.build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    for tag in [*plan.tags, *(extra_tags or [])]:
        cmd += ["-t", tag]
    return [*cmd, "."]


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    print("+ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "1"}, **kw)


def wheelhouse(plan: ImagePlan, dest: Path) -> list[Path]:
    """Download every wheel of the lock (hash-checked, for the cell's Python and platform) into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    lock = ROOT / plan.lock
    if not lock.is_file():
        raise ImageError(f"no lock at {plan.lock} (run `nox -s lock -- {plan.cell}`)")
    py = plan.python.replace(".", "")
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--progress-bar", "off", "-d", str(dest)]
    target = [
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        py,
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "linux_x86_64",
    ]
    run([*base, "--require-hashes", *target, "-r", str(lock)])
    if url := plan.build_args.get("FLASH_ATTN_WHEEL_URL"):
        run([*base, *target, url])
    if plan.flash_attn_source == "source":
        req = dest / ".flash-attn-sdist.txt"
        req.write_text(
            f"flash-attn=={plan.flash_attn_version} --hash=sha256:{plan.build_args['FLASH_ATTN_SDIST_SHA256']}\n"
        )
        run([*base, "--require-hashes", "--no-binary", "flash-attn", "-r", str(req)])
    return sorted(dest.glob("*.whl"))


def build(plans: list[ImagePlan], *, offline: bool, push: bool, dry_run: bool) -> None:
    for i, plan in enumerate(plans, 1):
        cmd = build_command(plan, offline=offline)
        print(f"[{i}/{len(plans)}] building {plan.tags[0]} (offline={offline})", flush=True)
        if dry_run:
            print(shlex.join(cmd))
            continue
        start = time.monotonic()
        run(cmd)
        size = int(
            run(
                [*docker_cmd(), "image", "inspect", "--format", "{{.Size}}", plan.tags[0]], capture_output=True
            ).stdout.strip()
        )
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
        if key in (
            "org.opencontainers.image.revision",
            "org.opencontainers.image.created",
            "org.opencontainers.image.version",
        ):
            if not got:
                problems.append(f"label {key} is missing or empty")
        elif got != want:
            problems.append(f"label {key}: image has {got!r}, plan wants {want!r}")
    if labels.get("org.opencontainers.image.created") and not re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", labels["org.opencontainers.image.created"]
    ):
        problems.append("label org.opencontainers.image.created is not an RFC 3339 UTC date")
    return problems


def check_installed(lock_text: str, freeze_text: str, allowed_extra: tuple[str, ...] = ("pip", "nsa")) -> list[str]:
    """Differences between `pip freeze --all` of the image's venv and the lock (name and version)."""
    locked = parse_lock(lock_text)
    installed: dict[str, str] = {}
    for line in freeze_text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+)|@\s*(\S+))", line.strip())
        if m:
            installed[canonical(m[1])] = m[2] or m[3]
    problems = []
    for name, version in sorted(locked.items()):
        if name not in installed:
            problems.append(f"{name}=={version} is in the lock but not installed")
        elif installed[name] != version and not installed[name].startswith(("file:", "/")):
            problems.append(f"{name}: installed {installed[name]}, lock {version}")
    for name in sorted(set(installed) - set(locked) - {canonical(a) for a in allowed_extra}):
        if name == "flash-attn":  # compiled in the image, recorded in /opt/nsa-image/flash_attn.sha256
            continue
        problems.append(f"{name}=={installed[name]} is installed but not in the lock")
    if "nsa" in allowed_extra and "nsa" not in installed:
        problems.append("this project (nsa) is not installed")
    return problems


# --- command line ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.images", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=DEFAULT_REGISTRY, help="default $NSA_IMAGE_REGISTRY or %(default)s")
    common.add_argument("--name", default=DEFAULT_NAME)
    common.add_argument("--build-base", help="override the cell's base_image (e.g. nsa-base:bookworm)")
    common.add_argument("--runtime-base", help="override the cell's runtime_image")
    common.add_argument("--offline", action="store_true", help="install from docker/wheelhouse only")
    common.add_argument(
        "--max-jobs",
        type=int,
        default=int(os.environ.get("MAX_JOBS", "4")),
        help="parallel compile jobs for flash-attn from source (~4 GB of memory each)",
    )
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
    p_lab = sub.add_parser("check-labels", parents=[common], help="compare an image's labels with the plan")
    p_lab.add_argument("cell")
    p_lab.add_argument("--inspect", type=Path, required=True, help="output of `docker image inspect IMAGE`")
    p_inst = sub.add_parser("check-installed", parents=[common], help="compare pip freeze with the lock")
    p_inst.add_argument("cell")
    p_inst.add_argument("--freeze", type=Path, required=True, help="`pip freeze --all` run in the image")
    args = ap.parse_args(argv)
    kw = dict(
        registry=args.registry,
        name=args.name,
        build_base=args.build_base,
        runtime_base=args.runtime_base,
        offline=args.offline,
        max_jobs=args.max_jobs,
    )
    try:
        if args.cmd == "plan":
            plans = make_plans(args.cells, **kw)
            print(json.dumps([p.to_json() for p in plans], indent=2) if args.json else format_plan(plans))
        elif args.cmd == "build":
            build(make_plans(args.cells, **kw), offline=args.offline, push=args.push, dry_run=args.dry_run)
        elif args.cmd == "wheelhouse":
            (plan,) = make_plans([args.cell], **kw)
            wheels = wheelhouse(plan, args.dest)
            size = sum(w.stat().st_size for w in wheels)
            print(f"wheelhouse: {len(wheels)} wheels, {size / 1e6:.0f} MB in {args.dest}")
        elif args.cmd == "check-labels":
            (plan,) = make_plans([args.cell], **kw)
            inspect = json.loads(args.inspect.read_text())
            labels = (inspect[0] if isinstance(inspect, list) else inspect)["Config"]["Labels"] or {}
            problems = check_labels(plan, labels)
            _report("labels", problems, f"{len(plan.labels)} labels match the plan (lock {plan.lock_sha256[:12]})")
            return 1 if problems else 0
        elif args.cmd == "check-installed":
            (plan,) = make_plans([args.cell], **kw)
            lock_text = (ROOT / plan.lock).read_text()
            problems = check_installed(lock_text, args.freeze.read_text())
            _report("installed set", problems, f"{len(parse_lock(lock_text))} locked packages installed exactly")
            return 1 if problems else 0
    except (ImageError, OSError, subprocess.CalledProcessError, json.JSONDecodeError, KeyError) as exc:
        print(f"ci.images: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _report(what: str, problems: list[str], ok: str) -> None:
    if problems:
        print(f"ci.images: {what} do not match:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    else:
        print(f"ci.images: {what}: {ok}")


if __name__ == "__main__":
    sys.exit(main())
