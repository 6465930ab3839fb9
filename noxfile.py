"""nox sessions: the same commands on a laptop, in our images, on the lent GPU machine and in CI.

Every session installs one configuration cell of requirements/matrix.toml exactly, from its hash-pinned
lock and its package index, then this project without dependencies. Pick a cell with NSA_CELL (default:
the Quick-start cell of the interpreter nox runs on, [defaults.quickstart] of the matrix).
`--no-venv` runs a session in the current interpreter (inside an image or on a prepared GPU host).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

from ci.evidence.artifacts import new_run_id  # noqa: E402  (the checkout's ci/ package, found through sys.path)
from ci.sessions.install import install_cell  # noqa: E402

# The GPU sessions of one nox invocation are one run (docs/gpu-suites.md); a caller may pass its own id.
os.environ.setdefault("NSA_RUN_ID", new_run_id())

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "cpu_smoke"]
nox.options.error_on_missing_interpreters = False


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite: the library, its environment tooling and ci/ (pytest-xdist over all cores).

    tests/cpu (the library), tests/tooling (nsa_env) and tests/ci (ci/ and the workflows). Extra args go to
    pytest."""
    install_cell(session)
    args = session.posargs or ["tests/cpu", "tests/tooling", "tests/ci", "-n", "auto", "-q"]
    session.run("python", "-m", "pytest", *args, env={"TRITON_INTERPRET": "1"})


@nox.session
def cpu_smoke(session: nox.Session) -> None:
    """The main job: tiny NSA model forward, backward and generate on CPU; JSON report under artifacts/."""
    install_cell(session)
    session.run("python", "-m", "nsa.smoke", *session.posargs)


@nox.session(venv_backend="none")
def lock(session: nox.Session) -> None:
    """Regenerate the hash-pinned locks from requirements/*.in and matrix.toml (all, or `-- CELL ...`).

    Each GPU cell's lock gets its flash-attn pin.

    `-- --check` fails when any lock is stale (offline: compares the inputs' digest in each lock header).
    `-- --outdated` asks PyPI what is newer than the matrix and the tool locks (exit 1 when anything is).
    Runs in nox's own interpreter, which has uv and packaging (requirements/bootstrap.txt).
    """
    session.run(sys.executable, "-m", "ci.locks", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Offline checks of the workflows, Dockerfiles, Python style and import contracts, with their self-tests.

    actionlint (+shellcheck), workflow JSON schema, zizmor, hadolint, yamllint, ruff and
    the project's workflow policy (ci/lint.py); the import contracts of pyproject's [tool.importlinter]
    (lint-imports: nsa imports no tooling, ci or bench code; the layers of nsa_env and ci); then the
    self-tests that seed bad workflows and forbidden imports. Tools come from the hash-pinned
    requirements/locks/lint.txt.
    `-- --only zizmor,policy` runs a subset of ci/lint.py's checks (and nothing else)."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("--require-hashes", "-r", "requirements/locks/lint.txt")
    session.run("python", "ci/lint.py", *session.posargs)
    if not session.posargs:
        session.run("lint-imports", "--no-cache")
        # --noconftest/-o addopts: the lint venv has no torch; these tests need none.
        session.run(
            "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-o", "addopts=",
            "tests/ci/test_workflows.py", "tests/ci/test_ci_layout.py", env={"NSA_REQUIRE_LINT_TOOLS": "1"},
        )


@nox.session
def rehearse(session: nox.Session) -> None:
    """Run ci.yml's CPU jobs' steps locally with `act`, as on a runner that reaches only package indexes.

    (ci/sessions/rehearse.py says which jobs and how; docs/runners.md). `act` comes from
    requirements/locks/lint.txt. Args: job ids (default: tests smoke)."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("--require-hashes", "-r", "requirements/locks/lint.txt")
    session.run("python", "-m", "ci.sessions.rehearse", *session.posargs)


@nox.session(python=False)
def images(session: nox.Session) -> None:
    """Docker images of the matrix cells: plan, build, or CI's build-and-check (docs/images.md).

    `-- --plan [CELL ...]` prints the build plan (tags, bases, build args, flash-attn, expected size) without
    building; `-- [CELL ...] [--offline] [--without-flash-attn] [--repo R]` builds one cell or all
    (ci/images.py, BuildKit);
    `-- --ci [cpu] [gpu]` is CI's build-and-check of the CPU image and the cu130-torch2.11-py312 image
    (docker/ci_images.sh: root, installs docker.io, 5-10 min)."""
    args = list(session.posargs)
    if "--ci" in args:
        args.remove("--ci")
        session.run("bash", "docker/ci_images.sh", *args, external=True, env={"PYTHON": sys.executable})
    elif "--plan" in args:
        args.remove("--plan")
        session.run(sys.executable, "-m", "ci.images", "plan", *args, external=True)
    else:
        session.run(sys.executable, "-m", "ci.images", "build", *args, external=True)


# --- GPU suites (ci/sessions/gpu.py; docs/gpu-suites.md) -------------------------------------------------
# One session definition for the four suites. Each fails on a machine with no GPU unless `-- --skip-no-gpu`
# (or NSA_SKIP_NO_GPU=1) and writes artifacts/<commit>/<cell>/<gpu-slug>/ (summary.md, known_good.json,
# junit, logs). `-- --full`: long sweeps. `nox -t gpu` runs gpu_parity, backward, bench and sanitizer (below);
# the first three, in one invocation (one NSA_RUN_ID), and each within its time limit, are what a known-good
# run needs.
GPU_SUITES = {
    "gpu_parity": "GPU parity: FA-2 cmp/win, Triton selection (when present), decode vs prefill, torch vs fp64 oracle.",
    "backward": "Gradient parity, fp64 gradcheck on CUDA, and the tiny model's training smoke (loss must fall).",
    "bench": "Prefill, decode and FA-2 benches (quick; `-- --full` for the sweeps), then the bench gate.",
    "oneshot": "The seeds' runbook in order: environment, routing, sanity, tests, benches, report.",
}


def _gpu_session(suite: str, doc: str) -> None:
    def session_fn(session: nox.Session) -> None:
        from ci.sessions.gpu import nox_entry

        nox_entry(session, suite)

    session_fn.__doc__ = doc
    nox.session(name=suite, tags=[] if suite == "oneshot" else ["gpu"])(session_fn)


for _suite, _doc in GPU_SUITES.items():
    _gpu_session(_suite, _doc)


@nox.session(tags=["gpu"])
def sanitizer(session: nox.Session) -> None:
    """compute-sanitizer memcheck over the GPU edge sweeps; fails on any memcheck error.

    tests/sanitizer/: the fused pipeline, the FA-2 branches, the Triton selection kernel, the decode kernels.
    Also fails on a machine without a CUDA GPU or compute-sanitizer unless `-- --skip-no-gpu` (or
    NSA_SKIP_NO_GPU=1). Other args go to pytest (`-- -k decode`)."""
    install_cell(session, flash_attn=True)  # the FA-2 sweep runs flash-attn where the cell has it
    args = list(session.posargs)
    skip = "--skip-no-gpu" in args or os.environ.get("NSA_SKIP_NO_GPU") == "1"
    args = [a for a in args if a != "--skip-no-gpu"]
    session.run("python", "-m", "pytest", "tests/sanitizer", "-q", "-p", "no:cacheprovider", *args,
                env={"NSA_REQUIRE_SANITIZER": "0" if skip else "1"})


@nox.session
def runbooks(session: nox.Session) -> None:
    """The nsa-vibe runbook's and GPU test plan's commands that need no GPU, run as written.

    tests/runbooks.sh; docs/migration.md. About 15 minutes on 2 cores. Args: a step-name filter."""
    install_cell(session)
    # The documents' `uv run -q ...` lines need uv: nox's own (requirements/bootstrap.txt) after the venv's bin.
    path = os.pathsep.join([session.bin, str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    session.run("bash", "tests/runbooks.sh", *session.posargs, external=True, env={"PATH": path})


@nox.session
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel into dist/ and check them (twine check --strict, the wheel's contents).

    `python -m build`, then `twine check --strict`, then a check that the wheel ships LICENSE, NOTICE and
    py.typed and requires numpy. Tools from the hash-pinned requirements/locks/tools.txt; no torch needed."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("--require-hashes", "-r", "requirements/locks/tools.txt")
    out = ROOT / "dist"
    for old in out.glob("nsa-*"):
        old.unlink()
    session.run("python", "-m", "build", "--outdir", str(out), ".")
    session.run("python", "-m", "twine", "check", "--strict", *map(str, sorted(out.glob("nsa-*"))))
    session.run("python", "-c", _WHEEL_CHECK, *map(str, out.glob("nsa-*.whl")))


_WHEEL_CHECK = """
import sys, zipfile
(wheel,) = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
need = {"nsa/py.typed": any(n == "nsa/py.typed" for n in names),
        "LICENSE": any(n.endswith("licenses/LICENSE") for n in names),
        "NOTICE": any(n.endswith("licenses/NOTICE") for n in names),
        "Requires-Dist: numpy": "Requires-Dist: numpy" in meta,
        "License-Expression: Apache-2.0": "License-Expression: Apache-2.0" in meta}
missing = [k for k, ok in need.items() if not ok]
print(wheel, "ships", ", ".join(need)) if not missing else sys.exit(f"{wheel} lacks: {', '.join(missing)}")
"""


@nox.session(venv_backend="none")
def publish(session: nox.Session) -> None:
    """Merge runs' known_good.json into KNOWN_GOOD.md and known_good.json, judging each run again.

    Inputs: artifacts/**/known_good.json (or `-- FILES/DIRS`); undated, future-dated and non-main CI runs are
    refused with a message (docs/gpu-suites.md)."""
    session.run(sys.executable, "-m", "ci.evidence.known_good", *session.posargs, external=True)
