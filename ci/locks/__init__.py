"""Generate and check the hash-pinned locks of requirements/matrix.toml.

    python -m ci.locks                    # relock every cell, requirements/bootstrap.txt and locks/tools.txt
    python -m ci.locks CELL [CELL ...]    # relock some (targets: cell ids, "bootstrap", "tools")
    python -m ci.locks --check            # offline: fail when any lock is stale or malformed
    python -m ci.locks --outdated         # ask PyPI what is newer than the matrix (ci/matrix/outdated.py)
    (`nox -s lock`, `nox -s lock -- --check` and `nox -s lock -- --outdated` run exactly these.)

How a cell lock is made: `uv pip compile` cross-resolves the cell's layers (requirements/<layer>.in,
matrix `defaults.layers`, plus `source_build_layers` for cells that build flash-attn) together with the
cell's own pins from the matrix (torch, triton, `pins`) for the cell's Python and the matrix's platform,
with `--generate-hashes`, without index or find-links lines. The header records the tool, its version,
the target, and `inputs-sha256`: a digest of everything the lock was made from (the cell's matrix entry,
the layer files, the platform, the lock format). `--check` recomputes that digest (fast, offline) and
also checks the body: torch and triton are the matrix's, every requirement has a hash, nothing
machine-local leaked in. A full re-resolve is simply relocking (needs PyPI).

A GPU cell's flash-attn is pinned beside its lock, in requirements/locks/<cell>.flash-attn.txt: upstream's
wheel by URL and sha256, or the PyPI source package by its sha256 (built with --no-build-isolation against
the installed torch). It is a pure function of the matrix (no resolution), so `--check` compares it with
what the matrix says byte for byte. The GPU nox sessions and the Docker build install it after the lock.

Torch builds that PyPI does not carry (the CPU cell's 2.13.0+cpu) come from the cell's index (PyTorch's,
ci.matrix.Matrix.index_url), or from a find-links folder given in NSA_LOCK_FIND_LINKS (else pip's
PIP_FIND_LINKS) where that index is out of reach. The wheel's sha256 must equal the matrix's
`torch_sha256`. Needs uv and packaging (requirements/bootstrap.txt).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from ci.matrix import Cell, Matrix

LOCK_FORMAT = 1
UNIVERSAL_PYTHON = "3.10"  # bootstrap and tools locks resolve for every Python from this one up
# Every lock: hashes, no index or find-links lines (they stay on the machine that made it), our own header.
UV_FLAGS = ["--generate-hashes", "--no-emit-index-url", "--no-emit-find-links", "--no-header",
            "--annotation-style=split"]
# Text that must never reach a committed lock: machine-local paths, file URLs, index/find-links lines.
FORBIDDEN = [
    (re.compile(r"file:"), "a file: URL"),
    (re.compile(r"(^|\s)/(opt|work|tmp|root|home|var)/"), "a machine-local path"),
    (
        re.compile(r"^\s*(--index-url|--extra-index-url|-i\s|--find-links|-f\s)", re.M),
        "an index/find-links line",
    ),
]


class LockError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pinned:
    """One requirement line of a hash-pinned lock (pip-tools format)."""

    name: str  # canonical (PEP 503)
    version: str  # for `name @ URL` wheels: the version in the wheel's file name
    url: str
    marker: str
    hashes: tuple[str, ...]


def iter_lock(text: str):
    """Every requirement of a lock: `name==version [; marker] \\` then `--hash=sha256:...` lines, or
    `name @ URL`. A universal lock lists a name once per environment marker: each line is yielded."""
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):  # comments; pip options are forbidden_content()'s
            continue
        spec, *options = re.split(r"\s+(?=--)", line)
        try:
            req = Requirement(spec)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            if req.url:  # InvalidWheelFilename (a ValueError) for anything but a wheel
                version = str(parse_wheel_filename(unquote(req.url.rsplit("/", 1)[-1]))[1])
            elif len(exact) == 1 and len(req.specifier) == 1:
                version = exact[0]
            else:
                raise ValueError("not pinned to exactly one version")
        except (InvalidRequirement, ValueError) as e:
            raise LockError(f"unparseable lock line: {raw.strip()[:100]!r} ({e})") from None
        hashes = tuple(o.split(":", 1)[1] for o in options if o.startswith("--hash=sha256:"))
        yield Pinned(canonicalize_name(req.name), version, req.url or "", str(req.marker or ""), hashes)


def parse_lock(text: str) -> dict[str, Pinned]:
    """name -> requirement (for a universal lock, the last line of a name wins)."""
    return {r.name: r for r in iter_lock(text)}


def header_fields(text: str) -> dict[str, str]:
    """`# key: value` lines of the header."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        m = re.match(r"#\s*([a-z0-9-]+):\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


# --- inputs ------------------------------------------------------------------------------------------


def layers_for(matrix: Matrix, cell: Cell) -> list[str]:
    layers = matrix.layers
    if cell.flash_attn.source == "source":
        layers = layers + list(matrix.defaults.get("source_build_layers", []))
    return layers


def cell_requirements(cell: Cell) -> list[str]:
    """The cell's own exact pins, resolved together with the layers."""
    reqs = [f"torch=={cell.torch}"]
    if cell.triton != "none":
        reqs.append(f"triton=={cell.triton}")
    reqs.extend(cell.pins)
    return reqs


def _normalized(path: Path) -> str:
    # Whitespace-only edits do not make a lock stale; any content change does.
    return "\n".join(line.rstrip() for line in path.read_text().strip().splitlines())


# The cell fields a lock is resolved from; the others (images, GPU archs, index, description) leave it valid.
RESOLUTION_FIELDS = ("id", "python", "cuda", "cpu_only", "torch", "torch_sha256", "triton", "flash_attn", "pins")


def inputs_digest(matrix: Matrix, cell: Cell) -> str:
    req_dir = matrix.path.parent
    doc = {
        "format": LOCK_FORMAT,
        "platform": matrix.platform,
        "cell": {k: v for k, v in cell.raw.items() if k in RESOLUTION_FIELDS},
        "requirements": cell_requirements(cell),
        "layers": {name: _normalized(req_dir / f"{name}.in") for name in layers_for(matrix, cell)},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def universal_digest(in_file: Path) -> str:
    doc = {"format": LOCK_FORMAT, "python": UNIVERSAL_PYTHON, "input": _normalized(in_file)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def lock_path(matrix: Matrix, cell_id: str) -> Path:
    return matrix.path.parent / "locks" / f"{cell_id}.txt"


def universal_targets(matrix: Matrix) -> dict[str, tuple[Path, Path]]:
    """Locks that are not cells (bootstrap, developer tools, lint): name -> (input, lock), from the
    matrix's [defaults.tool_locks] (paths relative to requirements/)."""
    req = matrix.path.parent
    table = matrix.defaults.get("tool_locks", {"bootstrap": "bootstrap.txt"})
    return {name: (req / f"{name}.in", req / rel) for name, rel in table.items()}


# --- downloading -----------------------------------------------------------------------------------

def platform_tags(platform: str) -> list[str]:
    """The wheel platform tags a target like x86_64-manylinux_2_28 installs (pip's --platform takes exact
    tags only): manylinux_2_28 down to manylinux_2_5, their legacy aliases, and plain linux."""
    arch, _, glibc = platform.partition("-manylinux_2_")
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(int(glibc), 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in legacy:
            tags.append(f"{legacy[minor]}_{arch}")
    return [*tags, f"linux_{arch}"]


def download_wheels(matrix: Matrix, cell: Cell, dest: Path, index_args: list[str] = (),
                    only: set[str] | None = None) -> list[Path]:
    """The wheels of the cell's lock (all, or the packages named in `only`), hash-checked, for the cell's
    Python, from pip's configured indexes and `index_args`, into dest."""
    platforms = [a for p in platform_tags(matrix.platform) for a in ("--platform", p)]
    with tempfile.TemporaryDirectory(prefix="nsa-wheels-") as tmp:
        reqs = lock_path(matrix, cell.id)
        if only is not None:
            pins = parse_lock(reqs.read_text())
            unknown = {canonicalize_name(n) for n in only} - set(pins)
            if unknown:
                raise LockError(f"{cell.id}: not in the lock: {sorted(unknown)}")
            reqs = Path(tmp) / "only.txt"
            reqs.write_text("".join(f"{p.name}=={p.version} " + " ".join(f"--hash=sha256:{h}" for h in p.hashes)
                                    + "\n" for p in pins.values() if p.name in {canonicalize_name(n) for n in only}))
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--progress-bar", "off", "--require-hashes",
             "--only-binary=:all:", "--implementation", "cp", "--python-version", cell.python.replace(".", ""),
             *platforms, *index_args, "-d", str(dest), "-r", str(reqs)],
            check=True,
        )
    return sorted(dest.glob("*.whl"))


# --- generation --------------------------------------------------------------------------------------


def uv_bin() -> str:
    try:
        import uv  # the PyPI package ships the binary

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if not found:
            raise LockError("uv not found: install requirements/bootstrap.txt (it pins uv)") from None
        return found


def uv_version(uv: str) -> str:
    return subprocess.run([uv, "--version"], check=True, capture_output=True, text=True).stdout.split()[1]


def _find_links() -> list[str]:
    value = os.environ.get("NSA_LOCK_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS") or ""
    return value.split()


def _run_uv(uv: str, args: list[str], cwd: Path, previous: Path) -> str:
    """`uv pip compile`, starting from the previous lock's pins (uv keeps the versions of an existing
    output file that still satisfy the inputs), so that relocking changes only what its inputs changed."""
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
    with tempfile.TemporaryDirectory(prefix="nsa-uv-") as tmp:
        out = Path(tmp) / "lock.txt"
        out.write_text(previous.read_text() if previous.exists() else "")
        proc = subprocess.run(
            [uv, "pip", "compile", "--no-config", "--quiet", *args, "--output-file", str(out)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise LockError(f"uv pip compile failed:\n{proc.stderr.strip()}")
        return out.read_text()


def _scrub(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        if old:
            text = text.replace(old, new)
    return text


def forbidden_content(text: str) -> list[str]:
    return [
        f"contains {what}: {m.group(0).strip()!r}" for rx, what in FORBIDDEN for m in [rx.search(text)] if m
    ]


def compile_cell(matrix: Matrix, cell: Cell, uv: str | None = None) -> Path:
    uv = uv or uv_bin()
    req_dir = matrix.path.parent
    root = req_dir.parent
    layers = layers_for(matrix, cell)
    # The cell's own index; a find-links folder of wheels stands in for it where it is out of reach.
    links = _find_links() if cell.torch_index != "pypi" else []
    extra = [a for link in links for a in ("--find-links", link)] or matrix.pip_index_args(cell)
    with tempfile.TemporaryDirectory(prefix="nsa-lock-") as tmp:
        cell_in = Path(tmp) / "cell.in"
        cell_in.write_text("\n".join(cell_requirements(cell)) + "\n")
        inputs = [*[str((req_dir / f"{name}.in").relative_to(root)) for name in layers], str(cell_in)]
        args = [*inputs, *UV_FLAGS, "--python-platform", matrix.platform, "--python-version", cell.python, *extra]
        body = _run_uv(uv, args, cwd=root, previous=lock_path(matrix, cell.id))
        body = _scrub(body, {str(cell_in): f"{matrix.path.relative_to(root)} (cell {cell.id})", tmp: "<tmp>"})
    for link in _find_links():
        body = _scrub(body, {link: "<find-links>"})

    reqs = parse_lock(body)
    _check_pins(cell, reqs)
    write_flash_lock(matrix, cell)
    return _write(lock_path(matrix, cell.id), _cell_header(matrix, cell, layers, uv_version(uv)) + body)


# --- flash-attn beside the lock ------------------------------------------------------------------------


def flash_lock_path(matrix: Matrix, cell_id: str) -> Path:
    return matrix.path.parent / "locks" / f"{cell_id}.flash-attn.txt"


def flash_install_args(matrix: Matrix, cell: Cell) -> tuple[list[str], dict[str, str]]:
    """`pip install` arguments and environment that install the cell's flash-attn pin (after its lock).
    A source build compiles against the installed torch (no build isolation) for the cell's GPU
    architectures, and FLASH_ATTENTION_FORCE_BUILD keeps flash-attn's setup.py from fetching an unpinned
    wheel instead."""
    args = ["--require-hashes", "--no-deps", "-r", str(flash_lock_path(matrix, cell.id))]
    if cell.flash_attn.source != "source":
        return ["--only-binary=:all:", *args], {}
    archs = ";".join(sorted(cell.gpu_archs, key=float))
    env = {"FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTN_CUDA_ARCHS": archs.replace(".", ""),
           "TORCH_CUDA_ARCH_LIST": archs}
    return ["--no-build-isolation", "--no-binary", "flash-attn", *args], env


def flash_lock_text(matrix: Matrix, cell: Cell) -> str | None:
    """The cell's flash-attn pin file (None for a cell without flash-attn)."""
    fa = cell.flash_attn
    if fa.source == "none":
        return None
    name = flash_lock_path(matrix, cell.id).name
    args, env = flash_install_args(matrix, cell)
    install = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "pip install", *args[:-1], name])
    if fa.source == "wheel":
        what = f"upstream's release wheel {fa.wheel}, by URL and sha256"
        req = f"flash-attn @ {matrix.flash_wheel_url(cell)}"
        sha = fa.sha256
    else:
        what = (f"the PyPI source package flash_attn-{fa.version}.tar.gz, compiled for sm "
                f"{' '.join(sorted(cell.gpu_archs, key=float))} (needs nvcc of CUDA {cell.cuda.split('.')[0]}.x "
                "and several GiB of memory per MAX_JOBS; an hour or more)")
        req = f"flash-attn=={fa.version}"
        sha = matrix.flash_sdist_sha256(fa.version)
    return (
        f"# flash-attn of cell {cell.id}: generated by `nox -s lock -- {cell.id}` from requirements/matrix.toml. "
        "Do not edit.\n"
        f"# What: {what}.\n"
        f"# Install after {lock_path(matrix, cell.id).name}, into the same environment:\n"
        f"#   {install}\n"
        f"{req} \\\n    --hash=sha256:{sha}\n"
    )


def write_flash_lock(matrix: Matrix, cell: Cell) -> Path | None:
    """Write (or, for a cell without flash-attn, remove) the cell's flash-attn pin file."""
    out = flash_lock_path(matrix, cell.id)
    text = flash_lock_text(matrix, cell)
    if text is None:
        out.unlink(missing_ok=True)
        return None
    return _write(out, text)


def _write(out: Path, text: str) -> Path:
    problems = forbidden_content(text)
    if problems:
        raise LockError(f"{out.name}: refusing to write the lock: " + "; ".join(problems))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def _cell_header(matrix: Matrix, cell: Cell, layers: list[str], uv_ver: str) -> str:
    fa = cell.flash_attn
    if fa.source == "none":
        fa_s = f"none ({matrix.flash_none_reason(cell)})"
    else:
        kind = "upstream wheel" if fa.source == "wheel" else "source package, compiled"
        fa_s = f"{fa.version} ({kind}): pinned in {flash_lock_path(matrix, cell.id).name}, installed after this lock"
    cuda = "none (CPU)" if cell.cpu_only else cell.cuda
    index = matrix.index_url(cell, environ={})
    return (
        f"# Lock of cell {cell.id}: generated by `nox -s lock -- {cell.id}`. Do not edit.\n"
        f"# Install exactly: pip install --require-hashes --no-deps{' --extra-index-url ' + index if index else ''}"
        f" -r {lock_path(matrix, cell.id).name}\n"
        f"# lock-format: {LOCK_FORMAT}\n"
        f"# cell: {cell.id}\n"
        f"# python: {cell.python}\n"
        f"# platform: {matrix.platform}\n"
        f"# cuda: {cuda}\n"
        f"# torch: {cell.torch}\n"
        f"# triton: {cell.triton}\n"
        f"# flash-attn: {fa_s}\n"
        f"# layers: {' '.join(layers)}\n"
        f"# resolver: uv {uv_ver} pip compile --generate-hashes --python-platform {matrix.platform} "
        f"--python-version {cell.python} --no-emit-index-url --no-emit-find-links\n"
        f"# inputs-sha256: {inputs_digest(matrix, cell)}\n"
        "#\n"
    )


def compile_universal(name: str, in_file: Path, out: Path, uv: str | None = None) -> Path:
    uv = uv or uv_bin()
    root = in_file.parent.parent
    args = [str(in_file.relative_to(root)), *UV_FLAGS, "--universal", "--python-version", UNIVERSAL_PYTHON]
    body = _run_uv(uv, args, cwd=root, previous=out)
    header = (
        f"# {name} lock: generated by `nox -s lock -- {name}`. Do not edit.\n"
        f"# Install: pip install --require-hashes -r {out.relative_to(root)}\n"
        f"# lock-format: {LOCK_FORMAT}\n"
        f"# python: >={UNIVERSAL_PYTHON} (universal: any platform)\n"
        f"# resolver: uv {uv_version(uv)} pip compile --universal --python-version {UNIVERSAL_PYTHON} "
        "--generate-hashes --no-emit-index-url --no-emit-find-links\n"
        f"# inputs-sha256: {universal_digest(in_file)}\n"
        "#\n"
    )
    return _write(out, header + body)


# --- checking ----------------------------------------------------------------------------------------


def _check_pins(cell: Cell, reqs: dict[str, Pinned]) -> None:
    problems = check_body(cell, reqs)
    if problems:
        raise LockError(f"cell {cell.id}: " + "; ".join(problems))


def check_body(cell: Cell, reqs: dict[str, Pinned]) -> list[str]:
    p = []
    torch = reqs.get("torch")
    if torch is None or torch.version != cell.torch:
        p.append(f"torch is {torch.version if torch else 'missing'}, matrix says {cell.torch}")
    elif cell.torch_sha256 and cell.torch_sha256 not in torch.hashes:
        p.append(f"torch {cell.torch}'s hashes lack the matrix's torch_sha256 {cell.torch_sha256[:12]}...")
    triton = reqs.get("triton")
    want = None if cell.triton == "none" else cell.triton
    if (triton.version if triton else None) != want:
        p.append(f"triton is {triton.version if triton else 'missing'}, matrix says {cell.triton}")
    for pin in cell.pins:
        name, _, ver = pin.partition("==")
        got = reqs.get(canonicalize_name(name))
        if got is None or got.version != ver:
            p.append(f"{name} is {got.version if got else 'missing'}, matrix pins {ver}")
    unhashed = sorted(r.name for r in reqs.values() if not r.hashes)
    if unhashed:
        p.append(f"requirements without --hash: {', '.join(unhashed)}")
    return p


def check(matrix: Matrix, targets: list[str] | None = None) -> list[str]:
    """Every reason the locks are stale or malformed (empty when all are fresh)."""
    problems: list[str] = []
    universal = universal_targets(matrix)
    wanted = targets or [c.id for c in matrix.cells] + list(universal)
    for t in wanted:
        if t in universal:
            in_file, out = universal[t]
            expect = universal_digest(in_file)
            cell = None
        else:
            cell = matrix.get(t)
            out = lock_path(matrix, t)
            expect = inputs_digest(matrix, cell)
        relock = f"run `nox -s lock -- {t}`"
        if not out.exists():
            problems.append(f"{t}: no lock at {out.name}; {relock}")
            continue
        text = out.read_text()
        got = header_fields(text).get("inputs-sha256")
        if got != expect:
            problems.append(
                f"{t}: stale ({out.name} was made from other inputs: .in files or matrix changed); {relock}"
            )
            continue
        problems.extend(f"{t}: {p}" for p in forbidden_content(text))
        try:
            reqs = parse_lock(text)
        except LockError as e:
            problems.append(f"{t}: {e}")
            continue
        if cell is not None:
            problems.extend(f"{t}: {p}" for p in check_body(cell, reqs))
            problems.extend(f"{t}: {p}" for p in check_flash_lock(matrix, cell))
        elif not all(r.hashes for r in iter_lock(text)):
            problems.append(f"{t}: requirements without --hash")
    if not targets:  # locks of cells that no longer exist
        known = {c.id for c in matrix.cells} | {out.stem for _, out in universal.values()}
        known |= {flash_lock_path(matrix, c.id).stem for c in matrix.cells if c.flash_attn.source != "none"}
        for f in sorted((matrix.path.parent / "locks").glob("*.txt")):
            if f.stem not in known:
                problems.append(f"{f.name}: no cell {f.stem.removesuffix('.flash-attn')!r} with flash-attn in the "
                                "matrix: delete it")
    return problems


def check_flash_lock(matrix: Matrix, cell: Cell) -> list[str]:
    path, want = flash_lock_path(matrix, cell.id), flash_lock_text(matrix, cell)
    if want is None:
        return [f"{path.name} exists but the cell has no flash-attn: run `nox -s lock -- {cell.id}`"] \
            if path.exists() else []
    if not path.exists() or path.read_text() != want:
        return [f"{path.name} is {'missing' if not path.exists() else 'stale'}: run `nox -s lock -- {cell.id}`"]
    return []
