"""Why each cell of requirements/matrix.toml is what it is, and the matrix as the docs' Markdown table.

    python -m ci.matrix show CELL [--json]   # the cell, then `why`: the upstream facts behind each choice
    python -m ci.matrix table [--write]      # the table README.md and docs/environments.md carry (--write: update them)

`explain` reads only the matrix: every sentence names the [upstream.*] fact a choice rests on (the CUDA
builds torch publishes and which one PyPI carries, the CPythons it has wheels for, its triton pin, the
flash-attn wheels and C++ standards, the toolkit's architectures and drivers), so a reader can tell a
choice forced by upstream from one the project made. `table` groups the cells that differ only in their
Python into one row; the CPU test suite checks that both documents carry its output.
"""

from __future__ import annotations

from itertools import groupby
from pathlib import Path
from typing import Any

from packaging.version import Version

from ci.matrix import (
    ROOT,
    Cell,
    Matrix,
    cxx_std,
    flash_unbuildable,
    flash_wheel_published,
    pin_specifier,
)


def _versions(values: list[str], every: list[str]) -> str:
    """'3.10 to 3.14' where `values` is a run of consecutive entries of `every`, else '3.10, 3.12'."""
    values = sorted(values, key=Version)
    pos = [every.index(v) for v in values if v in every]
    if len(values) > 2 and len(pos) == len(values) and pos == list(range(pos[0], pos[0] + len(pos))):
        return f"{values[0]} to {values[-1]}"
    return ", ".join(values)


def _torch_facts(m: Matrix, c: Cell) -> dict[str, Any]:
    return m.upstream["torch"][c.torch_public]


def _siblings(m: Matrix, c: Cell) -> list[Cell]:
    """The cells of the same torch build (release, CUDA, index) for other Pythons, this one included."""
    return [o for o in m.cells if (o.torch, o.cuda, o.torch_index) == (c.torch, c.cuda, c.torch_index)]


def _why_python(m: Matrix, c: Cell, t: dict[str, Any]) -> str:
    have = sorted((o.python for o in _siblings(m, c)), key=Version)
    missing = [p for p in t["python"] if p not in have]
    s = (f"torch {c.torch_public} publishes Linux x86_64 wheels for CPython {_versions(t['python'], t['python'])}; "
         f"this build has cells for {_versions(have, t['python'])}")
    s += f" (none for {', '.join(missing)})" if missing else " (every one)"
    quick = [py for py, cell in m.quickstart.items() if cell == c.id]
    return s + (f"; the Quick start installs this cell on Python {quick[0]}" if quick else "")


def _why_cuda(m: Matrix, c: Cell, t: dict[str, Any]) -> str:
    experimental = set(t.get("cuda_experimental", []))
    variants = ", ".join(f"{v} (experimental)" if v in experimental else v for v in t["cuda"])
    built = f"torch {c.torch_public} is built for {variants}"
    if c.cpu_only:
        return (f"{built}; the CPU build ({c.torch}) is on PyTorch's index only ({m.index_url(c)}), so its wheel's "
                "sha256 is recorded in the cell (torch_sha256)")
    if c.torch_index == "pypi":
        others = [v for v in t["cuda"] if v not in ("cpu", c.cuda)]
        rest = (f"; its {', '.join(others)} builds are on PyTorch's index only (a cell for one sets "
                "torch_index = 'pytorch')") if others else ""
        pypi = f"PyPI carries one build of each release, for torch {c.torch_public} CUDA {t['pypi_cuda']}"
        return f"{built}; {pypi}{rest}"
    tag = " (experimental upstream)" if c.cuda in experimental else ""
    return (f"{built}; PyPI's build is CUDA {t['pypi_cuda']}, so CUDA {c.cuda}{tag} comes from PyTorch's "
            f"{c.variant} index ({m.index_url(c)})")


def _why_triton(c: Cell, t: dict[str, Any]) -> str:
    pin, below = str(t["triton"]), t.get("triton_python_below")
    if c.triton == "none":
        return (f"torch {c.torch_public}'s metadata requires no triton on Python {c.python}"
                + (f" (only below {below})" if below else ""))
    where = f" on Python < {below}" if below else ""
    spec = str(pin_specifier(pin))
    if spec.startswith("=="):
        s = f"torch {c.torch_public}'s metadata requires triton{spec}{where}, so the cell has exactly that"
    else:
        s = (f"torch {c.torch_public}'s metadata requires triton{spec}{where}, a range; the cell locks one "
             f"version inside it, {c.triton}")
    return s + ("; on a CPU it runs kernels in its interpreter (TRITON_INTERPRET=1)" if c.cpu_only else "")


def _why_flash(m: Matrix, c: Cell, t: dict[str, Any]) -> str:
    fa = c.flash_attn
    if fa.source == "none":
        return f"none: {m.flash_none_reason(c)}"
    rel = m.upstream.get("flash_attn", {}).get(fa.version, {})
    std = (f"it compiles with C++{cxx_std(rel)}, torch {c.torch_public}'s headers need C++{cxx_std(t)}")
    if fa.source == "wheel":
        return (f"flash-attn {fa.version} publishes {fa.wheel} (torch {c.torch_mm}, CUDA {c.cuda.split('.')[0]}, "
                f"CPython {c.python}, C++11 ABI {'on' if t['cxx11abi'] else 'off'} like torch's wheels): pinned by "
                f"URL and sha256 ({m.flash_wheel_url(c)})")
    published, no_wheel = flash_wheel_published(m.upstream, fa.version, c.torch_mm, c.cuda.split(".")[0],
                                                c.python, t["cxx11abi"])
    if published:
        no_wheel = f"flash-attn {fa.version} publishes a wheel for this torch/CUDA/Python, but the cell builds it"
    archs = " ".join(sorted(c.gpu_archs, key=Version))
    return (f"{no_wheel}; so the source package (sha256 {m.flash_sdist_sha256(fa.version)}) "
            f"is compiled for sm {archs} in the image's build stage; {std}")


def _why_archs(m: Matrix, c: Cell) -> str:
    supported = m.upstream.get("cuda", {}).get(c.cuda, [])
    s = (f"CUDA {c.cuda} compiles for sm {' '.join(supported)}; the cell builds for "
         f"{' '.join(sorted(c.gpu_archs, key=Version))}")
    min_sm = m.upstream.get("flash_attn", {}).get(c.flash_attn.version, {}).get("min_sm")
    return s + (f" (FlashAttention-2 needs sm >= {min_sm})" if c.flash_attn.source != "none" and min_sm else "")


def _why_images(c: Cell) -> str:
    if c.flash_attn.source == "source":
        build = f"{c.base_image}, a CUDA -devel image: nvcc compiles flash-attn there"
    else:
        build = f"{c.base_image} (nothing is compiled)"
    runtime = ("" if c.cpu_only else
               ": the lock's CUDA library wheels bring CUDA's runtime, the host brings the driver")
    return f"build stage {build}; run stage {c.runtime_image}{runtime}"


def explain(m: Matrix, c: Cell) -> dict[str, str]:
    """Why the cell is what it is: one sentence per choice, each naming the upstream fact behind it."""
    t = _torch_facts(m, c)
    why = {"python": _why_python(m, c, t), "cuda": _why_cuda(m, c, t), "triton": _why_triton(c, t),
           "flash_attn": _why_flash(m, c, t)}
    if not c.cpu_only:
        ga, floor = m.min_driver(c.cuda)
        why["gpu_archs"] = _why_archs(m, c)
        why["driver"] = (f"CUDA {c.cuda}'s GA release needs NVIDIA driver >= {ga}; with minor-version compatibility "
                         f"CUDA {c.cuda.split('.')[0]}.x runs from {floor}")
    why["images"] = _why_images(c)
    if c.pins:
        why["pins"] = f"extra pins of this cell (see its description): {', '.join(c.pins)}"
    return why


# --- the Markdown table ------------------------------------------------------------------------------------


TABLE_HEADER = ("| cell | Python | CUDA | torch | index | triton | flash-attn | GPU archs (sm) |\n"
                "|---|---|---|---|---|---|---|---|")


def _flash_cell(m: Matrix, c: Cell) -> str:
    fa = c.flash_attn
    if fa.source == "wheel":
        return f"{fa.version} wheel"
    if fa.source == "source":
        return f"{fa.version} source build"
    if c.cpu_only:
        return "none (needs CUDA)"
    if flash_unbuildable(m.upstream, c.torch_public):
        return f"none: torch {c.torch_mm} headers need C++{cxx_std(_torch_facts(m, c))}; torch's own FA-2"
    return f"none: {fa.why}"


def _row(m: Matrix, cells: list[Cell]) -> str:
    c, t = cells[0], _torch_facts(m, cells[0])
    pythons = [x.python for x in cells]
    ids = f"`{c.id}`" if len(cells) == 1 else (
        f"`{c.id}` to `-py{cells[-1].python.replace('.', '')}`" if " to " in _versions(pythons, t["python"])
        else ", ".join([f"`{c.id}`"] + [f"`-py{x.python.replace('.', '')}`" for x in cells[1:]]))
    quick = {cell: py for py, cell in m.quickstart.items()}
    starts = [quick[x.id] for x in cells if x.id in quick]
    notes = (["CI"] if c.cpu_only else []) + ([f"Quick start on {', '.join(starts)}"] if starts else [])
    ids += f" ({'; '.join(notes)})" if notes else ""
    spec = str(pin_specifier(str(t["triton"])))
    triton = c.triton if spec.startswith("==") or c.triton == "none" else f"{c.triton} (`{spec}`)"
    triton += " (interpreter)" if c.cpu_only else ""
    index = "PyPI" if c.torch_index == "pypi" else f"PyTorch's `{c.variant}`"
    archs = " ".join(sorted(c.gpu_archs, key=Version)) or "none"
    return (f"| {ids} | {_versions(pythons, t['python'])} | {'none' if c.cpu_only else c.cuda} | {c.torch} | {index} "
            f"| {triton} | {_flash_cell(m, c)} | {archs} |")


def table(m: Matrix) -> str:
    """The matrix as Markdown: one row per torch build, its Pythons together (matrix order of first sight)."""
    def build(c: Cell) -> tuple:
        return (c.torch, c.cuda, c.torch_index, c.triton, c.flash_attn, c.gpu_archs, c.base_image, c.pins)

    order = {b: i for i, b in reversed(list(enumerate(build(c) for c in m.cells)))}
    ordered = sorted(m.cells, key=lambda c: (order[build(c)], Version(c.python)))
    rows = [_row(m, list(group)) for _, group in groupby(ordered, key=build)]
    return "\n".join([TABLE_HEADER, *rows])


# --- the documents that carry the table ----------------------------------------------------------------------

TABLE_DOCS = (ROOT / "README.md", ROOT / "docs" / "environments.md")
TABLE_MARKER = "<!-- generated: python -m ci.matrix table --write -->"


def _table_span(lines: list[str], doc: Path) -> tuple[int, int]:
    """Line indexes [start, end) of the table that follows the marker in a document."""
    if TABLE_MARKER not in lines:
        raise ValueError(f"{doc}: no line {TABLE_MARKER!r} above the matrix table")
    start = end = lines.index(TABLE_MARKER) + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def embedded_table(doc: Path) -> str:
    """The matrix table a document carries (below the marker line)."""
    lines = doc.read_text().split("\n")
    start, end = _table_span(lines, doc)
    return "\n".join(lines[start:end])


def write_tables(m: Matrix, docs: tuple[Path, ...] = TABLE_DOCS) -> list[Path]:
    """Replace the table below the marker of each document with the matrix's; the documents changed."""
    changed, text = [], table(m)
    for doc in docs:
        lines = doc.read_text().split("\n")
        start, end = _table_span(lines, doc)
        if "\n".join(lines[start:end]) != text:
            lines[start:end] = text.split("\n")
            doc.write_text("\n".join(lines))
            changed.append(doc)
    return changed
