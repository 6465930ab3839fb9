"""The library's layering, checked from the source: imports point one way (api -> plan -> run -> branches ->
kernels), the kernels read no toggle and write no telemetry, only nsa/toggles.py reads the environment, and
planning imports no triton."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NSA = ROOT / "nsa"
LAYERS = ("nsa.attention", "nsa.decode", "nsa.functional", "nsa.distributed", "nsa.plan", "nsa.run", "nsa.branches",
          "nsa.kernels")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_names(path: Path, mod: str) -> list[tuple[str, str | None]]:
    """(module, name) of every import in the file, anywhere in it, relative imports resolved: `import a.b` is
    ("a.b", None), `from a import b` is ("a", "b")."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(base, a.name) for a in node.names]
    return found


def _imports(path: Path, mod: str | None = None) -> set[str]:
    """Every nsa module `path` (the module `mod`) imports, anywhere in the file, relative imports resolved."""
    found = set()
    for base, name in _import_names(path, mod or _module(path)):
        found |= {base} if name is None else {base, f"{base}.{name}"}
    return {m for m in found if m == "nsa" or m.startswith("nsa.")}


def _layer(name: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if name == layer or name.startswith(layer + ".")), None)


SOURCES = sorted(NSA.rglob("*.py"))


def _upward(path: Path, mod: str) -> list[str]:
    own = _layer(mod)
    if own is None:
        return []
    return sorted(m for m in _imports(path, mod) if _layer(m) is not None and _layer(m) < own)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    up = _upward(path, _module(path))
    assert not up, f"{_module(path)} imports a higher layer: {up}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a module graph: its strongly connected components of more than one module."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _module_edges(path: Path, mod: str, modules: set[str]) -> set[str]:
    """The nsa modules `mod` imports: `from pkg import name` is an edge to pkg.name when that is a module (the
    package's __init__ has already run), else to pkg."""
    pairs = _import_names(path, mod)
    edges = {f"{base}.{name}" if name and f"{base}.{name}" in modules else base for base, name in pairs}
    return {e for e in edges if e in modules and e != mod}


def test_no_import_cycle_in_nsa():
    """Module to module (function-level imports included): a cycle means two modules each need the other."""
    mods = {_module(p): p for p in SOURCES}
    graph = {m: _module_edges(p, m, set(mods)) for m, p in mods.items()}
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail


def test_kernels_are_mechanism_only():
    """No module under nsa/kernels imports the toggles, the telemetry or planning."""
    bad = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.split(".")[1:2] in (["toggles"],
                                                                                         ["telemetry"]))
           for p in (NSA / "kernels").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


ENV_READERS = {"nsa/toggles.py", "nsa/hooks.py"}  # the library's one reader of the environment (and the hooks)


def _env_reads(source: str) -> list[int]:
    """Lines of `source` that touch the process environment: os.environ / os.getenv / os.putenv, or importing
    them from os."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "getenv", "putenv", "environb"}:
                lines.append(node.lineno)
    return sorted(lines)


def test_only_the_toggles_read_the_environment():
    """Every environment variable the library reads goes through nsa/toggles.py (documented there, read at call
    time); the scan finds both spellings in a probe."""
    found = {str(p.relative_to(ROOT)): _env_reads(p.read_text()) for p in SOURCES}
    assert {k: v for k, v in found.items() if v and k not in ENV_READERS} == {}
    assert found["nsa/toggles.py"]  # the scan sees the one reader
    assert _env_reads("import os\nx = os.environ.get('A')\nfrom os import getenv\n") == [2, 3]


def _private_cache_uses(source: str) -> list[str]:
    """`x._name` where x is named like a cache (cache, self.cache, kv_cache ...): a private member of NSACache
    used from outside it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if "cache" in name.lower():
                found.append(f"{name}.{node.attr}")
    return found


def test_nothing_outside_the_cache_uses_its_private_members():
    """The decode entry points, runners and branches use NSACache's public methods only."""
    found = {str(p.relative_to(ROOT)): _private_cache_uses(p.read_text()) for p in SOURCES}
    assert {k: v for k, v in found.items() if v and k != "nsa/cache.py"} == {}
    assert _private_cache_uses("cache._base\nself.cache._steps\nlayout._x\ncache.__class__\n") == [
        "cache._base", "cache._steps"]


def test_the_scan_sees_an_upward_import(tmp_path):
    """Relative imports are resolved: a kernel module importing the plan or the telemetry is caught."""
    f = tmp_path / "probe.py"
    f.write_text("def f():\n    from ...plan import rules\n\nimport nsa.telemetry\nfrom . import tma\n")
    mod = "nsa.kernels.triton.probe"
    assert {"nsa.plan", "nsa.plan.rules", "nsa.telemetry", "nsa.kernels.triton.tma"} <= _imports(f, mod)
    assert _upward(f, mod) == ["nsa.plan", "nsa.plan.rules"]
    assert _upward(f, "nsa.plan.probe") == []


def test_importing_the_planner_and_the_fast_twins_imports_no_triton():
    """The plan names the Triton twins directly; they import their kernels (and triton) on first call only,
    so `import nsa` and its planner work where triton is broken (availability then says why)."""
    code = ("import sys\n"
            "import nsa.functional, nsa.decode, nsa.plan, nsa.run\n"
            "import nsa.branches.selected.triton, nsa.branches.combine.triton, nsa.branches.sliding.triton\n"
            "import nsa.branches.decode.triton\n"
            "assert 'triton' not in sys.modules, [m for m in sys.modules if m.startswith('nsa.kernels.triton')]\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
