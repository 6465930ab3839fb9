"""Generate and check the hash-pinned locks of requirements/matrix.toml.

`python -m ci.locks [TARGET ...] [--upgrade | --check [--resolve] | --outdated]` is the CLI (`nox -s lock`,
ci/locks/__main__.py; docs/environments.md describes each option).

A cell lock is `uv pip compile --generate-hashes` of the cell's layers (requirements/<layer>.in, matrix
`defaults.layers`, plus `source_build_layers` for cells that build flash-attn) with the cell's own pins
(torch, triton, `pins`), for the cell's Python and the matrix's platform, from the cell's index (or a
find-links folder in NSA_LOCK_FIND_LINKS, else PIP_FIND_LINKS, where it is out of reach), starting from
the lock's current pins, with no index or find-links line. Its header records `inputs-sha256` (the cell's
matrix entry, layer files, platform, lock format) and `lock-sha256` (the file without that line). `--check`
(offline) fails a lock whose inputs changed, whose body is not strictly hash-pinned `name==version [;
marker]` lines and comments, whose content is not what the generator wrote, or whose torch/triton/pins are
not the matrix's; `--resolve` also proves each lock a fixed point of resolving its inputs from its pins.
A GPU cell's flash-attn pin (locks/<cell>.flash-attn.txt: upstream's wheel by URL and sha256, or the PyPI
source package) is a pure function of the matrix, compared byte for byte. Needs uv and packaging.
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
from pathlib import Path

from packaging.utils import canonicalize_name

from ci.matrix import Cell, Matrix, universal_targets

# The one lock parser, shipped with nsa for `nsa-env --check-lock` (found in the checkout here).
from nsa_env.lockfile import LockError, Pinned, iter_lock, logical_lines, parse_lock  # noqa: F401

LOCK_FORMAT = 1
UNIVERSAL_PYTHON = "3.10"  # bootstrap and tools locks resolve for every Python from this one up
# Every lock: hashes, no index or find-links lines (they stay on the machine that made it), our own header.
UV_FLAGS = ["--generate-hashes", "--no-emit-index-url", "--no-emit-find-links", "--no-header",
            "--annotation-style=split"]
# Text that must never reach a committed lock, comments included: machine-local paths, file URLs.
FORBIDDEN = [(re.compile(r"file:"), "a file: URL"),
             (re.compile(r"(^|\s)/(opt|work|tmp|root|home|var)/"), "a machine-local path")]
# The only requirement form a lock may hold (`pip install --require-hashes --no-deps` takes it as it is).
STRICT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+(\s*;[^;]*?)?(\s+--hash=sha256:[0-9a-f]{64})+")
SEAL = "# lock-sha256: "


def lint_lock(text: str) -> list[str]:
    """Every line of a cell or tool lock that is not `name==version [; marker]` with --hash=sha256: lines
    (or a comment): option lines (-r, -c, -e, --trusted-host, --index-url, ...), URL and VCS requirements,
    unhashed or unpinned ones. pip would follow each of them; the generator writes none."""
    problems = []
    for n, line in logical_lines(text):
        if STRICT.fullmatch(line):
            continue
        what = (f"a pip option line ({line.split()[0]})" if line.startswith("-")
                else "a URL or VCS requirement" if "://" in line or re.match(r"[^\s;]+\s*@", line)
                else "a requirement without --hash=sha256" if "--hash=sha256:" not in line
                else "not `name==version [; marker]` with --hash=sha256: lines")
        problems.append(f"line {n}: {what}: {line[:90]!r}; a lock holds only hash-pinned `name==version` lines")
    return problems


def seal_digest(text: str) -> str:
    """sha256 of a lock without its lock-sha256 line: any other edit changes it."""
    kept = "".join(line for line in text.splitlines(keepends=True) if not line.startswith(SEAL))
    return hashlib.sha256(kept.encode()).hexdigest()


def header_fields(text: str) -> dict[str, str]:
    """`# key: value` lines of the header (the comment lines before the first requirement)."""
    header = re.match(r"(#[^\n]*\n)*", text).group(0)
    return {k: v.strip() for k, v in re.findall(r"^#\s*([a-z0-9-]+):\s*(.*)$", header, re.M)}


# --- inputs ------------------------------------------------------------------------------------------


def layers_for(matrix: Matrix, cell: Cell) -> list[str]:
    return matrix.layers + (list(matrix.defaults.get("source_build_layers", [])) if cell.flash_attn.source == "source"
                            else [])


def cell_requirements(cell: Cell) -> list[str]:
    """The cell's own exact pins, resolved together with the layers."""
    return [f"torch=={cell.torch}", *([f"triton=={cell.triton}"] if cell.triton != "none" else []), *cell.pins]


def _normalized(path: Path) -> str:
    # Whitespace-only edits do not make a lock stale; any content change does.
    return "\n".join(line.rstrip() for line in path.read_text().strip().splitlines())


def _sha(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


# The cell fields a lock is resolved from; the others (images, GPU archs, index, description) leave it valid.
RESOLUTION_FIELDS = ("id", "python", "cuda", "cpu_only", "torch", "torch_sha256", "triton", "flash_attn", "pins")


def inputs_digest(matrix: Matrix, cell: Cell) -> str:
    layers = {name: _normalized(matrix.path.parent / f"{name}.in") for name in layers_for(matrix, cell)}
    return _sha({"format": LOCK_FORMAT, "platform": matrix.platform, "requirements": cell_requirements(cell),
                 "cell": {k: v for k, v in cell.raw.items() if k in RESOLUTION_FIELDS}, "layers": layers})


def universal_digest(in_file: Path) -> str:
    return _sha({"format": LOCK_FORMAT, "python": UNIVERSAL_PYTHON, "input": _normalized(in_file)})


def lock_path(matrix: Matrix, cell_id: str) -> Path:
    return matrix.path.parent / "locks" / f"{cell_id}.txt"


# --- downloading -----------------------------------------------------------------------------------

def platform_tags(platform: str) -> list[str]:
    """The wheel platform tags a target like x86_64-manylinux_2_28 installs (pip's --platform takes exact
    tags only): manylinux_2_28 down to manylinux_2_5, their legacy aliases, and plain linux."""
    arch, _, glibc = platform.partition("-manylinux_2_")
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = [t for minor in range(int(glibc), 4, -1) for t in (f"manylinux_2_{minor}", legacy.get(minor)) if t]
    return [f"{t}_{arch}" for t in [*tags, "linux"]]


def download_wheels(matrix: Matrix, cell: Cell, dest: Path, index_args: list[str] = (),
                    only: set[str] | None = None) -> list[Path]:
    """The wheels of the cell's lock (all, or the packages named in `only`), hash-checked, for the cell's
    Python, from pip's configured indexes and `index_args`, into dest."""
    platforms = [a for p in platform_tags(matrix.platform) for a in ("--platform", p)]
    with tempfile.TemporaryDirectory(prefix="nsa-wheels-") as tmp:
        reqs = lock_path(matrix, cell.id)
        if only is not None:
            want = {canonicalize_name(n) for n in only}
            pins = [p for p in parse_lock(reqs.read_text()).values() if p.name in want]
            if want - {p.name for p in pins}:
                raise LockError(f"{cell.id}: not in the lock: {sorted(want - {p.name for p in pins})}")
            reqs = Path(tmp) / "only.txt"
            reqs.write_text("".join(f"{p.name}=={p.version} {' '.join('--hash=sha256:' + h for h in p.hashes)}\n"
                                    for p in pins))
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--progress-bar", "off",
                        "--require-hashes", "--only-binary=:all:", "--implementation", "cp", "--python-version",
                        cell.python.replace(".", ""), *platforms, *index_args, "-d", str(dest), "-r", str(reqs)],
                       check=True)
    return sorted(dest.glob("*.whl"))


# --- generation --------------------------------------------------------------------------------------


def uv_bin() -> str:
    try:
        import uv  # the PyPI package ships the binary

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        if found := shutil.which("uv"):
            return found
        raise LockError("uv not found: install requirements/bootstrap.txt (it pins uv)") from None


def uv_version(uv: str) -> str:
    return subprocess.run([uv, "--version"], check=True, capture_output=True, text=True).stdout.split()[1]


def _find_links() -> list[str]:
    return (os.environ.get("NSA_LOCK_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS") or "").split()


def _run_uv(uv: str, args: list[str], cwd: Path, previous: str) -> str:
    """`uv pip compile`, preferring the `name==version` pins of `previous` (uv keeps an existing output's
    versions that still satisfy the inputs): relocking changes only what the inputs changed, a consistent
    lock resolves to itself, and no option line a hand edit added reaches uv."""
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
    with tempfile.TemporaryDirectory(prefix="nsa-uv-") as tmp:
        out = Path(tmp) / "lock.txt"
        out.write_text("".join(f"{p.name}=={p.version}{' ; ' + p.marker if p.marker else ''}\n"
                               for p in iter_lock(previous) if not p.url))
        proc = subprocess.run([uv, "pip", "compile", "--no-config", "--quiet", *args, "--output-file", str(out)],
                              cwd=cwd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise LockError(f"uv pip compile failed:\n{proc.stderr.strip()}")
        return out.read_text()


def forbidden_content(text: str) -> list[str]:
    return [f"contains {what}: {m.group(0).strip()!r}" for rx, what in FORBIDDEN for m in [rx.search(text)] if m]


def resolve_cell(matrix: Matrix, cell: Cell, uv: str, previous: str) -> str:
    """The lock body `uv pip compile` gives for the cell's inputs, preferring the pins of `previous`."""
    req_dir = matrix.path.parent
    root = req_dir.parent
    # The cell's own index; a find-links folder of wheels stands in for it where it is out of reach.
    links = _find_links() if cell.torch_index != "pypi" else []
    extra = [a for link in links for a in ("--find-links", link)] or matrix.pip_index_args(cell)
    with tempfile.TemporaryDirectory(prefix="nsa-lock-") as tmp:
        cell_in = Path(tmp) / "cell.in"
        cell_in.write_text("\n".join(cell_requirements(cell)) + "\n")
        inputs = [*[str((req_dir / f"{name}.in").relative_to(root)) for name in layers_for(matrix, cell)], str(cell_in)]
        args = [*inputs, *UV_FLAGS, "--python-platform", matrix.platform, "--python-version", cell.python, *extra]
        body = _run_uv(uv, args, cwd=root, previous=previous)
        body = body.replace(str(cell_in), f"{matrix.path.relative_to(root)} (cell {cell.id})").replace(tmp, "<tmp>")
    for link in _find_links():
        body = body.replace(link, "<find-links>")
    return body


def compile_cell(matrix: Matrix, cell: Cell, uv: str | None = None, upgrade: bool = False) -> Path:
    """Relock the cell from its current pins or, with `upgrade`, afresh (the newest versions its inputs allow)."""
    uv = uv or uv_bin()
    out = lock_path(matrix, cell.id)
    body = resolve_cell(matrix, cell, uv, "" if upgrade else (out.read_text() if out.exists() else ""))
    problems = check_body(cell, parse_lock(body))
    if problems:
        raise LockError(f"cell {cell.id}: " + "; ".join(problems))
    write_flash_lock(matrix, cell)
    return _write(out, _cell_header(matrix, cell, layers_for(matrix, cell), uv_version(uv)) + body, seal=True)


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
    args, env = flash_install_args(matrix, cell)
    install = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "pip install", *args[:-1],
                        flash_lock_path(matrix, cell.id).name])
    what, req, sha = (f"upstream's release wheel {fa.wheel}, by URL and sha256",
                      f"flash-attn @ {matrix.flash_wheel_url(cell)}", fa.sha256) if fa.source == "wheel" else (
        f"the PyPI source package flash_attn-{fa.version}.tar.gz, compiled for sm "
        f"{' '.join(sorted(cell.gpu_archs, key=float))} (needs nvcc of CUDA {cell.cuda.split('.')[0]}.x "
        "and several GiB of memory per MAX_JOBS; an hour or more)",
        f"flash-attn=={fa.version}", matrix.flash_sdist_sha256(fa.version))
    return (f"# flash-attn of cell {cell.id}: generated by `nox -s lock -- {cell.id}` from requirements/matrix.toml. "
            f"Do not edit.\n# What: {what}.\n# Install after {lock_path(matrix, cell.id).name}, into the same "
            f"environment:\n#   {install}\n{req} \\\n    --hash=sha256:{sha}\n")


def write_flash_lock(matrix: Matrix, cell: Cell) -> Path | None:
    """Write (or, for a cell without flash-attn, remove) the cell's flash-attn pin file."""
    out = flash_lock_path(matrix, cell.id)
    text = flash_lock_text(matrix, cell)
    if text is None:
        out.unlink(missing_ok=True)
        return None
    return _write(out, text)


def _write(out: Path, text: str, seal: bool = False) -> Path:
    """Write a lock; `seal` (cell and tool locks): lint it, and add lock-sha256 as its last header line."""
    problems = forbidden_content(text) + (lint_lock(text) if seal else [])
    if problems:
        raise LockError(f"{out.name}: refusing to write the lock: " + "; ".join(problems))
    if seal:
        text = text.replace("\n#\n", f"\n{SEAL}{seal_digest(text)}\n#\n", 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def _cell_header(matrix: Matrix, cell: Cell, layers: list[str], uv_ver: str) -> str:
    fa, index = cell.flash_attn, matrix.index_url(cell, environ={})
    kind = "upstream wheel" if fa.source == "wheel" else "source package, compiled"
    fields = {"lock-format": LOCK_FORMAT, "cell": cell.id, "python": cell.python, "platform": matrix.platform,
        "cuda": "none (CPU)" if cell.cpu_only else cell.cuda, "torch": cell.torch, "triton": cell.triton,
        "flash-attn": f"none ({matrix.flash_none_reason(cell)})" if fa.source == "none" else
        f"{fa.version} ({kind}): pinned in {flash_lock_path(matrix, cell.id).name}, installed after this lock",
        "layers": " ".join(layers),
        "resolver": f"uv {uv_ver} pip compile --generate-hashes --python-platform {matrix.platform} "
                    f"--python-version {cell.python} --no-emit-index-url --no-emit-find-links",
        "inputs-sha256": inputs_digest(matrix, cell)}
    return (f"# Lock of cell {cell.id}: generated by `nox -s lock -- {cell.id}`. Do not edit.\n"
            f"# Install exactly: pip install --require-hashes --no-deps{' --extra-index-url ' + index if index else ''}"
            f" -r {lock_path(matrix, cell.id).name}\n" + _fields(fields))


def _fields(fields: dict) -> str:
    return "".join(f"# {k}: {v}\n" for k, v in fields.items()) + "#\n"


def resolve_universal(in_file: Path, uv: str, previous: str) -> str:
    args = [str(in_file.relative_to(in_file.parent.parent)), *UV_FLAGS, "--universal",
            "--python-version", UNIVERSAL_PYTHON]
    return _run_uv(uv, args, cwd=in_file.parent.parent, previous=previous)


def compile_universal(name: str, in_file: Path, out: Path, uv: str | None = None, upgrade: bool = False) -> Path:
    uv = uv or uv_bin()
    body = resolve_universal(in_file, uv, "" if upgrade else (out.read_text() if out.exists() else ""))
    fields = {"lock-format": LOCK_FORMAT, "python": f">={UNIVERSAL_PYTHON} (universal: any platform)",
              "resolver": f"uv {uv_version(uv)} pip compile --universal --python-version {UNIVERSAL_PYTHON} "
                          "--generate-hashes --no-emit-index-url --no-emit-find-links",
              "inputs-sha256": universal_digest(in_file)}
    return _write(out, f"# {name} lock: generated by `nox -s lock -- {name}`. Do not edit.\n# Install: pip install "
                  f"--require-hashes -r {out.relative_to(in_file.parent.parent)}\n" + _fields(fields) + body, seal=True)


# --- checking ----------------------------------------------------------------------------------------


def check_body(cell: Cell, reqs: dict[str, Pinned]) -> list[str]:
    """torch, triton and the cell's pins are the matrix's."""
    p = []
    torch = reqs.get("torch")
    if torch is None or torch.version != cell.torch:
        p.append(f"torch is {torch.version if torch else 'missing'}, matrix says {cell.torch}")
    elif cell.torch_sha256 and cell.torch_sha256 not in torch.hashes:
        p.append(f"torch {cell.torch}'s hashes lack the matrix's torch_sha256 {cell.torch_sha256[:12]}...")
    triton = reqs.get("triton")
    if (triton.version if triton else "none") != cell.triton:
        p.append(f"triton is {triton.version if triton else 'missing'}, matrix says {cell.triton}")
    for pin in cell.pins:
        name, _, ver = pin.partition("==")
        got = reqs.get(canonicalize_name(name))
        if got is None or got.version != ver:
            p.append(f"{name} is {got.version if got else 'missing'}, matrix pins {ver}")
    return p


def _targets(matrix: Matrix, targets: list[str] | None) -> dict[str, tuple[Path, Cell | None, Path | None]]:
    """target -> (its lock, its cell or None, the input of a universal lock or None)."""
    tools = universal_targets(matrix)
    return {t: (tools[t][1], None, tools[t][0]) if t in tools else (lock_path(matrix, t), matrix.get(t), None)
            for t in targets or [c.id for c in matrix.cells] + list(tools)}


def check(matrix: Matrix, targets: list[str] | None = None) -> list[str]:
    """Every reason the locks are stale, malformed or not what the generator wrote (empty when none is)."""
    problems: list[str] = []
    for t, (out, cell, in_file) in _targets(matrix, targets).items():
        relock = f"run `nox -s lock -- {t}`"
        if not out.exists():
            problems.append(f"{t}: no lock at {out.name}; {relock}")
            continue
        text = out.read_text()
        expect = inputs_digest(matrix, cell) if cell else universal_digest(in_file)
        if header_fields(text).get("inputs-sha256") != expect:
            problems.append(f"{t}: stale ({out.name} was made from other inputs: .in files or matrix changed); "
                            f"{relock}")
            continue
        problems.extend(f"{t}: {out.name}: {p}" for p in forbidden_content(text) + lint_lock(text))
        seal = header_fields(text).get("lock-sha256")
        if seal != seal_digest(text):
            problems.append(f"{t}: {out.name} is not what `nox -s lock` wrote (lock-sha256 "
                            f"{'missing' if seal is None else 'differs'}: a line was edited, added or removed). "
                            f"Locks change only by relocking: edit requirements/*.in or the matrix, then {relock}")
        if cell is not None:
            try:
                problems += [f"{t}: {p}" for p in check_body(cell, parse_lock(text)) + check_flash_lock(matrix, cell)]
            except LockError as e:
                problems.append(f"{t}: {out.name}: {e}")
    if not targets:  # locks of cells that no longer exist
        known = {c.id for c in matrix.cells} | {out.stem for _, out in universal_targets(matrix).values()}
        known |= {flash_lock_path(matrix, c.id).stem for c in matrix.cells if c.flash_attn.source != "none"}
        for f in sorted((matrix.path.parent / "locks").glob("*.txt")):
            if f.stem not in known:
                problems.append(f"{f.name}: no cell {f.stem.removesuffix('.flash-attn')!r} with flash-attn in the "
                                "matrix: delete it")
    return problems


def diff_pins(locked: str, resolved: str) -> list[str]:
    """How a lock's requirements differ from a resolution's (name, marker, version, hashes)."""
    a, b = ({(p.name, p.marker): p for p in iter_lock(t)} for t in (locked, resolved))
    out = []
    for key in sorted(a.keys() | b.keys()):
        x, y, what = a.get(key), b.get(key), key[0] + (f" ; {key[1]}" if key[1] else "")
        out += ([f"{what}=={x.version} is not in the resolution of the inputs"] if y is None
                else [f"{what}=={y.version} is missing (the resolution of the inputs has it)"] if x is None
                else [f"{what} is {x.version}, resolving the inputs gives {y.version}"] if x.version != y.version
                else [f"{what}=={x.version}: its hashes are not the index's"] if set(x.hashes) != set(y.hashes)
                else [])
    return out


def resolve_check(matrix: Matrix, targets: list[str] | None = None, uv: str | None = None) -> list[str]:
    """Resolve each lock's inputs again, preferring the lock's pins: a consistent lock comes back unchanged
    (a fixed point); a pin its dependents exclude, an extra or a missing package does not. Needs the
    package indexes (or NSA_LOCK_FIND_LINKS for a cell's own index)."""
    uv = uv or uv_bin()
    problems = []
    for t, (out, cell, in_file) in _targets(matrix, targets).items():
        if not out.exists():
            continue  # check() reports it
        text = out.read_text()
        try:
            body = resolve_cell(matrix, cell, uv, text) if cell else resolve_universal(in_file, uv, text)
            problems.extend(f"{t}: {out.name}: {d}" for d in diff_pins(text, body))
        except LockError as e:
            problems.append(f"{t}: {out.name}: {e}")
    return problems


def check_flash_lock(matrix: Matrix, cell: Cell) -> list[str]:
    path, want = flash_lock_path(matrix, cell.id), flash_lock_text(matrix, cell)
    state = ("exists but the cell has no flash-attn" if path.exists() else "") if want is None else \
        "is missing" if not path.exists() else "is stale" if path.read_text() != want else ""
    return [f"{path.name} {state}: run `nox -s lock -- {cell.id}`"] if state else []
