#!/bin/sh
# Image entrypoint: print the environment report (to stderr, so that the command's own output stays clean),
# then run the given command. NSA_ENV_REPORT=0 skips the report; NSA_ENV_REPORT=strict stops if it fails.
set -eu
if [ "${NSA_ENV_REPORT:-1}" != 0 ]; then
  if ! python -m nsa_env >&2; then
    echo "nsa-entrypoint: the environment report (python -m nsa_env) failed" >&2
    if [ "${NSA_ENV_REPORT:-1}" = strict ]; then exit 1; fi
  fi
fi
if [ "$#" -eq 0 ]; then
  echo "nsa-entrypoint: no command given" >&2
  exit 2
fi
exec "$@"
