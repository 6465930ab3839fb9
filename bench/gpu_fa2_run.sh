#!/usr/bin/env bash
# The GPU run of the FA-2 fast paths. From the repo root on the GPU machine:
#     OUT=/some/dir bash bench/gpu_fa2_run.sh
# Writes to $OUT: env.json, pytest_fa2.log + junit_fa2.xml (GPU tests), sanitizer.log (compute-sanitizer
# memcheck over the edge sweep), bench/bench_fa2.{csv,json} + bench.log, fa2_thresholds.json (derived),
# summary.txt. Budget: tests <= 240 s, sanitizer <= 150 s, bench <= 200 s of sweep (+ startup).
# Exit status: non-zero when any part failed; every part runs regardless.
set -uo pipefail
# shellcheck source=bench/gpu_run_common.sh
source "$(dirname "$0")/gpu_run_common.sh"

echo "== GPU tests (FA-2) =="
NSA_TEST_FA2=1 timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/gpu/test_fa2_parity.py tests/gpu/test_fa2_gpu_varlen.py tests/gpu/test_backward_varlen.py \
    tests/gpu/test_fa2_edge_shapes.py --junitxml="$OUT/junit_fa2.xml" 2>&1 | tee "$OUT/pytest_fa2.log"
tests_rc=${PIPESTATUS[0]}; [ "$tests_rc" -eq 0 ] || rc=1

echo "== compute-sanitizer memcheck: edge sweep =="
# tests/sanitizer: the sweep under compute-sanitizer memcheck (its full output in $OUT/sanitizer/fa2.log).
NSA_REQUIRE_SANITIZER=1 NSA_SANITIZER_LOGS="$OUT/sanitizer" timeout 200 $PY -m pytest -q -p no:cacheprovider \
    -rs "tests/sanitizer/test_memcheck.py::test_sweep_is_memcheck_clean[fa2]" > "$OUT/sanitizer.log" 2>&1
san_rc=$?
[ "$san_rc" -eq 0 ] || rc=1
tail -3 "$OUT/sanitizer.log"

echo "== bench_fa2 sweep =="
cp nsa/fa2_thresholds.json "$OUT/fa2_thresholds.json"
timeout 270 $PY bench/bench_fa2.py --out "$OUT/bench" --write-thresholds "$OUT/fa2_thresholds.json" \
    --max-seconds 200 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}; [ "$bench_rc" -eq 0 ] || rc=1

$PY - "$OUT" "$tests_rc" "$san_rc" "$bench_rc" <<'PYEOF' | tee "$OUT/summary.txt"
import csv, os, re, sys, xml.etree.ElementTree as ET
out, tests_rc, san_rc, bench_rc = sys.argv[1], *sys.argv[2:]
print("\n== summary ==")
try:
    r = ET.parse(os.path.join(out, "junit_fa2.xml")).getroot()
    s = r if r.tag == "testsuite" else r.find("testsuite")
    print(f"GPU tests      rc={tests_rc}  tests={s.get('tests')} failures={s.get('failures')} "
          f"errors={s.get('errors')} skipped={s.get('skipped')} time={float(s.get('time', 0)):.0f}s")
except Exception as e:  # noqa: BLE001 - the summary must print whatever is missing
    print(f"GPU tests      rc={tests_rc}  junit unreadable: {e}")
log = (open(p, errors="replace").read() if os.path.exists(p := os.path.join(out, "sanitizer", "fa2.log")) else "")
m = re.search(r"ERROR SUMMARY: (\d+) error", log)
print(f"sanitizer      rc={san_rc}  memcheck errors={m.group(1) if m else '?'}")
try:
    rows = list(csv.DictReader(open(os.path.join(out, "bench", "bench_fa2.csv"))))
except OSError:
    rows = []
print(f"bench          rc={bench_rc}  rows={len(rows)}")
print(f"{'provider':12} {'branch':6} {'D':>4} {'T':>6} {'fa2 ms':>9} {'sdpa ms':>9} {'x sdpa':>7}")
for r in rows:
    if r.get("status") == "ok" and int(r["T"]) >= 4096:
        print(f"{r['provider']:12} {r['branch']:6} {r['D']:>4} {r['T']:>6} {float(r['fa2_ms']):9.3f} "
              f"{float(r['sdpa_ms']):9.3f} {float(r['speedup_vs_sdpa']):7.2f}")
PYEOF
exit $rc
