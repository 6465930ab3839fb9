"""ci/ stays a tree of small jobs: no import cycle among its modules (a module half-initialised by a cycle fails
only on the path that imports it first), and few enough lines to read in one sitting."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 3900


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of root/ci -> the modules of ci it imports, at module level or inside a function."""
    files = {_module(p, root): p for p in sorted((root / "ci").rglob("*.py"))}

    def existing(name: str) -> str:  # `import ci.a.b` runs ci/a/b.py, or the deepest of its packages that exists
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [existing(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..y import z
                    anchor = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                # `from ci.x import y` runs ci/x/y.py where that file exists; else y is a name defined in ci.x.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else existing(base) for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, [a, b, ..., a] where a imports b, or [] where there is none."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        return e.args[1][::-1]  # graphlib walks from the imported module to its importer
    return []


def size_report(root: Path, limit: int) -> str:
    """Why root/ci is too big ("" where it is not): its line count and its biggest files."""
    sizes = {p.relative_to(root).as_posix(): p.read_bytes().count(b"\n") for p in sorted((root / "ci").rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts}
    total = sum(sizes.values())
    if total < limit:
        return ""
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    return f"ci/ has {total} lines, not under {limit}; biggest files: " + ", ".join(f"{f} ({n})" for f, n in biggest)


def test_ci_has_no_import_cycle():
    graph = import_graph(ROOT)
    # The parser sees the imports that exist: the command line of the matrix reaches its loader and its tables.
    assert {"ci.matrix", "ci.matrix.explain"} <= graph["ci.matrix.__main__"]
    assert "ci.matrix" in graph["ci.matrix.explain"]
    cycle = find_cycle(graph)
    assert not cycle, "import cycle in ci/: " + " imports ".join(cycle)


@pytest.mark.parametrize("file, line, modules", [
    # inside a function, and a submodule named by `from ci.matrix import explain` (not a name of ci.matrix)
    ("matrix/__init__.py", "def _seeded():\n    from ci.matrix import explain\n", {"ci.matrix", "ci.matrix.explain"}),
    ("matrix/explain.py", "import ci.matrix.__main__\n", {"ci.matrix.__main__", "ci.matrix.explain"}),
    ("matrix/__init__.py", "from . import facts\n", {"ci.matrix", "ci.matrix.facts"}),
])
def test_a_seeded_cycle_is_found_and_named(tmp_path, file, line, modules):
    shutil.copytree(ROOT / "ci", tmp_path / "ci", ignore=shutil.ignore_patterns("__pycache__"))
    assert import_graph(tmp_path) == import_graph(ROOT)  # the copy is the tree
    with (tmp_path / "ci" / file).open("a") as f:
        f.write("\n\n" + line)
    graph = import_graph(tmp_path)
    cycle = find_cycle(graph)
    assert set(cycle) == modules and cycle[0] == cycle[-1], cycle
    assert all(b in graph[a] for a, b in zip(cycle, cycle[1:])), cycle  # each imports the next


def test_ci_stays_small():
    report = size_report(ROOT, MAX_LINES)
    assert not report, report


def test_the_size_report_names_the_biggest_files(tmp_path):
    (tmp_path / "ci" / "sub").mkdir(parents=True)
    (tmp_path / "ci" / "big.py").write_text("x = 1\n" * 30)
    (tmp_path / "ci" / "sub" / "small.toml").write_text("a = 1\n" * 5)
    (tmp_path / "ci" / "__pycache__").mkdir()
    (tmp_path / "ci" / "__pycache__" / "big.cpython-311.pyc").write_bytes(b"\n" * 1000)  # not source
    assert size_report(tmp_path, 36) == ""
    assert size_report(tmp_path, 35) == "ci/ has 35 lines, not under 35; biggest files: ci/big.py (30), " \
                                        "ci/sub/small.toml (5)"


def lint_imports() -> str:
    """The lint-imports command of import-linter (requirements/locks/lint.txt; `nox -s lint` runs this module)."""
    exe = shutil.which("lint-imports") or shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        if os.environ.get("NSA_REQUIRE_LINT_TOOLS") == "1":
            pytest.fail("lint-imports not installed (requirements/locks/lint.txt)")
        pytest.skip("lint-imports not installed here (run `nox -s lint`)")
    return exe


@pytest.mark.parametrize("file, line, contract", [
    ("nsa/config.py", "import ci.matrix", "nsa (the library) imports neither"),
    ("nsa/config.py", "from bench import bench_nsa", "nsa (the library) imports neither"),
    ("nsa/config.py", "from nsa_env import report", "nsa (the library) imports neither"),
    ("nsa_env/drift.py", "import ci.locks", "nsa_env ships in the wheel"),
    ("nsa_env/report.py", "from nsa_env import doctor", "nsa_env: the command line over the doctor"),
    ("ci/matrix/facts.py", "from ci.locks import lock_path", "ci: sessions over evidence"),
])
def test_the_import_contracts_hold_and_catch_a_seeded_import(tmp_path, file, line, contract):
    exe = lint_imports()
    for name in ("nsa", "nsa_env", "ci"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    run = lambda: subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True,  # noqa: E731
                                 timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    clean = run()
    assert clean.returncode == 0, clean.stdout[-3000:]
    with (tmp_path / file).open("a") as f:
        f.write(f"\n\ndef _seeded():\n    {line}  # noqa\n")
    seeded = run()
    assert seeded.returncode == 1 and "BROKEN" in seeded.stdout, seeded.stdout[-3000:]
    broken = seeded.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken.replace("\n", " "), broken
