"""nox sessions: the same commands on a laptop, in our images, on the lent GPU machine and in CI.

Every session installs one configuration cell of requirements/matrix.toml exactly, from its hash-pinned
lock, then this project without dependencies. Pick a cell with NSA_CELL (default: the CPU cell).
`--no-venv` runs a session in the current interpreter (inside an image or on a prepared GPU host).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "cpu_smoke"]
nox.options.error_on_missing_interpreters = False

DEFAULT_CELL = "cpu-torch2.13-py311"


def cell_id() -> str:
    return os.environ.get("NSA_CELL", DEFAULT_CELL)


def install_cell(session: nox.Session, cell: str | None = None) -> None:
    """Install the cell's lock exactly (hashes, no resolver), then this project without dependencies.

    With --no-venv nothing is installed: the interpreter is assumed prepared (image, GPU host).
    """
    if isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.log("--no-venv: using the current interpreter as it is")
        return
    cell = cell or cell_id()
    lock = ROOT / "requirements" / "locks" / f"{cell}.txt"
    if not lock.exists():
        rel = lock.relative_to(ROOT)
        session.error(f"no lock for cell {cell!r}: expected {rel} (run `nox -s lock -- {cell}`)")
    # A lock is resolved for one Python (its header says which): refuse another one with a clear error
    # rather than letting pip fail on a missing wheel deep in the install.
    header = [ln for ln in lock.read_text().splitlines() if ln.startswith("# python:")]
    want = header[0].split(":", 1)[1].strip() if header else ""
    have = session.run("python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])", silent=True)
    have = have.strip() if isinstance(have, str) else want  # nox returns None under --no-install reuse
    if want and want != have:
        session.error(f"cell {cell!r} is locked for Python {want}, this session runs Python {have}")
    # Torch builds that are not on PyPI (the CPU cell's +cpu) come from PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS,
    # which pip reads from the environment (docs/environments.md).
    session.install("--require-hashes", "--no-deps", "-r", str(lock))
    session.install("--no-deps", "--no-build-isolation", "-e", ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (pytest-xdist over the available cores). Extra args go to pytest."""
    install_cell(session)
    args = session.posargs or ["tests/cpu", "-n", "auto", "-q"]
    session.run("python", "-m", "pytest", *args, env={"TRITON_INTERPRET": "1"})


@nox.session
def cpu_smoke(session: nox.Session) -> None:
    """The main job: tiny NSA model forward, backward and generate on CPU; JSON report under artifacts/."""
    install_cell(session)
    session.run("python", "-m", "nsa.smoke", *session.posargs)


@nox.session(venv_backend="none")
def lock(session: nox.Session) -> None:
    """Regenerate the hash-pinned locks from requirements/*.in and matrix.toml (all, or `-- CELL ...`).

    `-- --check` fails when any lock is stale (offline: compares the inputs' digest in each lock header).
    Runs in nox's own interpreter, which has uv and packaging (requirements/bootstrap.txt).
    """
    session.run(sys.executable, "-m", "ci.locks", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Offline checks: actionlint (+shellcheck), workflow JSON schema, zizmor, hadolint, yamllint, ruff and
    the project's workflow policy (ci/lint.py), then the self-tests that seed bad workflows. Tools come
    from the hash-pinned requirements/locks/lint.txt. `-- --only zizmor,policy` runs a subset."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("--require-hashes", "-r", "requirements/locks/lint.txt")
    session.run("python", "ci/lint.py", *session.posargs)
    if not session.posargs:
        # --noconftest/-o addopts: the lint venv has no torch; these tests need none.
        session.run(
            "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-o", "addopts=",
            "tests/cpu/test_workflows.py", env={"NSA_REQUIRE_LINT_TOOLS": "1"},
        )


@nox.session
def rehearse(session: nox.Session) -> None:
    """Run ci.yml's CPU jobs' steps locally with `act` on this host, offline (ci/rehearse.py says which;
    docs/runners.md says how). `act` comes from requirements/locks/lint.txt. Args: job ids."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("--require-hashes", "-r", "requirements/locks/lint.txt")
    session.run("python", "ci/rehearse.py", *session.posargs)


@nox.session(python=False)
def images(session: nox.Session) -> None:
    """Docker images of the matrix cells (docs/images.md). `-- --plan [CELL ...]` prints the build plan
    (tags, bases, flash-attn source, expected size) without building; `-- [CELL ...] [--offline] [--push]
    [--registry R]` builds one cell or all (ci/images.py, BuildKit); `-- --ci` is CI's build-and-run test of
    the CPU image (docker/build_cpu_ci.sh: root, installs docker.io, ~3 min)."""
    args = list(session.posargs)
    if "--ci" in args:
        session.run("bash", "docker/build_cpu_ci.sh", external=True, env={"PYTHON": sys.executable})
        return
    if "--plan" in args:
        args.remove("--plan")
        session.run(sys.executable, "-m", "ci.images", "plan", *args, external=True)
        return
    session.run(sys.executable, "-m", "ci.images", "build", *args, external=True)


# --- GPU suites (ci/gpu_sessions.py; docs/gpu-suites.md) -------------------------------------------------
# Each: fails on a machine with no GPU unless `-- --skip-no-gpu` (or NSA_SKIP_NO_GPU=1); writes
# artifacts/<commit>/<cell>/<gpu-slug>/ (summary.md, known_good.json, junit, logs). `-- --full`: long sweeps.


@nox.session
def gpu_parity(session: nox.Session) -> None:
    """GPU parity: FA-2 cmp/win, Triton selection (when present), decode vs prefill, torch vs fp64 oracle."""
    from ci.gpu_sessions import nox_entry

    nox_entry(session, "gpu_parity")


@nox.session
def backward(session: nox.Session) -> None:
    """Gradient parity, fp64 gradcheck on CUDA, and the tiny model's training smoke (loss must fall)."""
    from ci.gpu_sessions import nox_entry

    nox_entry(session, "backward")


@nox.session
def bench(session: nox.Session) -> None:
    """Prefill, decode and FA-2 benches (quick; `-- --full` for the sweeps), then the bench gate."""
    from ci.gpu_sessions import nox_entry

    nox_entry(session, "bench")


@nox.session
def oneshot(session: nox.Session) -> None:
    """The seeds' runbook in order: environment, routing, sanity, tests, benches, report."""
    from ci.gpu_sessions import nox_entry

    nox_entry(session, "oneshot")


@nox.session(venv_backend="none")
def publish(session: nox.Session) -> None:
    """Merge artifacts/**/known_good.json (or `-- FILES/DIRS`) into KNOWN_GOOD.md and known_good.json."""
    session.run(sys.executable, "-m", "ci.known_good", *session.posargs, external=True)
