"""An unreachable package index named by a cell stops the session before pip starts retrying (pip would
retry for minutes, then report no matching distribution), naming NSA_PYTORCH_INDEX and the cells that need
no extra index."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci.sessions.install import unreachable

ROOT = Path(__file__).resolve().parents[2]
NO_PROXY_ENV = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connecting is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_names_the_host_and_a_listening_one_passes(monkeypatch):
    for k in [k for k in os.environ if "proxy" in k.lower()]:
        monkeypatch.delenv(k)
    port = _closed_port()
    why = unreachable(f"http://127.0.0.1:{port}/whl/cpu", timeout=2)
    assert why and f"127.0.0.1:{port}" in why
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert unreachable(f"http://127.0.0.1:{srv.getsockname()[1]}/whl/cpu", timeout=2) is None


def test_a_proxy_is_probed_instead_of_the_index(monkeypatch):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{srv.getsockname()[1]}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        assert unreachable("https://index.invalid/whl/cpu", timeout=2) is None  # pip goes through the proxy


def _python311() -> str | None:
    return sys.executable if sys.version_info[:2] == (3, 11) else shutil.which("python3.11")


@pytest.mark.skipif(importlib.util.find_spec("nox") is None, reason="nox is not installed here")
@pytest.mark.skipif(_python311() is None, reason="the CPU cell (PyTorch's index) is for Python 3.11: none here")
def test_quick_start_stops_within_30_s_on_an_unreachable_pytorch_index(tmp_path):
    index = f"http://127.0.0.1:{_closed_port()}/whl"
    env = {**NO_PROXY_ENV, "NSA_PYTORCH_INDEX": index, "PIP_CONFIG_FILE": os.devnull}
    env.pop("NSA_CELL", None)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "cpu_smoke",
                          "--envdir", str(tmp_path / "envs"), "--force-python", _python311()],
                         env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0 and seconds < 30, (seconds, out[-3000:])
    assert f"{index}/cpu, which cannot be reached" in out and "NSA_PYTORCH_INDEX" in out, out[-3000:]
    assert "cu130-torch2.13-py312" in out  # a cell whose torch comes from PyPI
    assert "Retrying" not in out  # pip never started


def test_matrix_list_shows_each_cells_index_in_the_bootstrap_environment():
    """`python -m ci.matrix list` needs only what requirements/bootstrap.txt installs (packaging, tomli < 3.11)
    and shows where each cell's torch comes from."""
    bootstrap = (ROOT / "requirements" / "bootstrap.txt").read_text()
    assert "\npackaging==" in bootstrap and "\ntomli==" in bootstrap
    res = subprocess.run([sys.executable, "-m", "ci.matrix", "list"], cwd=ROOT, capture_output=True, text=True,
                         env={**NO_PROXY_ENV, "NSA_PYTORCH_INDEX": "http://mirror.invalid/whl"})
    assert res.returncode == 0, res.stderr
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines()}
    assert "index http://mirror.invalid/whl/cpu" in lines["cpu-torch2.13-py311"]
    assert "index PyPI" in lines["cu130-torch2.13-py312"]
    assert all(" index " in ln for ln in lines.values())
