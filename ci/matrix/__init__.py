"""Load and validate requirements/matrix.toml, the configuration matrix: the one loader every tool uses (its
command line is ci/matrix/__main__.py). Validation rejects what the file's [upstream.*] facts rule out: a triton
outside torch's pin, a Python, CUDA or index without that torch, a flash-attn wheel upstream does not publish (or
misnamed, or without its sha256), a flash-attn that cannot compile against the torch, a GPU cell without flash-attn
for no stated reason, GPU archs the toolkit cannot build, images that cannot build or run the cell, ids other than
{cpu|cuXYZ}-torch{M.m}-py{XY}. New fields go into Cell (and REQUIRED without a default), their rules into validate_cell.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

# torch's triton pin as a SpecifierSet: the rule nsa-env applies to an installed triton (no torch import).
from nsa_env.upstream import pin_specifier  # noqa: F401  (ci.matrix.pin_specifier for explain.py)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: nox brings tomli (requirements/bootstrap.txt)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = ROOT / "requirements" / "matrix.toml"
FLASH_SOURCES = ("wheel", "source", "none")
TORCH_INDEXES = ("pypi", "pytorch")
PYTORCH_INDEX_ENV = "NSA_PYTORCH_INDEX"  # a mirror of PyTorch's wheel index, same paths
# The fields a [[cell]] must have, with their TOML types, in the order problems are reported.
REQUIRED = {"id": str, "python": str, "cuda": str, "cpu_only": bool, "torch": str, "triton": str, "gpu_archs": list,
            "base_image": str, "runtime_image": str, "torch_index": str}
SHA256 = re.compile("[0-9a-f]{64}")  # lowercase hex, as pip and the locks write it
WHEEL_KEYS = {"torch": str, "cuda_major": str, "python": str, "cxx11abi": bool}  # one flash-attn wheel


class MatrixError(ValueError):
    """The matrix file is malformed or names a configuration that cannot exist."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{path}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class FlashAttn:
    source: str  # "wheel" | "source" | "none"
    version: str = ""
    wheel: str = ""
    sha256: str = ""  # the wheel's (required with source = "wheel")
    why: str = ""  # why a GPU cell has none, where the matrix cannot derive it


@dataclass(frozen=True)
class Cell:
    id: str
    python: str
    cuda: str  # "none" for CPU cells, else "12.8"
    cpu_only: bool
    torch: str
    triton: str
    flash_attn: FlashAttn
    gpu_archs: tuple[str, ...]
    base_image: str
    runtime_image: str
    torch_index: str = "pypi"  # "pypi" | "pytorch"
    description: str = ""
    pins: tuple[str, ...] = ()
    torch_sha256: str = ""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def torch_public(self) -> str:
        """torch's version without the local label: 2.13.0+cpu -> 2.13.0."""
        return self.torch.split("+", 1)[0]

    @property
    def torch_mm(self) -> str:
        return "{0.major}.{0.minor}".format(Version(self.torch_public))

    @property
    def cuda_major(self) -> str:
        return self.cuda.split(".")[0]

    @property
    def variant(self) -> str:
        """The build variant as PyTorch names it: cpu, cu128, cu130."""
        return "cpu" if self.cuda == "none" else "cu" + self.cuda.replace(".", "")


@dataclass
class Matrix:
    path: Path
    defaults: dict[str, Any]
    upstream: dict[str, Any]
    cells: list[Cell]

    def get(self, cell_id: str) -> Cell:
        for c in self.cells:
            if c.id == cell_id:
                return c
        raise KeyError(f"unknown cell {cell_id!r}; cells in {self.path.name}: {', '.join(c.id for c in self.cells)}")

    @property
    def platform(self) -> str:
        return self.defaults.get("platform", "x86_64-manylinux_2_28")

    @property
    def layers(self) -> list[str]:
        return list(self.defaults.get("layers", ["runtime", "test", "bench"]))

    @property
    def quickstart(self) -> dict[str, str]:
        """Python "3.X" -> the cell the Quick start installs for it."""
        return dict(self.defaults.get("quickstart", {}))

    def index_url(self, cell: Cell, environ=os.environ) -> str:
        """The extra package index the cell's torch needs ("" for PyPI); NSA_PYTORCH_INDEX is a mirror."""
        if cell.torch_index != "pytorch":
            return ""
        base = environ.get(PYTORCH_INDEX_ENV) or self.defaults.get("pytorch_index", "")
        return f"{base.rstrip('/')}/{cell.variant}"

    def pip_index_args(self, cell: Cell) -> list[str]:
        """What every `pip install -r <cell lock>` adds so that pip can find the cell's torch."""
        return ["--extra-index-url", url] if (url := self.index_url(cell)) else []

    def min_driver(self, cuda: str) -> tuple[str, str]:
        """(driver of CUDA `cuda`'s GA release, floor through minor-version compatibility)."""
        drivers, major = self.upstream.get("cuda_driver", {}), cuda.split(".")[0]
        floor = self.upstream.get("driver", {}).get(major)
        same_major = sorted((v for v in drivers if v.split(".")[0] == major), key=Version)
        if floor is None or not same_major:
            raise KeyError(f"CUDA {cuda}: no driver facts in [upstream.cuda_driver] (majors: {sorted(drivers)})")
        return drivers.get(cuda, drivers[same_major[-1]]), floor

    def flash_wheel_url(self, cell: Cell) -> str:
        fa = cell.flash_attn
        return flash_wheel_url(self.upstream, fa.version, fa.wheel) if fa.source == "wheel" else ""

    def flash_sdist_sha256(self, version: str) -> str:
        """sha256 of flash-attn `version`'s source package on PyPI ("" where not recorded)."""
        return str(self.upstream.get("flash_attn", {}).get(version, {}).get("sdist_sha256", ""))

    def flash_none_reason(self, cell: Cell) -> str:
        """Why a cell has no flash-attn: its own `why`, else derived from the facts ("" where none applies)."""
        if cell.flash_attn.source != "none":
            return ""
        return "flash-attn needs CUDA" if cell.cpu_only else (
            cell.flash_attn.why or flash_unbuildable(self.upstream, cell.torch_public))


def flash_wheel_name(version: str, cuda_major: str, torch_mm: str, cxx11abi: bool, python: str) -> str:
    """Upstream's release asset name, e.g. flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-...whl."""
    py, abi = "cp" + python.replace(".", ""), "TRUE" if cxx11abi else "FALSE"
    return f"flash_attn-{version}+cu{cuda_major}torch{torch_mm}cxx11abi{abi}-{py}-{py}-linux_x86_64.whl"


def flash_wheel_url(upstream: dict[str, Any], version: str, wheel: str) -> str:
    template = upstream.get("flash_attn", {}).get(version, {}).get("url", "")
    # '+' must be percent-encoded in a URL path for pip and GitHub alike.
    return template.format(version=version, wheel=wheel.replace("+", "%2B")) if template else ""


def flash_wheel_published(upstream: dict[str, Any], version: str, torch_mm: str, cuda_major: str, python: str,
                          cxx11abi: bool) -> tuple[bool, str]:
    """Whether upstream publishes a wheel for this combination, and why not."""
    rel = upstream.get("flash_attn", {}).get(version)
    if rel is None:
        known = ", ".join(sorted(upstream.get("flash_attn", {}))) or "none"
        return False, f"flash-attn {version} is not in [upstream.flash_attn] (known: {known})"
    wanted = {"torch": torch_mm, "cuda_major": cuda_major, "python": python, "cxx11abi": cxx11abi}
    if rel.get("wheels_unknown"):
        # The full set is unknown; single wheels may have been seen (or seen missing) elsewhere.
        if wanted in rel.get("wheels_seen", []):
            return True, ""
        seen = "seen missing" if wanted in rel.get("wheels_missing", []) else "not among the wheels seen"
        return False, (f"flash-attn {version}'s upstream wheel set is not recorded ({rel['wheels_unknown']}); "
                       f"torch {torch_mm} / CUDA {cuda_major} / CPython {python} / cxx11abi={cxx11abi} is {seen}")
    # An include or exclude entry names part of a wheel's description: it matches where its items are wanted's.
    if any(e.items() <= wanted.items() for e in rel.get("include", [])):
        return True, ""
    for key, label in (("torch", "torch"), ("cuda_major", "CUDA major"), ("python", "Python")):
        if wanted[key] not in rel.get(key, []):
            return False, f"flash-attn {version} publishes no wheel for {label} {wanted[key]} (only {rel.get(key)})"
    if cxx11abi not in rel.get("cxx11abi", []):
        return False, f"flash-attn {version} publishes no cxx11abi={cxx11abi} wheel"
    excluded = next((e for e in rel.get("exclude", []) if e.items() <= wanted.items()), None)
    if excluded is not None:
        return False, f"flash-attn {version} publishes no wheel for {excluded} (excluded upstream)"
    return True, ""


def cxx_std(entry: dict[str, Any]) -> int:
    """The C++ standard a torch's headers need, or a flash-attn release compiles with (17 when unrecorded)."""
    return int(entry.get("cxx_std", 17))


def flash_unbuildable(upstream: dict[str, Any], torch_public: str) -> str:
    """Why no recorded flash-attn release compiles against this torch ("" when one does)."""
    need, releases = cxx_std(upstream.get("torch", {}).get(torch_public, {})), upstream.get("flash_attn", {})
    if not releases or any(cxx_std(rel) >= need for rel in releases.values()):
        return ""
    newest = max(releases, key=Version)
    return (f"no flash-attn release compiles against torch {torch_public}: its headers need C++{need}, "
            f"flash-attn {newest} builds with -std=c++{cxx_std(releases[newest])}; torch's built-in FA-2 "
            "(the torch_flash backend) serves NSA")


def image_os(image: str) -> str | None:
    """'ubuntu24.04' for ubuntu:24.04 and nvidia/cuda:*-ubuntu24.04; None where the tag does not say."""
    m = re.fullmatch(r"ubuntu:(\d+\.\d+)", image) or re.search(r"-ubuntu(\d+\.\d+)$", image)
    return f"ubuntu{m.group(1)}" if m else None


def _parse_cell(d: dict[str, Any], index: int, problems: list[str]) -> Cell:
    where = f"cell #{index + 1} ({d.get('id', '?')})"
    fa = d.get("flash_attn", {"source": "none"})
    if not isinstance(fa, dict):
        problems.append(f"{where}: field 'flash_attn' must be a table")
        fa = {"source": "none"}
    problems += [f"{where}: missing field {key!r}" if key not in d else
                 f"{where}: field {key!r} must be a {typ.__name__}, got {d[key]!r}"
                 for key, typ in REQUIRED.items() if not isinstance(d.get(key), typ)]
    req = {key: d[key] if isinstance(d.get(key), typ) else typ() for key, typ in REQUIRED.items()}
    return Cell(**{**req, "gpu_archs": tuple(req["gpu_archs"])}, raw=d,
                flash_attn=FlashAttn(**{f.name: str(fa.get(f.name, "")) for f in fields(FlashAttn)}),
                description=str(d.get("description", "")), pins=tuple(d.get("pins", [])),
                torch_sha256=str(d.get("torch_sha256", "")))


def parse(data: dict[str, Any], path: Path | str = "<matrix>") -> Matrix:
    """Build a Matrix from parsed TOML and validate it; raises MatrixError listing every problem."""
    problems: list[str] = []
    if data.get("schema") != 1:
        problems.append(f"schema must be 1, got {data.get('schema')!r}")
    raw_cells = data.get("cell", [])
    if not isinstance(raw_cells, list) or not raw_cells:
        problems.append("no [[cell]] entries")
        raw_cells = []
    cells = [_parse_cell(d, i, problems) for i, d in enumerate(raw_cells)]
    matrix = Matrix(Path(path), dict(data.get("defaults", {})), dict(data.get("upstream", {})), cells)
    problems = problems or validate(matrix)
    if problems:
        raise MatrixError(path, problems)
    return matrix


def load(path: Path | str = DEFAULT_PATH) -> Matrix:
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise MatrixError(path, ["file not found"]) from None
    except tomllib.TOMLDecodeError as e:
        raise MatrixError(path, [f"not valid TOML: {e}"]) from None
    return parse(data, path)


def validate_cell(c: Cell, upstream: dict[str, Any]) -> list[str]:
    """Every reason this cell cannot exist (empty when it can)."""
    try:
        Version(c.torch)
    except InvalidVersion:
        return [f"cell {c.id}: torch {c.torch!r} is not a version"]
    t = upstream.get("torch", {}).get(c.torch_public)
    if t is None:
        return [f"cell {c.id}: torch {c.torch_public} is not in [upstream.torch] "
                f"(known: {', '.join(upstream.get('torch', {}))}); add its facts first"]
    expected_id = f"{c.variant}-torch{c.torch_mm}-py{c.python.replace('.', '')}"
    local = c.torch.split("+", 1)[1] if "+" in c.torch else ""
    supported = upstream.get("cuda", {}).get(c.cuda)
    bad_archs = [a for a in c.gpu_archs if a not in (supported or [])]
    build_os, run_os = image_os(c.base_image), image_os(c.runtime_image)
    rules = [(c.id != expected_id, f"id must be {expected_id!r} (from its cuda, torch and python)"),
        (c.python not in t["python"],
         f"torch {c.torch_public} publishes no wheel for Python {c.python} (only {t['python']})"),
        *((True, m) for m in _triton_problems(c, t)),
        # Which index carries this torch: PyPI has one CUDA build per release and no local labels.
        (c.torch_index not in TORCH_INDEXES, f"torch_index must be one of {TORCH_INDEXES}, not {c.torch_index!r}"),
        (local and c.torch_index == "pypi",
         f"torch {c.torch} is not on PyPI: set torch_index = 'pytorch' (PyTorch's {local} index)"),
        (not local and c.torch_index == "pytorch",
         f"PyTorch's index names its builds {c.torch}+{c.variant}: pin that, or use 'pypi'"),
        (not local and c.torch_index == "pypi" and not c.cpu_only and c.cuda != t["pypi_cuda"],
         f"PyPI's torch {c.torch_public} is the CUDA {t.get('pypi_cuda')} build; CUDA {c.cuda} needs "
         f"torch = '{c.torch_public}+{c.variant}' from torch_index = 'pytorch'"),
    ]
    rules += [(c.cuda != "none", f"cpu_only cells must have cuda = 'none', not {c.cuda!r}"),
        (local != "cpu", f"a cpu_only cell must use the CPU build of torch ({c.torch_public}+cpu)"),
        ("cpu" not in t["cuda"], f"torch {c.torch_public} has no CPU build"),
        (c.gpu_archs, "cpu_only cells build for no GPU architecture (gpu_archs must be empty)"),
        (c.flash_attn.source != "none", "flash-attn needs CUDA; a cpu_only cell must have flash_attn.source = 'none'"),
    ] if c.cpu_only else [(c.cuda == "none", "a GPU cell needs a CUDA version (or set cpu_only = true)"),
        (c.cuda != "none" and c.cuda not in t["cuda"],
         f"torch {c.torch_public} is not built for CUDA {c.cuda} (only {t.get('cuda')})"),
        (local and local != c.variant, f"torch local label +{local} does not match CUDA {c.cuda} ({c.variant})"),
        (supported is None, f"CUDA {c.cuda} is not in [upstream.cuda]"),
        (supported is not None and bad_archs, f"CUDA {c.cuda} cannot build for sm {bad_archs} (supports {supported})"),
        (not c.gpu_archs, "a GPU cell must list gpu_archs"), (c.cuda_major not in upstream.get("driver", {}),
         f"CUDA major {c.cuda_major} has no driver floor in [upstream.driver]"),
    ]
    rules += [(local and not SHA256.fullmatch(c.torch_sha256),
         f"torch {c.torch} is not on PyPI: record its wheel's sha256 as torch_sha256"),
        (c.torch_sha256 and not SHA256.fullmatch(c.torch_sha256), "torch_sha256 must be 64 lowercase hex digits"),
        # The run stage receives the build stage's venv, whose interpreter must be at the same path.
        (build_os and run_os and build_os != run_os,
         f"base_image is {build_os} but runtime_image is {run_os}: the venv would not run there"),
        (c.flash_attn.source == "source" and "-devel" not in c.base_image,
         "flash-attn is compiled in the build stage: base_image must be a CUDA -devel image (nvcc)"),
        *((True, m) for m in _flash_problems(c, upstream, t)),
    ]
    return [f"cell {c.id}: {m}" for bad, m in rules if bad]


def _triton_problems(c: Cell, t: dict[str, Any]) -> list[str]:
    """The cell's triton: one exact version in torch's pin ("none" where torch requires none for the Python)."""
    pin, below = str(t["triton"]), t.get("triton_python_below")
    if pin == "none" or (below and Version(c.python) >= Version(below)):
        return [] if c.triton == "none" else [
            f"torch {c.torch_public} requires no triton on Python {c.python}: triton must be 'none'"]
    try:
        spec = pin_specifier(pin)
    except ValueError:
        return [f"[upstream.torch.\"{c.torch_public}\"] triton {pin!r} is neither a version nor a specifier"]
    try:
        exact = Version(c.triton)
    except InvalidVersion:
        return [f"triton must be an exact version inside torch {c.torch_public}'s pin triton{spec}, "
                f"not {c.triton!r}"]
    return [] if spec.contains(exact, prereleases=True) else [
        f"triton {c.triton} is outside torch {c.torch_public}'s pin triton{spec}"]


def _flash_problems(c: Cell, upstream: dict[str, Any], t: dict[str, Any]) -> list[str]:
    fa = c.flash_attn
    if fa.source not in FLASH_SOURCES:
        return [f"flash_attn.source must be one of {FLASH_SOURCES}, not {fa.source!r}"]
    if fa.source == "none":
        unexplained = not c.cpu_only and not fa.why and not flash_unbuildable(upstream, c.torch_public)
        return ["a GPU cell pins flash-attn (a wheel or the source build); say why it has none (flash_attn.why)"
                ] if unexplained else []
    if not fa.version:
        return [f"flash_attn.version is required when flash_attn.source = {fa.source!r}"]
    rel = upstream.get("flash_attn", {}).get(fa.version, {})
    low = [a for a in c.gpu_archs if rel.get("min_sm") and Version(a) < Version(rel["min_sm"])]
    rules = [(cxx_std(rel) < cxx_std(t), f"flash-attn {fa.version} compiles with -std=c++{cxx_std(rel)}, torch "
         f"{c.torch_public}'s headers need C++{cxx_std(t)}: it cannot be built or loaded against this torch"),
        (low, f"FlashAttention-2 needs sm >= {rel.get('min_sm')}; drop {low} from gpu_archs"),
    ]
    if fa.source == "source":
        rules += [(fa.wheel or fa.sha256, "flash_attn.source = 'source' takes no wheel/sha256"),
                  (not SHA256.fullmatch(str(rel.get("sdist_sha256", ""))),
                   f"flash-attn {fa.version}'s source package has no sdist_sha256 in [upstream.flash_attn]")]
    else:  # a wheel: upstream must publish exactly this file
        ok, why = flash_wheel_published(upstream, fa.version, c.torch_mm, c.cuda_major, c.python, t["cxx11abi"])
        expected = flash_wheel_name(fa.version, c.cuda_major, c.torch_mm, t["cxx11abi"], c.python)
        rules += [(True, f"{why}; use flash_attn.source = 'source' (built in the image)")] if not ok else [
            (fa.wheel != expected, f"flash_attn.wheel must be {expected!r} (upstream's name for this "
             "torch/CUDA/Python/ABI)"),
            (not SHA256.fullmatch(fa.sha256), "flash_attn.sha256 must be the wheel's sha256 (64 lowercase hex "
             "digits); where it cannot be obtained, pin the source package instead (flash_attn.source = 'source')"),
        ]
    return [m for bad, m in rules if bad]


def validate(matrix: Matrix) -> list[str]:
    """Every problem of the matrix: its cells, the consistency of its upstream facts, its defaults."""
    problems: list[str] = []
    for i, c in enumerate(matrix.cells):
        if any(o.id == c.id for o in matrix.cells[:i]):
            problems.append(f"cell {c.id}: duplicate id")
        problems.extend(validate_cell(c, matrix.upstream))
    for version, rel in matrix.upstream.get("torch", {}).items():
        extra = set(rel.get("cuda_experimental", [])) - set(rel.get("cuda", []))
        if extra:
            problems.append(f"upstream.torch.{version}: cuda_experimental {sorted(extra)} not in its cuda list")
    for version, rel in matrix.upstream.get("flash_attn", {}).items():
        for key in ("wheels_seen", "wheels_missing"):  # whole wheel descriptions, in one list at most
            problems += [f"upstream.flash_attn.{version}: {key} entry {e!r} must have exactly torch, cuda_major, "
                         "python (strings) and cxx11abi (true/false)" for e in rel.get(key, [])
                         if not isinstance(e, dict) or set(e) != set(WHEEL_KEYS)
                         or not all(isinstance(e[k], t) for k, t in WHEEL_KEYS.items())]
        both = [e for e in rel.get("wheels_seen", []) if e in rel.get("wheels_missing", [])]
        if both:
            problems.append(f"upstream.flash_attn.{version}: {both} are both in wheels_seen and wheels_missing")
    problems += [f"defaults.quickstart: Python {py} needs a cell for Python {py}, not {cell_id!r}"
                 for py, cell_id in matrix.quickstart.items()
                 if next((c.python for c in matrix.cells if c.id == cell_id), None) != py]
    return problems + [f"defaults.layers names {layer!r} but {layer}.in does not exist beside the matrix"
                       for layer in matrix.layers
                       if matrix.path.name == "matrix.toml" and not (matrix.path.parent / f"{layer}.in").exists()]


def universal_targets(matrix: Matrix) -> dict[str, tuple[Path, Path]]:
    """Locks that are not cells (bootstrap, developer tools, lint): name -> (input, lock), from the
    matrix's [defaults.tool_locks] (paths relative to requirements/)."""
    req = matrix.path.parent
    table = matrix.defaults.get("tool_locks", {"bootstrap": "bootstrap.txt"})
    return {name: (req / f"{name}.in", req / rel) for name, rel in table.items()}
