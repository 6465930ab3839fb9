#!/usr/bin/env bash
# One GPU run of the NSA pipeline: tests, sanitizer sweep and the whole-operation bench. From the repo root:
#     OUT=/some/dir PARTS="tests sanitizer bench" bash bench/gpu_nsa_run.sh
# PARTS picks and orders the parts (default all three). BENCH_ARGS are passed to bench/bench_nsa.py,
# TEST_ARGS to pytest (default: the pipeline tests, 4 workers). Writes to $OUT: env.json, nvidia-smi.txt,
# pytest_nsa.log + junit_nsa.xml, sanitizer.log, bench/ (bench_nsa.csv, _breakdown.csv, .json, .png) and
# bench.log. Exit status non-zero when any part failed; every selected part runs regardless.
set -uo pipefail
# shellcheck source=bench/gpu_run_common.sh
source "$(dirname "$0")/gpu_run_common.sh"
PARTS=${PARTS:-"tests sanitizer bench"}
for part in $PARTS; do
  case $part in
    tests)
      echo "== GPU tests =="
      # shellcheck disable=SC2086
      timeout "${TEST_TIMEOUT:-330}" $PY -m pytest -q -m gpu -p no:cacheprovider -rs \
        ${TEST_ARGS:-tests/gpu/test_nsa_pipeline_gpu.py -n 4} --junitxml="$OUT/junit_nsa.xml" 2>&1 \
        | tee "$OUT/pytest_nsa.log" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    sanitizer)
      echo "== compute-sanitizer memcheck: tests/sanitizer/nsa_edge_sweep.py =="
      NSA_REQUIRE_SANITIZER=1 NSA_SANITIZER_LOGS="$OUT/sanitizer" timeout "${SAN_TIMEOUT:-300}" $PY -m pytest -q \
        -p no:cacheprovider -rs "tests/sanitizer/test_memcheck.py::test_sweep_is_memcheck_clean[nsa]" > "$OUT/sanitizer.log" 2>&1
      s=$?; tail -5 "$OUT/sanitizer.log"
      [ "$s" -eq 0 ] || rc=1 ;;
    bench)
      echo "== bench_nsa =="
      # shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT:-330}" $PY bench/bench_nsa.py --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    *) echo "unknown part $part" >&2; rc=1 ;;
  esac
done
exit $rc
