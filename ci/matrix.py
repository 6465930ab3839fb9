"""Load and validate requirements/matrix.toml, the configuration matrix.

    python -m ci.matrix validate            # exit 1 and list every problem if a cell cannot exist
    python -m ci.matrix list                # one line per cell
    python -m ci.matrix show CELL [--json]  # one cell, with its flash-attn wheel URL
    python -m ci.matrix github [--gpu|--cpu]  # JSON {"include": [...]} for a GitHub Actions matrix

Validation encodes what upstream publishes ([upstream.*] tables of the file) and rejects: a triton other
than the one torch pins, a Python or CUDA torch publishes no wheel for, a flash-attn wheel upstream does
not publish (or a wheel name that does not follow its naming scheme), GPU architectures the CUDA toolkit
cannot build, and ids that do not follow {cpu|cuXYZ}-torch{M.m}-py{XY}.
Needs Python >= 3.11 (tomllib) and `packaging` (installed by requirements/bootstrap.txt).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomllib
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATH = ROOT / "requirements" / "matrix.toml"
FLASH_SOURCES = ("wheel", "source", "none")


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
    sha256: str = ""  # "" = not recorded yet (filled after the image build downloads the wheel)


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
    description: str = ""
    pins: tuple[str, ...] = ()
    torch_sha256: str = ""
    torch_index: str = ""
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
        wanted = {"torch": torch_mm, "cuda_major": cuda_major, "python": python}
        if all(wanted.get(k) == v for k, v in ex.items()):
            return False, f"flash-attn {version} publishes no wheel for {ex} (excluded upstream)"
    return True, ""


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
        flash_attn=FlashAttn(
            source=str(fa.get("source", "")),
            version=str(fa.get("version", "")),
            wheel=str(fa.get("wheel", "")),
            sha256=str(fa.get("sha256", "")),
        ),
        gpu_archs=tuple(_req(d, "gpu_archs", where, problems, list)),
        base_image=_req(d, "base_image", where, problems),
        runtime_image=_req(d, "runtime_image", where, problems),
        description=str(d.get("description", "")),
        pins=tuple(d.get("pins", [])),
        torch_sha256=str(d.get("torch_sha256", "")),
        torch_index=str(d.get("torch_index", "")),
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


def load_cells(path: Path | str = DEFAULT_PATH) -> list[dict[str, Any]]:
    """The validated cells as plain dicts (what ci/gh_matrix.py and other readers consume)."""
    m = load(path)
    out = []
    for c in m.cells:
        d = c.to_json()
        d["gpu_archs"] = list(c.gpu_archs)
        d["pins"] = list(c.pins)
        if c.flash_attn.source == "wheel":
            d["flash_attn"]["url"] = flash_wheel_url(m.upstream, c.flash_attn.version, c.flash_attn.wheel)
        out.append(d)
    return out


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

    # triton: exactly torch's own pin, or none where torch's metadata requires none for this Python.
    below = t.get("triton_python_below")
    pinned = t["triton"]
    if below and Version(cell.python) >= Version(below):
        pinned = "none"
    if cell.triton != pinned:
        p.append(
            f"{w}: triton must be {pinned!r}, the version torch {cell.torch_public} pins, not {cell.triton!r}"
        )

    # CPU vs CUDA consistency.
    local = cell.torch.split("+", 1)[1] if "+" in cell.torch else ""
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
        elif cell.cuda != t["pypi_cuda"] and not cell.torch_index:
            p.append(
                f"{w}: PyPI's torch {cell.torch_public} is the CUDA {t['pypi_cuda']} build; CUDA {cell.cuda} "
                f"needs torch_index (PyTorch's cu{cell.cuda.replace('.', '')} index)"
            )
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

    if local and not _is_sha256(cell.torch_sha256):
        p.append(f"{w}: torch {cell.torch} is not on PyPI: record its wheel's sha256 as torch_sha256")
    if cell.torch_sha256 and not _is_sha256(cell.torch_sha256):
        p.append(f"{w}: torch_sha256 must be 64 lowercase hex digits")

    p.extend(_validate_flash(cell, upstream, t))
    return p


def _validate_flash(cell: Cell, upstream: dict[str, Any], t: dict[str, Any]) -> list[str]:
    fa, w, p = cell.flash_attn, f"cell {cell.id}", []
    if fa.source not in FLASH_SOURCES:
        return [f"{w}: flash_attn.source must be one of {FLASH_SOURCES}, not {fa.source!r}"]
    if fa.source == "none":
        return []
    if not fa.version:
        return [f"{w}: flash_attn.version is required when flash_attn.source = {fa.source!r}"]
    rel = upstream.get("flash_attn", {}).get(fa.version, {})
    min_sm = rel.get("min_sm")
    if min_sm:
        low = [a for a in cell.gpu_archs if Version(a) < Version(min_sm)]
        if low:
            p.append(f"{w}: FlashAttention-2 needs sm >= {min_sm}; drop {low} from gpu_archs")
    if fa.source == "source":
        if fa.wheel or fa.sha256:
            p.append(f"{w}: flash_attn.source = 'source' takes no wheel/sha256")
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
    if fa.sha256 and not _is_sha256(fa.sha256):
        p.append(f"{w}: flash_attn.sha256 must be 64 lowercase hex digits or empty (not recorded yet)")
    return p


def validate(matrix: Matrix) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for c in matrix.cells:
        if c.id in seen:
            problems.append(f"cell {c.id}: duplicate id")
        seen.add(c.id)
        problems.extend(validate_cell(c, matrix.upstream))
    for layer in matrix.layers:
        if not (matrix.path.parent / f"{layer}.in").exists() and matrix.path.name == "matrix.toml":
            problems.append(
                f"defaults.layers names {layer!r} but {layer}.in does not exist beside the matrix"
            )
    return problems


# --- CLI ---------------------------------------------------------------------------------------------


def _cmd_list(m: Matrix) -> None:
    for c in m.cells:
        fa = c.flash_attn
        fa_s = "no flash-attn" if fa.source == "none" else f"flash-attn {fa.version} ({fa.source})"
        cuda = "CPU" if c.cpu_only else f"CUDA {c.cuda}"
        print(f"{c.id:24} Python {c.python}  {cuda:9}  torch {c.torch:11} triton {c.triton:6} {fa_s}")


def _cmd_show(m: Matrix, cell_id: str, as_json: bool) -> None:
    c = m.get(cell_id)
    d = c.to_json()
    if c.flash_attn.source == "wheel":
        d["flash_attn"]["url"] = flash_wheel_url(m.upstream, c.flash_attn.version, c.flash_attn.wheel)
    if as_json:
        print(json.dumps(d, indent=2))
    else:
        for k, v in d.items():
            print(f"{k:14} {v}")


def _cmd_github(m: Matrix, gpu: bool | None) -> None:
    cells = [c for c in m.cells if gpu is None or (not c.cpu_only) == gpu]
    include = [
        {
            "cell": c.id,
            "python": c.python,
            "cuda": c.cuda,
            "torch": c.torch,
            "cpu_only": c.cpu_only,
            "base_image": c.base_image,
            "runtime_image": c.runtime_image,
        }
        for c in cells
    ]
    print(json.dumps({"include": include}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", type=Path, default=DEFAULT_PATH, help="matrix file (default: %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("validate", help="exit 1 listing every impossible cell")
    sub.add_parser("list", help="one line per cell")
    sh = sub.add_parser("show", help="one cell")
    sh.add_argument("cell")
    sh.add_argument("--json", action="store_true")
    gh = sub.add_parser("github", help="GitHub Actions matrix JSON")
    g = gh.add_mutually_exclusive_group()
    g.add_argument("--gpu", dest="gpu", action="store_const", const=True, default=None)
    g.add_argument("--cpu", dest="gpu", action="store_const", const=False)
    args = ap.parse_args(argv)
    try:
        m = load(args.matrix)
    except MatrixError as e:
        print(e, file=sys.stderr)
        return 1
    if args.cmd == "validate":
        print(f"{args.matrix.name}: {len(m.cells)} cells valid")
    elif args.cmd == "list":
        _cmd_list(m)
    elif args.cmd == "show":
        try:
            _cmd_show(m, args.cell, args.json)
        except KeyError as e:
            print(f"error: cell: {e.args[0]}", file=sys.stderr)
            return 2
    elif args.cmd == "github":
        _cmd_github(m, args.gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
