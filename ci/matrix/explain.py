"""Why each cell of requirements/matrix.toml is what it is (`python -m ci.matrix show CELL`): every sentence names
the [upstream.*] fact a choice rests on, so a choice forced by upstream reads apart from one the project made.
And the matrix as the Markdown table README.md and docs/environments.md carry (`python -m ci.matrix table`).
"""

from __future__ import annotations

from itertools import groupby
from operator import attrgetter
from pathlib import Path
from typing import Any

from packaging.version import Version

from ci.matrix import ROOT, Cell, Matrix, cxx_std, flash_unbuildable, flash_wheel_published, pin_specifier

TABLE_HEADER = ("| cell | Python | CUDA | torch | index | triton | flash-attn | GPU archs (sm) |\n"
                "|---|---|---|---|---|---|---|---|")
TABLE_DOCS = (ROOT / "README.md", ROOT / "docs" / "environments.md")
TABLE_MARKER = "<!-- generated: python -m ci.matrix table --write -->"


def _versions(values: list[str], every: list[str]) -> str:
    """'3.10 to 3.14' where `values` is a run of consecutive entries of `every`, else '3.10, 3.12'."""
    values = sorted(values, key=Version)
    pos = [every.index(v) for v in values if v in every]
    if len(values) > 2 and len(pos) == len(values) and pos == list(range(pos[0], pos[0] + len(pos))):
        return f"{values[0]} to {values[-1]}"
    return ", ".join(values)


def _archs(archs: tuple[str, ...] | list[str]) -> str:
    return " ".join(sorted(archs, key=Version))


def _why_python(m: Matrix, c: Cell, t: dict[str, Any]) -> str:
    # The cells of the same torch build (release, CUDA, index) for other Pythons, this one included.
    have = [o.python for o in m.cells if (o.torch, o.cuda, o.torch_index) == (c.torch, c.cuda, c.torch_index)]
    missing = [p for p in t["python"] if p not in have]
    s = (f"torch {c.torch_public} publishes Linux x86_64 wheels for CPython {_versions(t['python'], t['python'])}; "
         f"this build has cells for {_versions(have, t['python'])}")
    s += f" (none for {', '.join(missing)})" if missing else " (every one)"
    quick = [py for py, cell in m.quickstart.items() if cell == c.id]
    return s + (f"; the Quick start installs this cell on Python {quick[0]}" if quick else "")


def _why_cuda(m: Matrix, c: Cell, t: dict[str, Any]) -> str:
    experimental = set(t.get("cuda_experimental", []))
    built = "torch {} is built for {}".format(
        c.torch_public, ", ".join(f"{v} (experimental)" if v in experimental else v for v in t["cuda"]))
    if c.cpu_only:
        return (f"{built}; the CPU build ({c.torch}) is on PyTorch's index only ({m.index_url(c)}), so its wheel's "
                "sha256 is recorded in the cell (torch_sha256)")
    others = [v for v in t["cuda"] if v not in ("cpu", c.cuda)]
    if c.torch_index == "pypi":
        return (f"{built}; PyPI carries one build of each release, for torch {c.torch_public} CUDA {t['pypi_cuda']}"
                + (f"; its {', '.join(others)} builds are on PyTorch's index only (a cell for one sets "
                   "torch_index = 'pytorch')" if others else ""))
    tag = " (experimental upstream)" if c.cuda in experimental else ""
    return (f"{built}; PyPI's build is CUDA {t['pypi_cuda']}, so CUDA {c.cuda}{tag} comes from PyTorch's "
            f"{c.variant} index ({m.index_url(c)})")


def _why_triton(c: Cell, t: dict[str, Any]) -> str:
    below = t.get("triton_python_below")
    if c.triton == "none":
        return (f"torch {c.torch_public}'s metadata requires no triton on Python {c.python}"
                + (f" (only below {below})" if below else ""))
    spec = str(pin_specifier(str(t["triton"])))
    s = f"torch {c.torch_public}'s metadata requires triton{spec}{f' on Python < {below}' if below else ''}"
    s += (", so the cell has exactly that" if spec.startswith("==") else
          f", a range; the cell locks one version inside it, {c.triton}")
    return s + ("; on a CPU it runs kernels in its interpreter (TRITON_INTERPRET=1)" if c.cpu_only else "")


def _why_flash(m: Matrix, c: Cell, t: dict[str, Any]) -> str:
    fa = c.flash_attn
    if fa.source == "none":
        return f"none: {m.flash_none_reason(c)}"
    if fa.source == "wheel":
        return (f"flash-attn {fa.version} publishes {fa.wheel} (torch {c.torch_mm}, CUDA {c.cuda_major}, "
                f"CPython {c.python}, C++11 ABI {'on' if t['cxx11abi'] else 'off'} like torch's wheels): pinned by "
                f"URL and sha256 ({m.flash_wheel_url(c)})")
    published, no_wheel = flash_wheel_published(m.upstream, fa.version, c.torch_mm, c.cuda_major, c.python,
                                                t["cxx11abi"])
    if published:
        no_wheel = f"flash-attn {fa.version} publishes a wheel for this torch/CUDA/Python, but the cell builds it"
    rel = m.upstream.get("flash_attn", {}).get(fa.version, {})
    return (f"{no_wheel}; so the source package (sha256 {m.flash_sdist_sha256(fa.version)}) is compiled for sm "
            f"{_archs(c.gpu_archs)} in the image's build stage; it compiles with C++{cxx_std(rel)}, "
            f"torch {c.torch_public}'s headers need C++{cxx_std(t)}")


def explain(m: Matrix, c: Cell) -> dict[str, str]:
    """Why the cell is what it is: one sentence per choice, each naming the upstream fact behind it."""
    t = m.upstream["torch"][c.torch_public]
    why = {"python": _why_python(m, c, t), "cuda": _why_cuda(m, c, t), "triton": _why_triton(c, t),
           "flash_attn": _why_flash(m, c, t)}
    if not c.cpu_only:
        ga, floor = m.min_driver(c.cuda)
        min_sm = m.upstream.get("flash_attn", {}).get(c.flash_attn.version, {}).get("min_sm")
        why["gpu_archs"] = (f"CUDA {c.cuda} compiles for sm {' '.join(m.upstream.get('cuda', {}).get(c.cuda, []))}; "
                            f"the cell builds for {_archs(c.gpu_archs)}"
                            + (f" (FlashAttention-2 needs sm >= {min_sm})"
                               if c.flash_attn.source != "none" and min_sm else ""))
        why["driver"] = (f"CUDA {c.cuda}'s GA release needs NVIDIA driver >= {ga}; with minor-version compatibility "
                         f"CUDA {c.cuda_major}.x runs from {floor}")
    build = (f"{c.base_image}, a CUDA -devel image: nvcc compiles flash-attn there" if c.flash_attn.source == "source"
             else f"{c.base_image} (nothing is compiled)")
    runtime = "" if c.cpu_only else ": the lock's CUDA library wheels bring CUDA's runtime, the host brings the driver"
    why["images"] = f"build stage {build}; run stage {c.runtime_image}{runtime}"
    if c.pins:
        why["pins"] = f"extra pins of this cell (see its description): {', '.join(c.pins)}"
    return why


def _row(m: Matrix, cells: list[Cell]) -> str:
    c, t = cells[0], m.upstream["torch"][cells[0].torch_public]
    pythons = _versions([x.python for x in cells], t["python"])
    ids = f"`{c.id}`" if len(cells) == 1 else (
        f"`{c.id}` to `-py{cells[-1].python.replace('.', '')}`" if " to " in pythons
        else ", ".join([f"`{c.id}`"] + [f"`-py{x.python.replace('.', '')}`" for x in cells[1:]]))
    starts = [py for x in cells for py, cell in m.quickstart.items() if cell == x.id]
    notes = (["CI"] if c.cpu_only else []) + ([f"Quick start on {', '.join(starts)}"] if starts else [])
    ids += f" ({'; '.join(notes)})" if notes else ""
    spec = str(pin_specifier(str(t["triton"])))
    triton = c.triton if spec.startswith("==") or c.triton == "none" else f"{c.triton} (`{spec}`)"
    triton += " (interpreter)" if c.cpu_only else ""
    fa = c.flash_attn
    flash = {"wheel": f"{fa.version} wheel", "source": f"{fa.version} source build"}.get(fa.source) or (
        "none (needs CUDA)" if c.cpu_only else
        f"none: torch {c.torch_mm} headers need C++{cxx_std(t)}; torch's own FA-2"
        if flash_unbuildable(m.upstream, c.torch_public) else f"none: {fa.why}")
    index = "PyPI" if c.torch_index == "pypi" else f"PyTorch's `{c.variant}`"
    return (f"| {ids} | {pythons} | {'none' if c.cpu_only else c.cuda} | {c.torch} | {index} | {triton} | {flash} "
            f"| {_archs(c.gpu_archs) or 'none'} |")


def table(m: Matrix) -> str:
    """The matrix as Markdown: one row per torch build, its Pythons together (matrix order of first sight)."""
    build = attrgetter("torch", "cuda", "torch_index", "triton", "flash_attn", "gpu_archs", "base_image", "pins")
    order = {b: i for i, b in reversed(list(enumerate(build(c) for c in m.cells)))}
    ordered = sorted(m.cells, key=lambda c: (order[build(c)], Version(c.python)))
    return "\n".join([TABLE_HEADER, *(_row(m, list(group)) for _, group in groupby(ordered, key=build))])


def _read_table(doc: Path) -> tuple[list[str], slice]:
    """A document's lines, and where among them the table below its marker line is."""
    lines = doc.read_text().split("\n")
    if TABLE_MARKER not in lines:
        raise ValueError(f"{doc}: no line {TABLE_MARKER!r} above the matrix table")
    start = lines.index(TABLE_MARKER) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines, slice(start, end)


def embedded_table(doc: Path) -> str:
    """The matrix table a document carries (below the marker line)."""
    lines, span = _read_table(doc)
    return "\n".join(lines[span])


def write_tables(m: Matrix, docs: tuple[Path, ...] = TABLE_DOCS) -> list[Path]:
    """Replace the table below the marker of each document with the matrix's; the documents changed."""
    changed, text = [], table(m)
    for doc in docs:
        lines, span = _read_table(doc)
        if "\n".join(lines[span]) != text:
            lines[span] = text.split("\n")
            doc.write_text("\n".join(lines))
            changed.append(doc)
    return changed
