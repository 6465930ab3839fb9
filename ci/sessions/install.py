"""Which configuration cell a nox session installs, and installing it from its lock with its package index.

The cell is NSA_CELL, else the Quick-start cell of the session's Python ([defaults.quickstart]); another Python,
or a cell locked for another one, stops the session naming what to use, and so does an unreachable index. GPU
sessions also install the flash-attn pin (locks/<cell>.flash-attn.txt: a wheel, or the source compiled with nvcc
here; NSA_FLASH_ATTN=0 leaves it out, and says so). `pip check` ends each install."""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from urllib.parse import urlsplit

from packaging.version import Version

from ci.locks import flash_install_args, flash_lock_path, lock_path
from ci.matrix import Cell, Matrix, load


class CellChoiceError(RuntimeError):
    """No cell of the matrix can be installed into this interpreter as asked."""


def choose_cell(matrix: Matrix, python: str, requested: str | None = None) -> Cell:
    """The cell to install into a Python `python` ("3.12"): `requested` (NSA_CELL), else the Quick-start one."""
    quick = matrix.quickstart
    supported = ", ".join(sorted(quick, key=Version))
    if requested:
        try:
            cell = matrix.get(requested)
        except KeyError as e:
            raise CellChoiceError(f"NSA_CELL: {e.args[0]}") from None
        if cell.python != python:
            other = f"NSA_CELL={quick[python]} (the cell for Python {python}) or " if python in quick else ""
            raise CellChoiceError(f"cell {cell.id} is locked for Python {cell.python}, this session runs Python "
                                  f"{python}: use {other}a venv made with python{cell.python} (`python{cell.python} "
                                  "-m venv .venv`)")
        return cell
    if python not in quick:
        raise CellChoiceError(f"Python {python} is not supported: the Quick start supports Python {supported}. Make "
                              "the venv with one of them (e.g. `python3.12 -m venv .venv`), or set NSA_CELL to a cell "
                              f"locked for Python {python} (`python -m ci.matrix list`)")
    return matrix.get(quick[python])


def pip_args(matrix: Matrix, cell: Cell) -> list[str]:
    """`pip install` arguments that install the cell's lock exactly, from the cell's package index."""
    return ["--require-hashes", "--no-deps", *matrix.pip_index_args(cell), "-r", str(lock_path(matrix, cell.id))]


def unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why no TCP connection to `url`'s host (or proxy) opens within `timeout` s; pip would retry for minutes."""
    u = urlsplit(url)
    t = u if urllib.request.proxy_bypass(u.hostname or "") else urlsplit(urllib.request.getproxies().get(u.scheme, url))
    try:
        socket.create_connection((t.hostname, t.port or (443 if t.scheme == "https" else 80)), timeout).close()
    except OSError as e:
        return f"{t.hostname}:{t.port or t.scheme}: {e.strerror or e}"


def install_cell(session, flash_attn: bool = False) -> Cell | None:
    """Install the session's cell exactly (hashes, no resolver), with `flash_attn` its flash-attn pin, then this
    project without dependencies; exports NSA_CELL. With --no-venv nothing is installed (a prepared interpreter)."""
    import nox

    if isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.log("--no-venv: using the current interpreter as it is")
        return None
    out = session.run("python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])", silent=True)
    python = out.strip() if isinstance(out, str) else "{}.{}".format(*sys.version_info)  # None when reused
    matrix = load()
    try:
        cell = choose_cell(matrix, python, os.environ.get("NSA_CELL"))
    except CellChoiceError as e:
        session.error(str(e))
    if not lock_path(matrix, cell.id).exists():
        session.error(f"no lock for cell {cell.id}: run `nox -s lock -- {cell.id}`")
    session.log(f"cell {cell.id} (Python {cell.python}, torch {cell.torch})")
    if (url := matrix.index_url(cell)) and (why := unreachable(url)):
        free = ", ".join(c for c in matrix.quickstart.values() if not matrix.index_url(matrix.get(c)))
        session.error(f"cell {cell.id} installs torch from {url}, which cannot be reached ({why}). Behind a mirror of "
                      "PyTorch's index set NSA_PYTORCH_INDEX to its base URL, or use a cell that needs no extra index: "
                      f"{free} (`python -m ci.matrix list` shows each cell's index).")
    session.install(*pip_args(matrix, cell))
    if flash_attn:
        install_flash_attn(session, matrix, cell)
    session.install("--no-deps", "--no-build-isolation", "-e", ".")
    # --no-deps checks no requirement: pip check does, and its failure fails the session.
    session.run("python", "-m", "pip", "check")
    session.env["NSA_CELL"] = cell.id
    return cell


def install_flash_attn(session, matrix: Matrix, cell: Cell) -> None:
    """The cell's flash-attn pin, after its lock; a cell without one, or NSA_FLASH_ATTN=0, is logged."""
    if cell.flash_attn.source == "none":
        return session.log(f"flash-attn: none in cell {cell.id} ({matrix.flash_none_reason(cell)})")
    if os.environ.get("NSA_FLASH_ATTN", "1") == "0":
        return session.warn(f"flash-attn: left out (NSA_FLASH_ATTN=0): the flash_attn backend's tests skip in cell "
                            f"{cell.id}")
    if not flash_lock_path(matrix, cell.id).exists():
        session.error(f"no flash-attn pin for cell {cell.id}: run `nox -s lock -- {cell.id}`")
    args, env = flash_install_args(matrix, cell)
    if cell.flash_attn.source == "source":
        session.log(f"flash-attn {cell.flash_attn.version}: compiling the pinned source package (nvcc of CUDA "
                    f"{cell.cuda}; MAX_JOBS bounds memory; NSA_FLASH_ATTN=0 skips it)")
    session.install(*args, env=env)
