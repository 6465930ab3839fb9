#!/usr/bin/env bash
# The one-shot GPU run of the test plan: environment, routing, sanity, Triton selection forward/backward,
# FA-2 parity, decode bench and its summary, FA-2 and selection benches, training smoke and the report,
# as `nox -s oneshot` runs them (docs/gpu-suites.md), written to artifacts/runner/<commit>/<cell>/<gpu>/.
#
#   bash scripts/runner_oneshot.sh [--full] [--skip-no-gpu] [...]   # arguments go to the session
#
# nox is the README's bootstrap one (.venv/bin/nox) when present, else the one on PATH; NSA_NOX_ARGS adds
# nox options (e.g. NSA_NOX_ARGS=--no-venv on a prepared host or in our images). NSA_ARTIFACTS moves the
# output root (default artifacts/runner).
set -euo pipefail
cd "$(dirname "$0")/.."
export NSA_ARTIFACTS="${NSA_ARTIFACTS:-$PWD/artifacts/runner}"
nox_bin="${NSA_NOX:-.venv/bin/nox}"
if [ ! -x "$nox_bin" ]; then
    nox_bin="$(command -v nox || true)"
fi
if [ -z "$nox_bin" ]; then
    echo "runner_oneshot: nox not found: set up the README's bootstrap first (python3 -m venv .venv && .venv/bin/pip install --require-hashes -r requirements/bootstrap.txt)" >&2
    exit 2
fi
# shellcheck disable=SC2086  # NSA_NOX_ARGS is a list of options
exec "$nox_bin" ${NSA_NOX_ARGS:-} -s oneshot -- "$@"
