"""Locks: the committed ones are fresh; staleness, tampering and leaked local paths are detected
(on a copy of requirements/ in a tmp dir); lock generation is exercised offline with a fake uv."""

from __future__ import annotations

import shutil
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from ci import locks
from ci import matrix as mx

CPU = "cpu-torch2.13-py311"


@pytest.fixture
def req(tmp_path: Path) -> Path:
    """A copy of requirements/ (matrix, .in files, locks) in a tmp dir."""
    dst = tmp_path / "requirements"
    shutil.copytree(mx.DEFAULT_PATH.parent, dst)
    return dst


def test_committed_locks_are_fresh():
    assert locks.check(mx.load()) == []


def test_check_passes_on_fixture_then_fails_after_editing_an_in_file(req: Path):
    m = mx.load(req / "matrix.toml")
    assert locks.check(m, [CPU]) == []
    with (req / "runtime.in").open("a") as f:
        f.write("einops>=0.8\n")
    problems = locks.check(m, [CPU])
    assert problems and "stale" in problems[0] and f"nox -s lock -- {CPU}" in problems[0]


def test_whitespace_only_edit_is_not_stale(req: Path):
    (req / "bench.in").write_text((req / "bench.in").read_text() + "\n\n   \n")
    assert locks.check(mx.load(req / "matrix.toml"), [CPU]) == []


def test_matrix_edit_makes_the_cell_stale_unless_resolution_does_not_see_it(req: Path):
    text = (req / "matrix.toml").read_text()
    images_only = text.replace('runtime_image = "python:3.11-slim-bookworm"', 'runtime_image = "python:3.11-slim"')
    (req / "matrix.toml").write_text(images_only)  # a base image does not change what is installed
    assert locks.check(mx.load(req / "matrix.toml"), [CPU]) == []
    pinned = text.replace('id = "cpu-torch2.13-py311"', 'id = "cpu-torch2.13-py311"\npins = ["einops==0.8.1"]', 1)
    (req / "matrix.toml").write_text(pinned.replace("pins = []\n", "", 1))
    assert any("stale" in p for p in locks.check(mx.load(req / "matrix.toml"), [CPU]))


def test_tampered_body_and_leaked_paths_are_reported(req: Path):
    lock = req / "locks" / f"{CPU}.txt"
    text = lock.read_text()
    leaked = "--extra-index-url " + "file" + ":///srv/mirror/simple\n"  # built here: no such URL in the repo
    lock.write_text(text.replace("triton==3.7.1", "triton==3.7.0") + leaked)
    problems = " | ".join(locks.check(mx.load(req / "matrix.toml"), [CPU]))
    assert "triton is 3.7.0, matrix says 3.7.1" in problems
    assert "file: URL" in problems and "index/find-links line" in problems


def test_missing_and_orphan_locks(req: Path):
    (req / "locks" / f"{CPU}.txt").rename(req / "locks" / "cu999-torch9.9-py399.txt")
    problems = " | ".join(locks.check(mx.load(req / "matrix.toml")))
    assert f"{CPU}: no lock" in problems and "cu999-torch9.9-py399.txt: no cell" in problems


def test_parse_lock_handles_markers_urls_and_duplicates():
    text = textwrap.dedent("""\
        # header
        filelock==4.1.0 ; python_full_version < '3.11' \\
            --hash=sha256:{a}
        filelock==4.2.11 ; python_full_version >= '3.11' \\
            --hash=sha256:{a}
            # via nox
        flash-attn @ https://example.invalid/flash_attn-2.8.3%2Bcu12-cp311-cp311-linux_x86_64.whl \\
            --hash=sha256:{a}
        Typing_Extensions==4.16.0
        """).format(a="a" * 64)
    lines = list(locks.iter_lock(text))
    assert len(lines) == 4
    reqs = locks.parse_lock(text)
    assert reqs["filelock"].version == "4.2.11" and reqs["flash-attn"].url.startswith("https://")
    assert reqs["typing-extensions"].hashes == ()
    for bad in ("this is not a requirement\n", "numpy>=2 \\\n    --hash=sha256:" + "a" * 64 + "\n",
                "x @ https://example.invalid/x-1.0.tar.gz\n"):
        with pytest.raises(locks.LockError, match="unparseable"):
            locks.parse_lock(bad)


FAKE_UV = """#!{python}
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("uv 0.0.1 (fake)")
    sys.exit(0)
cell_in = next(a for a in args if a.endswith("cell.in"))
with open(args[args.index("--output-file") + 1], "w") as out:  # uv writes its result to the output file
    out.write("torch==2.13.0+cpu \\\\\\n    --hash=sha256:{torch}\\n    # via -r " + cell_in + "\\n")
    out.write("triton==3.7.1 \\\\\\n    --hash=sha256:{other}\\n    # via -r " + cell_in + "\\n")
    out.write("numpy==2.4.6 \\\\\\n    --hash=sha256:{other}\\n    # via -r requirements/runtime.in\\n")
"""


def _fake_uv(tmp_path: Path, torch_sha: str) -> str:
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV.format(python=sys.executable, torch=torch_sha, other="b" * 64))
    uv.chmod(uv.stat().st_mode | stat.S_IEXEC)
    return str(uv)


def test_compile_cell_writes_a_checked_lock_without_local_paths(req: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("NSA_LOCK_FIND_LINKS", str(tmp_path / "wheels"))
    m = mx.load(req / "matrix.toml")
    cell = m.get(CPU)
    out = locks.compile_cell(m, cell, uv=_fake_uv(tmp_path, cell.torch_sha256))
    text = out.read_text()
    assert str(tmp_path) not in text and "/tmp" not in text
    assert "# via -r requirements/matrix.toml (cell cpu-torch2.13-py311)" in text
    assert locks.header_fields(text)["resolver"].startswith("uv 0.0.1")
    assert locks.check(m, [CPU]) == []


def test_compile_cell_resolves_from_the_cells_index(req: Path, tmp_path: Path, monkeypatch):
    """Without a find-links folder, uv sees exactly the cell's index (PyTorch's CPU index for the CPU cell)."""
    monkeypatch.delenv("NSA_LOCK_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("NSA_PYTORCH_INDEX", "http://mirror.invalid/whl")
    seen = []
    real_run = locks.subprocess.run

    def spy(cmd, **kw):
        seen.append(cmd)
        return real_run(cmd, **kw)

    monkeypatch.setattr(locks.subprocess, "run", spy)
    m = mx.load(req / "matrix.toml")
    cell = m.get(CPU)
    text = locks.compile_cell(m, cell, uv=_fake_uv(tmp_path, cell.torch_sha256)).read_text()
    compile_cmd = next(c for c in seen if "compile" in c)
    assert compile_cmd[compile_cmd.index("--extra-index-url") + 1] == "http://mirror.invalid/whl/cpu"
    assert "mirror.invalid" not in text  # the header names PyTorch's own index, never a mirror
    assert "--extra-index-url https://download.pytorch.org/whl/cpu -r cpu-torch2.13-py311.txt" in text


def test_compile_cell_refuses_a_torch_wheel_with_another_hash(req: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("NSA_LOCK_FIND_LINKS", str(tmp_path))
    m = mx.load(req / "matrix.toml")
    with pytest.raises(locks.LockError, match="torch_sha256"):
        locks.compile_cell(m, m.get(CPU), uv=_fake_uv(tmp_path, "c" * 64))


def test_cli_check_and_unknown_target(capsys):
    from ci.locks.__main__ import main

    assert main(["--check", CPU]) == 0
    assert main(["--check", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err


SOURCE_CELL, WHEEL_CELL, NO_FLASH_CELL = "cu130-torch2.12-py312", "cu128-torch2.8-py311", "cu130-torch2.14-py312"


def test_flash_attn_pins_sit_beside_the_gpu_locks():
    m = mx.load()
    for cell in m.cells:
        path = locks.flash_lock_path(m, cell.id)
        assert path.exists() == (cell.flash_attn.source != "none"), cell.id
    src = locks.parse_lock(locks.flash_lock_path(m, SOURCE_CELL).read_text())["flash-attn"]
    assert (src.version, src.url, src.hashes) == ("2.8.3.post2", "", (m.flash_sdist_sha256("2.8.3.post2"),))
    whl = locks.parse_lock(locks.flash_lock_path(m, WHEEL_CELL).read_text())["flash-attn"]
    assert whl.url == m.flash_wheel_url(m.get(WHEEL_CELL)) and whl.hashes == (m.get(WHEEL_CELL).flash_attn.sha256,)
    args, env = locks.flash_install_args(m, m.get(SOURCE_CELL))
    assert "--no-build-isolation" in args and env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE"  # never an unpinned wheel
    assert env["FLASH_ATTN_CUDA_ARCHS"] == "80;86;89;90;100;120"
    assert "--only-binary=:all:" in locks.flash_install_args(m, m.get(WHEEL_CELL))[0]


def test_flash_attn_pin_edits_missing_and_orphans_are_reported(req: Path):
    m = mx.load(req / "matrix.toml")
    pin = locks.flash_lock_path(m, SOURCE_CELL)
    pin.write_text(pin.read_text().replace("2.8.3.post2", "2.8.3"))
    assert any(f"{pin.name} is stale" in p for p in locks.check(m, [SOURCE_CELL]))
    pin.unlink()
    assert any(f"{pin.name} is missing" in p for p in locks.check(m, [SOURCE_CELL]))
    locks.write_flash_lock(m, m.get(SOURCE_CELL))
    assert locks.check(m, [SOURCE_CELL]) == []
    # The pin follows the matrix's facts: another sdist sha256 there makes it stale.
    text = (req / "matrix.toml").read_text()
    old = m.flash_sdist_sha256("2.8.3.post2")
    (req / "matrix.toml").write_text(text.replace(old, "0" * 64))
    assert any("is stale" in p for p in locks.check(mx.load(req / "matrix.toml"), [SOURCE_CELL]))
    (req / "matrix.toml").write_text(text)
    stray = locks.flash_lock_path(m, NO_FLASH_CELL)
    stray.write_text(pin.read_text())
    assert any("exists but the cell has no flash-attn" in p for p in locks.check(m, [NO_FLASH_CELL]))
    (req / "locks" / "cu999-torch9.9-py399.flash-attn.txt").write_text("")
    assert any("cu999-torch9.9-py399.flash-attn.txt: no cell 'cu999-torch9.9-py399'" in p for p in locks.check(m))
