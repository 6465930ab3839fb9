"""The README's Quick start as a new user runs it: a fresh clone, no pip configuration, only package indexes.

    python -m ci.sessions.quickstart [--python 3.12] [--library] [--if-available]  # the README's commands, fresh clone
    python -m ci.sessions.quickstart --mirror CELL -- CMD         # run CMD with the cell's index served from 127.0.0.1

The Quick start installs the Quick-start cell of `python3`'s Python. Where that cell's torch comes from
PyTorch's index (the +cpu build), out of reach in CI, the lock's wheels are fetched with pip's configured
sources and served on 127.0.0.1 in that index's layout, NSA_PYTORCH_INDEX pointing there, as for a user behind
a mirror of it. The commands are the first bash block under "## Quick start" in README.md, run with `python3`
the requested Python, no pip configuration (PIP_CONFIG_FILE=/dev/null, no PIP_*), each pip install followed by
`pip check`. --library then runs the block of "## Install the library for use" (PyTorch's index URL in it
replaced by the local one, HOME a temp dir) and the Python examples of "## Using it", from a directory outside
the checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from ci.locks import download_wheels
from ci.matrix import PYTORCH_INDEX_ENV, Cell, Matrix, load
from ci.sessions.install import choose_cell

ROOT = Path(__file__).resolve().parents[2]


def readme_blocks(section: str, lang: str, readme: Path = ROOT / "README.md") -> list[str]:
    """The ```lang blocks of a README section, in order."""
    text = readme.read_text(encoding="utf-8").split(f"\n## {section}\n", 1)[-1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{lang}\n(.*?)```", text, re.S)
    if not blocks:
        raise SystemExit(f"quickstart: README.md has no ```{lang} block under '## {section}'")
    return blocks


def readme_commands(section: str = "Quick start") -> list[str]:
    """The commands of the section's first bash block: comments and blank lines dropped, continued lines joined."""
    lines = readme_blocks(section, "bash")[0].replace("\\\n", " ").splitlines()
    return [ln.split("  # ", 1)[0] for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def with_pip_check(commands: list[str]) -> list[str]:
    """The commands, each one that runs `<venv>/bin/pip install` followed by `<venv>/bin/pip check`: the
    README installs hash-pinned locks with --no-deps, which check no requirement; pip check does."""
    checks = [[f"{venv}/bin/pip check" for venv in dict.fromkeys(re.findall(r"(\S+)/bin/pip install", c))]
              for c in commands]
    return [line for c, after in zip(commands, checks) for line in (c, *after)]


def find_python(version: str) -> str | None:
    """An interpreter for Python `version` ("3.12"): python3.12 on PATH, else one that pyenv installed."""
    candidates = [shutil.which(f"python{version}")]
    if pyenv := shutil.which("pyenv"):
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(Path(root).glob(f"versions/{version}.*/bin/python{version}"), reverse=True)
    for c in filter(None, candidates):
        probe = subprocess.run([str(c), "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
        if probe.returncode == 0:  # the interpreter itself, not a launcher (pyenv shims pick by their name)
            return probe.stdout.strip()
    return None


# --- the local index ---------------------------------------------------------------------------------


@contextlib.contextmanager
def local_index(matrix: Matrix, cell: Cell) -> Iterator[dict[str, str]]:
    """Serve the cell's wheels on 127.0.0.1 in PyTorch's layout, /whl/<variant>/<project>/<wheel>, where the
    server's listing of a project's folder is its PEP 503 page (pip checks the lock's hashes on download);
    yields the environment that points the cell's index there (nothing when it installs from PyPI alone)."""
    if not matrix.index_url(cell, environ={}):
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="nsa-index-") as tmp:
        wheels = download_wheels(matrix, cell, Path(tmp) / "files")  # pip's configured sources
        for w in wheels:
            project = Path(tmp) / "www" / "whl" / cell.variant / canonicalize_name(parse_wheel_filename(w.name)[0])
            project.mkdir(parents=True, exist_ok=True)
            (project / w.name).symlink_to(w.resolve())
        server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(Path(tmp) / "www")))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/whl"
        print(f"quickstart: {len(wheels)} wheels of {cell.id} served at {url}/{cell.variant}/", flush=True)
        try:
            yield {PYTORCH_INDEX_ENV: url}
        finally:
            server.shutdown()
            server.server_close()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


# --- the Quick start ---------------------------------------------------------------------------------


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any pip configuration (PIP_*), with PIP_CONFIG_FILE=/dev/null."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NSA_", "VIRTUAL_ENV"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **extra}


def run_all(commands: list[str], cwd: Path, env: dict[str, str]) -> int:
    for i, cmd in enumerate(commands, 1):
        print(f"quickstart: [{i}/{len(commands)}] {cmd}", flush=True)
        start = time.monotonic()
        rc = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=cwd, env=env).returncode
        print(f"quickstart: [{i}/{len(commands)}] exit {rc} in {time.monotonic() - start:.0f} s", flush=True)
        if rc != 0:
            return rc
    return 0


def quickstart(python: str, library: bool = False, if_available: bool = False) -> int:
    exe = find_python(python)
    if exe is None:
        print(f"quickstart: no Python {python} on this machine" + (": skipped" if if_available else ""))
        return 0 if if_available else 1
    matrix = load()
    cell = choose_cell(matrix, python)
    t0 = time.monotonic()
    with local_index(matrix, cell) as index_env, tempfile.TemporaryDirectory(prefix="nsa-quickstart-") as tmp:
        clone, bin_dir, home = Path(tmp) / "nsa", Path(tmp) / "bin", Path(tmp) / "home"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        bin_dir.mkdir(), home.mkdir()
        for name in ("python3", f"python{python}"):  # the README's `python3` is the Python under test
            (bin_dir / name).symlink_to(exe)
        env = {**clean_env(index_env), "HOME": str(home)}
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        addopts = f", PYTEST_ADDOPTS={env['PYTEST_ADDOPTS']!r}" if env.get("PYTEST_ADDOPTS") else ""
        print(f"quickstart: Python {python} ({exe}), cell {cell.id}, fresh clone {clone}, "
              f"PIP_CONFIG_FILE=/dev/null{addopts}")
        rc = run_all(with_pip_check(readme_commands()), clone, env)
        if rc == 0 and library:
            mirror = index_env.get(PYTORCH_INDEX_ENV)
            install = [c.replace(matrix.defaults["pytorch_index"], mirror) if mirror else c
                       for c in readme_commands("Install the library for use")]
            examples = home / "examples.py"
            examples.write_text("\n".join(readme_blocks("Using it", "python")))
            rc = run_all([*with_pip_check(install), f"cd {home} && ~/nsa-env/bin/python {examples.name}"], clone, env)
    what = "Quick start" + (", library install and examples" if library else "")
    print(f"quickstart: Python {python}: the README's {what} {'passed' if rc == 0 else 'FAILED'} "
          f"in {time.monotonic() - t0:.0f} s")
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.sessions.quickstart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default="{}.{}".format(*sys.version_info), help="Python X.Y (default: this one)")
    ap.add_argument("--library", action="store_true", help="then the library install and the README's examples")
    ap.add_argument("--if-available", action="store_true", help="skip, do not fail, without that Python")
    ap.add_argument("--mirror", metavar="CELL", help="run the command after -- with CELL's index served locally")
    ap.add_argument("command", nargs="*", help="with --mirror: the command to run")
    args = ap.parse_args(argv)
    if not args.mirror:
        return quickstart(args.python, args.library, args.if_available)
    matrix = load()
    with local_index(matrix, matrix.get(args.mirror)) as index_env:
        return subprocess.run(args.command, env={**os.environ, **index_env}).returncode


if __name__ == "__main__":
    sys.exit(main())
