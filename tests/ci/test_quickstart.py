"""The Quick start's cell choice and the GPU sessions' flash-attn install (ci/sessions/install.py), and the Quick
start's local package index (ci/sessions/quickstart.py).

The Quick start itself, run in a fresh clone with no pip configuration, is `python -m ci.sessions.quickstart`
(.ci/run runs it for Python 3.11 with the library install and examples, then 3.12, 3.13 and 3.10).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ci.matrix import load
from ci.sessions import install
from ci.sessions import quickstart as Q
from ci.sessions.install import CellChoiceError, choose_cell, install_cell, install_flash_attn, pip_args

pytestmark = pytest.mark.usefixtures("pytorchs_own_index")


@pytest.fixture(scope="module")
def matrix():
    return load()


def test_each_supported_python_gets_its_quickstart_cell(matrix):
    for py in ("3.10", "3.11", "3.12", "3.13"):
        cell = choose_cell(matrix, py)
        assert cell.python == py and cell.id == matrix.quickstart[py]
    assert choose_cell(matrix, "3.11").id == "cpu-torch2.13-py311"


@pytest.mark.parametrize("python", ["3.9", "3.14"])
def test_unsupported_python_names_the_pythons_to_use(matrix, python):
    with pytest.raises(CellChoiceError) as e:
        choose_cell(matrix, python)
    msg = str(e.value)
    assert f"Python {python} is not supported" in msg and "3.10, 3.11, 3.12, 3.13" in msg
    assert "python3.12 -m venv .venv" in msg and "NSA_CELL" in msg


def test_a_cell_for_another_python_names_the_cell_and_the_python_to_use(matrix):
    with pytest.raises(CellChoiceError) as e:
        choose_cell(matrix, "3.12", "cpu-torch2.13-py311")
    msg = str(e.value)
    assert "cell cpu-torch2.13-py311 is locked for Python 3.11, this session runs Python 3.12" in msg
    assert "NSA_CELL=cu130-torch2.13-py312" in msg and "python3.11 -m venv .venv" in msg
    with pytest.raises(CellChoiceError, match="unknown cell 'nope'"):
        choose_cell(matrix, "3.11", "nope")
    assert choose_cell(matrix, "3.12", "cu130-torch2.11-py312").id == "cu130-torch2.11-py312"


def test_install_args_carry_the_cells_index(matrix):
    cpu = pip_args(matrix, matrix.get("cpu-torch2.13-py311"))
    assert cpu[:2] == ["--require-hashes", "--no-deps"] and cpu[-2] == "-r"
    assert cpu[cpu.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert "--extra-index-url" not in pip_args(matrix, matrix.get("cu130-torch2.13-py312"))


def test_readme_blocks_are_the_quick_start_and_the_library_install():
    assert Q.readme_commands() == [
        "python3 -m venv .venv && .venv/bin/pip install --require-hashes -r requirements/bootstrap.txt"
        " && .venv/bin/nox -s cpu_smoke",
        ".venv/bin/nox -s tests",
    ]
    install = Q.readme_commands("Install the library for use")
    assert any("--extra-index-url https://download.pytorch.org/whl/cpu" in c for c in install)
    assert any("nsa_env --check-lock" in c for c in install)
    assert "import torch" in Q.readme_blocks("Using it", "python")[0]


def test_every_readme_pip_install_is_followed_by_pip_check():
    quick = Q.with_pip_check(Q.readme_commands())
    assert quick[0].startswith("python3 -m venv .venv && .venv/bin/pip install") and quick[1] == ".venv/bin/pip check"
    assert quick[2] == ".venv/bin/nox -s tests"  # nox sessions run their own pip check (install_cell)
    library = Q.with_pip_check(Q.readme_commands("Install the library for use"))
    installs = [i for i, c in enumerate(library) if "/bin/pip install" in c]
    assert len(installs) == 2 and all(library[i + 1] == "~/nsa-env/bin/pip check" for i in installs)
    twice = "a/bin/pip install x && a/bin/pip install y"
    assert Q.with_pip_check([twice, "b/bin/python -m x"]) == [twice, "a/bin/pip check", "b/bin/python -m x"]


def _wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal valid wheel (metadata only)."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_local_index_serves_pytorchs_layout_to_pip(tmp_path, matrix, monkeypatch):
    """The PEP 503 index the Quick start test serves: pip finds and downloads from /whl/<variant>/<project>/."""
    files = tmp_path / "files"
    files.mkdir()
    wheels = [_wheel(files, "nsa_fake_dep", "1.2.3"), _wheel(files, "Other.Pkg", "0.1")]
    monkeypatch.setattr(Q, "download_wheels", lambda m, c, dest: wheels)
    cell = matrix.get("cpu-torch2.13-py311")
    with Q.local_index(matrix, cell) as env:
        url = env["NSA_PYTORCH_INDEX"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/whl")
        out = tmp_path / "out"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--index-url", f"{url}/cpu", "-d",
             str(out), "nsa-fake-dep==1.2.3", "other-pkg"],
            env=Q.clean_env({}), capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(w.name for w in wheels)
    with Q.local_index(matrix, matrix.get("cu130-torch2.13-py312")) as env:
        assert env == {}  # PyPI alone: nothing to serve


def test_clean_env_drops_every_pip_setting(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/somewhere")
    monkeypatch.setenv("PIP_INDEX_URL", "http://elsewhere/simple")
    env = Q.clean_env({"NSA_PYTORCH_INDEX": "http://127.0.0.1:1/whl"})
    assert env["PIP_CONFIG_FILE"] == "/dev/null" and env["NSA_PYTORCH_INDEX"] == "http://127.0.0.1:1/whl"
    assert not [k for k in env if k.startswith("PIP_") and k != "PIP_CONFIG_FILE"]


class RecordingSession:
    """What install_flash_attn asks of a nox session."""

    def __init__(self):
        self.installs, self.logs = [], []

    def install(self, *args, env=None):
        self.installs.append((args, env))

    def log(self, msg):
        self.logs.append(msg)

    warn = log

    def error(self, msg):
        raise RuntimeError(msg)


def test_gpu_sessions_install_the_cells_flash_attn_pin(matrix, monkeypatch):
    monkeypatch.delenv("NSA_FLASH_ATTN", raising=False)
    s = RecordingSession()
    install_flash_attn(s, matrix, matrix.get("cu130-torch2.12-py312"))  # source package, compiled
    ((args, env),) = s.installs
    assert args[-1].endswith("requirements/locks/cu130-torch2.12-py312.flash-attn.txt")
    assert "--require-hashes" in args and "--no-build-isolation" in args
    assert env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE"  # setup.py never fetches an unpinned wheel
    s = RecordingSession()
    install_flash_attn(s, matrix, matrix.get("cu128-torch2.8-py311"))  # upstream wheel
    assert s.installs[0][0][-1].endswith("cu128-torch2.8-py311.flash-attn.txt") and s.installs[0][1] == {}
    s = RecordingSession()
    install_flash_attn(s, matrix, matrix.get("cu130-torch2.14-py312"))  # none, and the log says why
    assert not s.installs and "C++20" in s.logs[0]
    monkeypatch.setenv("NSA_FLASH_ATTN", "0")
    s = RecordingSession()
    install_flash_attn(s, matrix, matrix.get("cu130-torch2.12-py312"))
    assert not s.installs and "left out (NSA_FLASH_ATTN=0)" in s.logs[0]


class FakeNoxSession(RecordingSession):
    """A nox session in a venv of Python 3.11 that records installs and commands; `pip check` fails when asked."""

    def __init__(self, pip_check_fails: bool = False):
        super().__init__()
        self.virtualenv, self.env, self.runs, self.pip_check_fails = object(), {}, [], pip_check_fails

    def run(self, *args, silent=False):
        self.runs.append(args)
        if args[1:] == ("-m", "pip", "check") and self.pip_check_fails:
            raise RuntimeError("Command python -m pip check failed with exit code 1")  # what nox raises, in kind
        return "3.11\n" if "-c" in args else None

    def install(self, *args, env=None):
        super().install(*args, env=env)
        self.runs.append(("pip", "install", *args))


def test_install_cell_runs_pip_check_after_every_install(monkeypatch):
    monkeypatch.delenv("NSA_CELL", raising=False)
    monkeypatch.setattr(install, "unreachable", lambda url: None)  # the index probe: tests/ci/test_index_probe.py
    s = FakeNoxSession()
    assert install_cell(s).id == "cpu-torch2.13-py311" and s.env["NSA_CELL"] == "cpu-torch2.13-py311"
    installs = [i for i, r in enumerate(s.runs) if r[:2] == ("pip", "install")]
    check = s.runs.index(("python", "-m", "pip", "check"))
    assert installs and check > max(installs) and check == len(s.runs) - 1
    assert s.runs[installs[0]][-1].endswith("requirements/locks/cpu-torch2.13-py311.txt")
    with pytest.raises(RuntimeError, match="pip check failed"):
        install_cell(FakeNoxSession(pip_check_fails=True))
