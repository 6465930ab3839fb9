"""`python -m ci.matrix show CELL` says why a cell is what it is, and `python -m ci.matrix table` is the
table README.md and docs/environments.md carry (ci/matrix/explain.py)."""

from __future__ import annotations

import copy
import json
import re

import pytest

from ci import matrix as mx
from ci.matrix import explain as X
from ci.matrix.__main__ import main as mx_main

pytestmark = pytest.mark.usefixtures("pytorchs_own_index")


def _why(m: mx.Matrix, cell_id: str) -> dict[str, str]:
    return X.explain(m, m.get(cell_id))


def _row_ids(row: str, cells: list[mx.Cell]) -> set[str]:
    """The cell ids a table row stands for: its first id's prefix with the Pythons of its Python column."""
    first, pythons = row.split(" | ")[:2]
    prefix = re.search(r"`([^`]+)-py\d+`", first).group(1)
    if " to " in pythons:
        lo, hi = (mx.Version(v) for v in pythons.split(" to "))
        return {c.id for c in cells if c.id.startswith(prefix + "-py") and lo <= mx.Version(c.python) <= hi}
    return {f"{prefix}-py{p.replace('.', '')}" for p in pythons.split(", ")}


def test_the_documents_carry_the_matrix_table():
    """README.md and docs/environments.md: `python -m ci.matrix table --write` after editing the matrix."""
    want = X.table(mx.load())
    for doc in X.TABLE_DOCS:
        assert X.embedded_table(doc) == want, f"{doc.name}: run `python -m ci.matrix table --write`"


def test_table_has_one_row_per_torch_build_with_its_pythons():
    rows = X.table(mx.load()).split("\n")[2:]
    by_id = {r.split(" | ")[0]: r for r in rows}
    assert by_id["| `cpu-torch2.13-py311` (CI; Quick start on 3.11)"].endswith(
        "| 2.13.0+cpu | PyTorch's `cpu` | 3.7.1 (interpreter) | none (needs CUDA) | none |")
    r214 = by_id["| `cu130-torch2.14-py310` to `-py314`"]
    assert "| 3.10 to 3.14 | 13.0 | 2.14.1 | PyPI | 3.8.0 (`~=3.8.0`) | none: torch 2.14 headers need C++20" in r214
    assert "| 3.11 to 3.15 | 13.2 | 2.15.0 |" in by_id["| `cu132-torch2.15-py311` to `-py315`"]
    r213 = by_id["| `cu130-torch2.13-py310` to `-py314` (Quick start on 3.10, 3.12, 3.13)"]
    assert "| 2.8.3.post2 source build |" in r213
    assert "| 2.8.3 wheel |" in by_id["| `cu121-torch2.4-py311`"]
    cells = mx.load().cells
    named = [_row_ids(r, cells) for r in rows]
    assert sum(map(len, named)) == len(cells) and set().union(*named) == {c.id for c in cells}  # once each


def test_a_gap_in_the_pythons_is_listed_not_ranged(data):
    d = copy.deepcopy(data)
    d["cell"] = [c for c in d["cell"] if c["id"] != "cu130-torch2.12-py312"]
    rows = X.table(mx.parse(d, mx.DEFAULT_PATH)).split("\n")
    row = next(r for r in rows if "cu130-torch2.12" in r)
    assert row.startswith("| `cu130-torch2.12-py310`, `-py311`, `-py313`, `-py314` | 3.10, 3.11, 3.13, 3.14 |")


def test_write_tables_replaces_a_stale_table_and_needs_the_marker(tmp_path):
    m = mx.load()
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n\n{X.TABLE_MARKER}\n| cell |\n|---|\n| `old` |\n\nafter\n")
    assert X.write_tables(m, (doc,)) == [doc]
    assert X.embedded_table(doc) == X.table(m) and doc.read_text().endswith("\n\nafter\n")
    assert X.write_tables(m, (doc,)) == []  # up to date: untouched
    doc.write_text("| cell |\n")
    with pytest.raises(ValueError, match="no line"):
        X.write_tables(m, (doc,))


def test_why_a_range_pinned_cell_without_flash_attn():
    why = _why(mx.load(), "cu130-torch2.14-py313")
    assert "CPython 3.10 to 3.14; this build has cells for 3.10 to 3.14 (every one)" in why["python"]
    assert "built for cpu, 12.6, 13.0, 13.2 (experimental)" in why["cuda"]
    assert "for torch 2.14.1 CUDA 13.0; its 12.6, 13.2 builds are on PyTorch's index only" in why["cuda"]
    assert ("requires triton~=3.8.0 on Python < 3.15, a range; the cell locks one version inside it, 3.8.0"
            in why["triton"])
    assert why["flash_attn"].startswith(
        "none: no flash-attn release compiles against torch 2.14.1: its headers need C++20")
    assert "FlashAttention-2" not in why["gpu_archs"]  # no flash-attn, no sm >= 8.0 rule
    assert "CUDA 13.0's GA release needs NVIDIA driver >= 580.65.06" in why["driver"]
    assert why["images"].startswith("build stage ubuntu:24.04 (nothing is compiled)")


def test_why_the_wheel_the_source_build_and_the_cpu_build():
    m = mx.load()
    wheel = _why(m, "cu128-torch2.8-py311")["flash_attn"]
    assert wheel.startswith("flash-attn 2.8.3 publishes flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311")
    assert "C++11 ABI on" in wheel and "%2Bcu12torch2.8" in wheel
    src = _why(m, "cu130-torch2.11-py312")
    assert src["flash_attn"].startswith("flash-attn 2.8.3 publishes no wheel for torch 2.11")
    assert "compiled for sm 8.0 8.6 8.9 9.0 10.0 12.0" in src["flash_attn"] and "C++17" in src["flash_attn"]
    assert "(none for 3.10, 3.11, 3.13, 3.14)" in src["python"]
    assert "numpy==2.5.2" in src["pins"] and "nvcc compiles flash-attn" in src["images"]
    post2 = _why(m, "cu130-torch2.13-py312")
    assert "2.8.3.post2's upstream wheel set is not recorded" in post2["flash_attn"]
    assert "the Quick start installs this cell on Python 3.12" in post2["python"]
    cpu = _why(m, "cpu-torch2.13-py311")
    assert "on PyTorch's index only (https://download.pytorch.org/whl/cpu)" in cpu["cuda"]
    assert "interpreter" in cpu["triton"] and "driver" not in cpu


def test_why_follows_the_facts(data):
    """Change an upstream fact or a cell and the explanation changes with it."""
    d = copy.deepcopy(data)
    d["upstream"]["torch"]["2.12.1"]["cuda_experimental"] = []
    d["cell"] = [c for c in d["cell"] if c["id"] != "cu130-torch2.12-py314"]
    why = _why(mx.parse(d, mx.DEFAULT_PATH), "cu130-torch2.12-py313")
    assert "(none for 3.14)" in why["python"] and "(experimental)" not in why["cuda"]


def test_why_a_cell_from_pytorchs_cuda_index(data):
    d = copy.deepcopy(data)
    cell = copy.deepcopy(next(c for c in d["cell"] if c["id"] == "cu130-torch2.13-py312"))
    cell.update(id="cu126-torch2.13-py312", cuda="12.6", torch="2.13.0+cu126", torch_index="pytorch",
                torch_sha256="b" * 64, base_image="nvidia/cuda:12.6.3-cudnn-devel-ubuntu24.04",
                gpu_archs=["8.0", "8.6", "8.9", "9.0"])
    d["cell"].append(cell)
    m = mx.parse(d, mx.DEFAULT_PATH)
    why = _why(m, "cu126-torch2.13-py312")
    assert "PyPI's build is CUDA 13.0, so CUDA 12.6 comes from PyTorch's cu126 index" in why["cuda"]
    assert "https://download.pytorch.org/whl/cu126" in why["cuda"]
    assert "this build has cells for 3.12 (none for 3.10, 3.11, 3.13, 3.14)" in why["python"]
    assert any(r.startswith("| `cu126-torch2.13-py312` | 3.12 | 12.6 | 2.13.0+cu126 | PyTorch's `cu126` |")
               for r in X.table(m).split("\n"))


def test_show_prints_why(capsys):
    assert mx_main(["show", "cu132-torch2.15-py315"]) == 0
    out = capsys.readouterr().out
    assert "\nwhy:\n" in out and "  triton       torch 2.15.0's metadata requires triton~=3.9.0" in out
    assert mx_main(["show", "cu132-torch2.15-py315", "--json"]) == 0
    why = json.loads(capsys.readouterr().out)["why"]
    assert set(why) == {"python", "cuda", "triton", "flash_attn", "gpu_archs", "driver", "images"}
    assert mx_main(["table"]) == 0 and capsys.readouterr().out.startswith(X.TABLE_HEADER)
