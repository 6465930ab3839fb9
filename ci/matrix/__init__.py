"""Load and validate requirements/matrix.toml, the configuration matrix: the one loader every tool uses.

    python -m ci.matrix validate            # exit 1 and list every problem if a cell cannot exist
    python -m ci.matrix list                # one line per cell
    python -m ci.matrix show CELL [--json]  # one cell: package index, flash-attn pin, and why (upstream facts)
    python -m ci.matrix table [--write]     # the Markdown table of README.md and docs/environments.md

Validation encodes what upstream publishes ([upstream.*] tables of the file) and rejects: a triton outside
the pin of torch's metadata (exact up to torch 2.13, a range such as `~=3.8.0` from 2.14; compared with
packaging's SpecifierSet), a Python or CUDA torch publishes no wheel for, a torch build the cell's package
index does not carry, a flash-attn wheel upstream does not publish (or a wheel name that does not follow
its naming scheme, or one without its sha256; of a release whose wheel set is unknown, a wheel not seen in
use, and malformed `wheels_seen` / `wheels_missing` entries), a flash-attn that cannot compile against the
torch (C++ standard), a GPU cell without flash-attn for no stated reason, GPU architectures the CUDA toolkit cannot
build, a build stage that cannot compile flash-attn or whose OS differs from the run stage's, and ids that
do not follow {cpu|cuXYZ}-torch{M.m}-py{XY}.
To add a field: add it to Cell (with a default), read it in _parse_cell, check it in validate_cell.
Needs `packaging` (requirements/bootstrap.txt) and tomllib (tomli on Python 3.10).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: nox brings tomli (requirements/bootstrap.txt)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = ROOT / "requirements" / "matrix.toml"
FLASH_SOURCES = ("wheel", "source", "none")
TORCH_INDEXES = ("pypi", "pytorch")
PYTORCH_INDEX_ENV = "NSA_PYTORCH_INDEX"  # a mirror of PyTorch's wheel index, same paths


class MatrixError(ValueError):
    """The matrix file is malformed or names a configuration that cannot exist."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{path}: {len(problems)} problem(s):\n{lines}")


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
        v = Version(self.torch_public)
        return f"{v.major}.{v.minor}"

    @property
    def variant(self) -> str:
        """The build variant as PyTorch names it: cpu, cu128, cu130."""
        return "cpu" if self.cuda == "none" else "cu" + self.cuda.replace(".", "")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("raw")
        d["variant"] = self.variant
        return d


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
        known = ", ".join(c.id for c in self.cells)
        raise KeyError(f"unknown cell {cell_id!r}; cells in {self.path.name}: {known}")

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
        url = self.index_url(cell)
        return ["--extra-index-url", url] if url else []

    def min_driver(self, cuda: str) -> tuple[str, str]:
        """(driver of CUDA `cuda`'s GA release, floor through minor-version compatibility)."""
        drivers = self.upstream.get("cuda_driver", {})
        major = cuda.split(".")[0]
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
        if cell.cpu_only:
            return "flash-attn needs CUDA"
        return cell.flash_attn.why or flash_unbuildable(self.upstream, cell.torch_public)


# --- naming ------------------------------------------------------------------------------------------


def expected_cell_id(cell: Cell) -> str:
    return f"{cell.variant}-torch{cell.torch_mm}-py{cell.python.replace('.', '')}"


def flash_wheel_name(version: str, cuda_major: str, torch_mm: str, cxx11abi: bool, python: str) -> str:
    """Upstream's release asset name, e.g. flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-...whl."""
    py = "cp" + python.replace(".", "")
    abi = "TRUE" if cxx11abi else "FALSE"
    return f"flash_attn-{version}+cu{cuda_major}torch{torch_mm}cxx11abi{abi}-{py}-{py}-linux_x86_64.whl"


def flash_wheel_url(upstream: dict[str, Any], version: str, wheel: str) -> str:
    template = upstream.get("flash_attn", {}).get(version, {}).get("url", "")
    # '+' must be percent-encoded in a URL path for pip and GitHub alike.
    return template.format(version=version, wheel=wheel.replace("+", "%2B")) if template else ""


def flash_wheel_published(
    upstream: dict[str, Any], version: str, torch_mm: str, cuda_major: str, python: str, cxx11abi: bool
) -> tuple[bool, str]:
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
    if any(all(wanted.get(k) == v for k, v in inc.items()) for inc in rel.get("include", [])):
        return True, ""
    for key, value, label in (
        ("torch", torch_mm, "torch"),
        ("cuda_major", cuda_major, "CUDA major"),
        ("python", python, "Python"),
    ):
        if value not in rel.get(key, []):
            return False, f"flash-attn {version} publishes no wheel for {label} {value} (only {rel.get(key)})"
    if cxx11abi not in rel.get("cxx11abi", []):
        return False, f"flash-attn {version} publishes no cxx11abi={cxx11abi} wheel"
    for ex in rel.get("exclude", []):
        if all(wanted.get(k) == v for k, v in ex.items()):
            return False, f"flash-attn {version} publishes no wheel for {ex} (excluded upstream)"
    return True, ""


def pin_specifier(pin: str) -> SpecifierSet:
    """torch's triton pin as a SpecifierSet: a bare version ("3.6.0") means ==, else a PEP 440 specifier
    ("~=3.8.0", ">=3.8,<3.9"). The same rule as nsa.upstream.pin_specifier, which ships with nsa; this
    copy keeps ci/ free of importing nsa (and so torch)."""
    pin = pin.strip()
    return SpecifierSet(pin if pin[:1] in "<>=!~" else f"=={pin}")


def cxx_std(entry: dict[str, Any]) -> int:
    """The C++ standard a torch's headers need, or a flash-attn release compiles with (17 when unrecorded)."""
    return int(entry.get("cxx_std", 17))


def flash_unbuildable(upstream: dict[str, Any], torch_public: str) -> str:
    """Why no recorded flash-attn release compiles against this torch ("" when one does)."""
    need = cxx_std(upstream.get("torch", {}).get(torch_public, {}))
    releases = upstream.get("flash_attn", {})
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


# --- parsing -----------------------------------------------------------------------------------------


def _req(d: dict[str, Any], key: str, where: str, problems: list[str], typ: type = str) -> Any:
    if key not in d:
        problems.append(f"{where}: missing field {key!r}")
        return typ()
    if not isinstance(d[key], typ):
        problems.append(f"{where}: field {key!r} must be a {typ.__name__}, got {d[key]!r}")
        return typ()
    return d[key]


def _parse_cell(d: dict[str, Any], index: int, problems: list[str]) -> Cell:
    where = f"cell #{index + 1} ({d.get('id', '?')})"
    fa = d.get("flash_attn", {"source": "none"})
    if not isinstance(fa, dict):
        problems.append(f"{where}: field 'flash_attn' must be a table")
        fa = {"source": "none"}
    return Cell(
        id=_req(d, "id", where, problems),
        python=_req(d, "python", where, problems),
        cuda=_req(d, "cuda", where, problems),
        cpu_only=_req(d, "cpu_only", where, problems, bool),
        torch=_req(d, "torch", where, problems),
        triton=_req(d, "triton", where, problems),
        flash_attn=FlashAttn(**{k: str(fa.get(k, "")) for k in ("source", "version", "wheel", "sha256", "why")}),
        gpu_archs=tuple(_req(d, "gpu_archs", where, problems, list)),
        base_image=_req(d, "base_image", where, problems),
        runtime_image=_req(d, "runtime_image", where, problems),
        torch_index=_req(d, "torch_index", where, problems),
        description=str(d.get("description", "")),
        pins=tuple(d.get("pins", [])),
        torch_sha256=str(d.get("torch_sha256", "")),
        raw=d,
    )


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
    if not problems:
        problems = validate(matrix)
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


# --- validation --------------------------------------------------------------------------------------


def _is_sha256(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def validate_cell(cell: Cell, upstream: dict[str, Any]) -> list[str]:
    """Every reason this cell cannot exist (empty when it can)."""
    p: list[str] = []
    w = f"cell {cell.id}"
    try:
        Version(cell.torch)
    except InvalidVersion:
        return [f"{w}: torch {cell.torch!r} is not a version"]

    t = upstream.get("torch", {}).get(cell.torch_public)
    if t is None:
        known = ", ".join(upstream.get("torch", {}))
        return [
            f"{w}: torch {cell.torch_public} is not in [upstream.torch] (known: {known}); add its facts first"
        ]

    if cell.id != expected_cell_id(cell):
        p.append(f"{w}: id must be {expected_cell_id(cell)!r} (from its cuda, torch and python)")
    if cell.python not in t["python"]:
        p.append(
            f"{w}: torch {cell.torch_public} publishes no wheel for Python {cell.python} (only {t['python']})"
        )

    p.extend(_validate_triton(cell, t))

    # Which index carries this torch: PyPI has one CUDA build per release and no local labels.
    local = cell.torch.split("+", 1)[1] if "+" in cell.torch else ""
    if cell.torch_index not in TORCH_INDEXES:
        p.append(f"{w}: torch_index must be one of {TORCH_INDEXES}, not {cell.torch_index!r}")
    elif local and cell.torch_index != "pytorch":
        p.append(f"{w}: torch {cell.torch} is not on PyPI: set torch_index = 'pytorch' (PyTorch's {local} index)")
    elif not local and cell.torch_index == "pytorch":
        p.append(f"{w}: PyTorch's index names its builds {cell.torch}+{cell.variant}: pin that, or use 'pypi'")
    elif not local and not cell.cpu_only and cell.cuda != t["pypi_cuda"]:
        p.append(
            f"{w}: PyPI's torch {cell.torch_public} is the CUDA {t['pypi_cuda']} build; CUDA {cell.cuda} "
            f"needs torch = '{cell.torch_public}+{cell.variant}' from torch_index = 'pytorch'"
        )

    # CPU vs CUDA consistency.
    if cell.cpu_only:
        if cell.cuda != "none":
            p.append(f"{w}: cpu_only cells must have cuda = 'none', not {cell.cuda!r}")
        if local != "cpu":
            p.append(f"{w}: a cpu_only cell must use the CPU build of torch ({cell.torch_public}+cpu)")
        if "cpu" not in t["cuda"]:
            p.append(f"{w}: torch {cell.torch_public} has no CPU build")
        if cell.gpu_archs:
            p.append(f"{w}: cpu_only cells build for no GPU architecture (gpu_archs must be empty)")
        if cell.flash_attn.source != "none":
            p.append(f"{w}: flash-attn needs CUDA; a cpu_only cell must have flash_attn.source = 'none'")
    else:
        if cell.cuda == "none":
            p.append(f"{w}: a GPU cell needs a CUDA version (or set cpu_only = true)")
        elif cell.cuda not in t["cuda"]:
            p.append(f"{w}: torch {cell.torch_public} is not built for CUDA {cell.cuda} (only {t['cuda']})")
        if local and local != cell.variant:
            p.append(f"{w}: torch local label +{local} does not match CUDA {cell.cuda} ({cell.variant})")
        supported = upstream.get("cuda", {}).get(cell.cuda)
        if supported is None:
            p.append(f"{w}: CUDA {cell.cuda} is not in [upstream.cuda]")
        else:
            bad = [a for a in cell.gpu_archs if a not in supported]
            if bad:
                p.append(f"{w}: CUDA {cell.cuda} cannot build for sm {bad} (supports {supported})")
        if not cell.gpu_archs:
            p.append(f"{w}: a GPU cell must list gpu_archs")
        if cell.cuda.split(".")[0] not in upstream.get("driver", {}):
            p.append(f"{w}: CUDA major {cell.cuda.split('.')[0]} has no driver floor in [upstream.driver]")

    if local and not _is_sha256(cell.torch_sha256):
        p.append(f"{w}: torch {cell.torch} is not on PyPI: record its wheel's sha256 as torch_sha256")
    if cell.torch_sha256 and not _is_sha256(cell.torch_sha256):
        p.append(f"{w}: torch_sha256 must be 64 lowercase hex digits")

    # The run stage receives the build stage's venv, whose interpreter must be at the same path.
    build_os, run_os = image_os(cell.base_image), image_os(cell.runtime_image)
    if build_os and run_os and build_os != run_os:
        p.append(f"{w}: base_image is {build_os} but runtime_image is {run_os}: the venv would not run there")
    if cell.flash_attn.source == "source" and "-devel" not in cell.base_image:
        p.append(f"{w}: flash-attn is compiled in the build stage: base_image must be a CUDA -devel image (nvcc)")

    p.extend(_validate_flash(cell, upstream, t))
    return p


def _validate_triton(cell: Cell, t: dict[str, Any]) -> list[str]:
    """The cell's triton: one exact version inside torch's pin ("none" where torch requires no triton for
    the cell's Python)."""
    w, pin = f"cell {cell.id}", str(t["triton"])
    below = t.get("triton_python_below")
    if pin == "none" or (below and Version(cell.python) >= Version(below)):
        return [] if cell.triton == "none" else [
            f"{w}: torch {cell.torch_public} requires no triton on Python {cell.python}: triton must be 'none'"]
    try:
        spec = pin_specifier(pin)
    except InvalidSpecifier:
        return [f"{w}: [upstream.torch.\"{cell.torch_public}\"] triton {pin!r} is neither a version nor a specifier"]
    try:
        exact = Version(cell.triton)
    except InvalidVersion:
        return [f"{w}: triton must be an exact version inside torch {cell.torch_public}'s pin triton{spec}, "
                f"not {cell.triton!r}"]
    if not spec.contains(exact, prereleases=True):
        return [f"{w}: triton {cell.triton} is outside torch {cell.torch_public}'s pin triton{spec}"]
    return []


def _validate_flash(cell: Cell, upstream: dict[str, Any], t: dict[str, Any]) -> list[str]:
    fa, w, p = cell.flash_attn, f"cell {cell.id}", []
    if fa.source not in FLASH_SOURCES:
        return [f"{w}: flash_attn.source must be one of {FLASH_SOURCES}, not {fa.source!r}"]
    if fa.source == "none":
        if not cell.cpu_only and not fa.why and not flash_unbuildable(upstream, cell.torch_public):
            return [f"{w}: a GPU cell pins flash-attn (a wheel or the source build); say why it has none "
                    "(flash_attn.why)"]
        return []
    if not fa.version:
        return [f"{w}: flash_attn.version is required when flash_attn.source = {fa.source!r}"]
    rel = upstream.get("flash_attn", {}).get(fa.version, {})
    if cxx_std(rel) < cxx_std(t):
        p.append(f"{w}: flash-attn {fa.version} compiles with -std=c++{cxx_std(rel)}, torch {cell.torch_public}'s "
                 f"headers need C++{cxx_std(t)}: it cannot be built or loaded against this torch")
    min_sm = rel.get("min_sm")
    if min_sm:
        low = [a for a in cell.gpu_archs if Version(a) < Version(min_sm)]
        if low:
            p.append(f"{w}: FlashAttention-2 needs sm >= {min_sm}; drop {low} from gpu_archs")
    if fa.source == "source":
        if fa.wheel or fa.sha256:
            p.append(f"{w}: flash_attn.source = 'source' takes no wheel/sha256")
        if not _is_sha256(str(rel.get("sdist_sha256", ""))):
            p.append(f"{w}: flash-attn {fa.version}'s source package has no sdist_sha256 in [upstream.flash_attn]")
        return p
    # source == "wheel": upstream must publish exactly this file.
    cuda_major = cell.cuda.split(".")[0]
    ok, why = flash_wheel_published(
        upstream, fa.version, cell.torch_mm, cuda_major, cell.python, t["cxx11abi"]
    )
    if not ok:
        p.append(f"{w}: {why}; use flash_attn.source = 'source' (built in the image)")
        return p
    expected = flash_wheel_name(fa.version, cuda_major, cell.torch_mm, t["cxx11abi"], cell.python)
    if fa.wheel != expected:
        p.append(
            f"{w}: flash_attn.wheel must be {expected!r} (upstream's name for this torch/CUDA/Python/ABI)"
        )
    if not _is_sha256(fa.sha256):
        p.append(f"{w}: flash_attn.sha256 must be the wheel's sha256 (64 lowercase hex digits); where it cannot "
                 "be obtained, pin the source package instead (flash_attn.source = 'source')")
    return p


WHEEL_KEYS = {"torch": str, "cuda_major": str, "python": str, "cxx11abi": bool}


def _validate_wheel_lists(version: str, rel: dict[str, Any]) -> list[str]:
    """wheels_seen / wheels_missing of a flash-attn release: whole wheel descriptions, in one list at most."""
    p, w = [], f"upstream.flash_attn.{version}"
    for key in ("wheels_seen", "wheels_missing"):
        for entry in rel.get(key, []):
            if not isinstance(entry, dict) or set(entry) != set(WHEEL_KEYS) or not all(
                    isinstance(entry[k], t) for k, t in WHEEL_KEYS.items()):
                p.append(f"{w}: {key} entry {entry!r} must have exactly torch, cuda_major, python (strings) "
                         "and cxx11abi (true/false)")
    both = [e for e in rel.get("wheels_seen", []) if e in rel.get("wheels_missing", [])]
    if both:
        p.append(f"{w}: {both} are both in wheels_seen and wheels_missing")
    return p


def validate(matrix: Matrix) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for c in matrix.cells:
        if c.id in seen:
            problems.append(f"cell {c.id}: duplicate id")
        seen.add(c.id)
        problems.extend(validate_cell(c, matrix.upstream))
    for version, rel in matrix.upstream.get("torch", {}).items():
        extra = set(rel.get("cuda_experimental", [])) - set(rel.get("cuda", []))
        if extra:
            problems.append(f"upstream.torch.{version}: cuda_experimental {sorted(extra)} not in its cuda list")
    for version, rel in matrix.upstream.get("flash_attn", {}).items():
        problems.extend(_validate_wheel_lists(version, rel))
    for py, cell_id in matrix.quickstart.items():
        cell = next((c for c in matrix.cells if c.id == cell_id), None)
        if cell is None or cell.python != py:
            problems.append(f"defaults.quickstart: Python {py} needs a cell for Python {py}, not {cell_id!r}")
    for layer in matrix.layers:
        if not (matrix.path.parent / f"{layer}.in").exists() and matrix.path.name == "matrix.toml":
            problems.append(
                f"defaults.layers names {layer!r} but {layer}.in does not exist beside the matrix"
            )
    return problems
