"""The README's Quick start as a new user runs it: a fresh clone, no pip configuration, only package indexes.

    python -m ci.sessions.quickstart [--python 3.12] [--library] [--if-available]  # the README's commands, fresh clone
    python -m ci.sessions.quickstart --mirror CELL -- CMD         # run CMD with the cell's index served from 127.0.0.1

The Quick start installs the Quick-start cell of the interpreter `python3` runs (requirements/matrix.toml).
Where that cell's torch comes from PyTorch's index (the +cpu build), which this CI machine cannot reach,
the lock's wheels are fetched once with pip's configured sources and served from a PEP 503 index on
127.0.0.1 under PyTorch's own path layout (/whl/<variant>/<project>/), and NSA_PYTORCH_INDEX points the
cell's index there: exactly what a user behind a mirror of download.pytorch.org does. The commands are the
first bash block under "## Quick start" in README.md, run with `python3` being the requested Python,
PIP_CONFIG_FILE=/dev/null and no PIP_* variables, so pip sees PyPI and the cell's index and nothing else.
--library then runs the block of "## Install the library for use" (PyTorch's index URL in it replaced by
the local one, HOME a temp dir) and the Python examples of "## Using it" with that environment's python,
from a directory outside the checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import html
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


def write_index(wheels: list[Path], root: Path, variant: str) -> None:
    """A static PEP 503 'simple' index of the wheels at root/whl/<variant>/<project>/ (PyTorch's layout)."""
    base = root / "whl" / variant
    projects: dict[str, list[Path]] = {}
    for w in wheels:
        projects.setdefault(canonicalize_name(parse_wheel_filename(w.name)[0]), []).append(w)
    for project, files in projects.items():
        (base / project).mkdir(parents=True, exist_ok=True)
        links = []
        for w in files:
            (base / project / w.name).symlink_to(w.resolve())
            digest = hashlib.sha256(w.read_bytes()).hexdigest()
            links.append(f'<a href="{html.escape(w.name)}#sha256={digest}">{html.escape(w.name)}</a><br>')
        page = "\n".join(links)
        (base / project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{page}\n</body></html>\n")
    index = "\n".join(f'<a href="{p}/">{p}</a><br>' for p in sorted(projects))
    (base / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{index}\n</body></html>\n")


@contextlib.contextmanager
def local_index(matrix: Matrix, cell: Cell) -> Iterator[dict[str, str]]:
    """Serve the cell's wheels on 127.0.0.1; yields the environment that points the cell's index there
    (nothing when the cell installs from PyPI alone)."""
    if not matrix.index_url(cell, environ={}):
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="nsa-index-") as tmp:
        wheels = download_wheels(matrix, cell, Path(tmp) / "files")  # pip's configured sources
        write_index(wheels, Path(tmp) / "www", cell.variant)
        handler = functools.partial(_QuietHandler, directory=str(Path(tmp) / "www"))
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}/whl"
        print(f"quickstart: {len(wheels)} wheels of {cell.id} served at {url}/{cell.variant}/", flush=True)
        try:
            yield {PYTORCH_INDEX_ENV: url}
        finally:
            server.shutdown()
            server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
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
        bin_dir.mkdir()
        home.mkdir()
        for name in ("python3", f"python{python}"):  # the README's `python3` is the Python under test
            (bin_dir / name).symlink_to(exe)
        env = {**clean_env(index_env), "HOME": str(home)}
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        print(f"quickstart: Python {python} ({exe}), cell {cell.id}, fresh clone {clone}, PIP_CONFIG_FILE=/dev/null")
        rc = run_all(readme_commands(), clone, env)
        if rc == 0 and library:
            mirror = index_env.get(PYTORCH_INDEX_ENV)
            install = [c.replace(matrix.defaults["pytorch_index"], mirror) if mirror else c
                       for c in readme_commands("Install the library for use")]
            examples = home / "examples.py"
            examples.write_text("\n".join(readme_blocks("Using it", "python")))
            rc = run_all([*install, f"cd {home} && ~/nsa-env/bin/python {examples.name}"], clone, env)
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
