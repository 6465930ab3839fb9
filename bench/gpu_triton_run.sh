#!/usr/bin/env bash
# The one GPU run of the Triton selection kernel. From the repo root on the GPU machine:
#     OUT=/some/dir bash bench/gpu_triton_run.sh
# Writes to $OUT: env.json, nvidia-smi.txt, pytest_triton_sel.log + junit_triton_sel.xml (GPU tests),
# sanitizer.log (compute-sanitizer memcheck over tests/sanitizer/triton_sel_edge_sweep.py), bench/bench_sel_triton.{csv,json}
# + bench.log, summary.txt. Time limits (seconds, overridable): TESTS_S=420, SANITIZER_S=120, BENCH_S=120
# (the bench's own --max-seconds is BENCH_S - 40). SKIP=tests,sanitizer,bench skips parts, e.g. two calls
# under a 10-minute limit: `SKIP=bench` then `SKIP=tests,sanitizer BENCH_S=540`.
# Exit status: non-zero when any part failed; every part runs regardless.
set -uo pipefail
# shellcheck source=bench/gpu_run_common.sh
source "$(dirname "$0")/gpu_run_common.sh"
TESTS_S=${TESTS_S:-420}; SANITIZER_S=${SANITIZER_S:-120}; BENCH_S=${BENCH_S:-120}; SKIP=${SKIP:-}
rc=0; tests_rc=skipped; san_rc=skipped; bench_rc=skipped

if [[ ",$SKIP," != *,tests,* ]]; then
    echo "== GPU tests (Triton selection) =="
    timeout "$TESTS_S" $PY -m pytest -q -m gpu -p no:cacheprovider -rs -s \
        tests/gpu/test_triton_sel_parity_gpu.py tests/gpu/test_triton_sel_backward_gpu.py \
        tests/gpu/test_triton_sel_bwd_gpu.py \
        --junitxml="$OUT/junit_triton_sel.xml" 2>&1 | tee "$OUT/pytest_triton_sel.log"
    tests_rc=${PIPESTATUS[0]}; [ "$tests_rc" -eq 0 ] || rc=1
fi

if [[ ",$SKIP," != *,sanitizer,* ]]; then
    echo "== compute-sanitizer memcheck: Triton selection edge sweep =="
    # tests/sanitizer: the sweep under compute-sanitizer memcheck (its full output in $OUT/sanitizer/triton_sel.log).
    NSA_REQUIRE_SANITIZER=1 NSA_SANITIZER_LOGS="$OUT/sanitizer" timeout "$SANITIZER_S" $PY -m pytest -q -p no:cacheprovider \
        -rs "tests/sanitizer/test_memcheck.py::test_sweep_is_memcheck_clean[triton_sel]" > "$OUT/sanitizer.log" 2>&1
    san_rc=$?
    [ "$san_rc" -eq 0 ] || rc=1
    tail -3 "$OUT/sanitizer.log"
fi

if [[ ",$SKIP," != *,bench,* ]]; then
    echo "== bench_sel_triton =="
    timeout "$BENCH_S" $PY bench/bench_sel_triton.py --out "$OUT/bench" --max-seconds $((BENCH_S - 40)) 2>&1 \
        | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}; [ "$bench_rc" -eq 0 ] || rc=1
fi

$PY - "$OUT" "$tests_rc" "$san_rc" "$bench_rc" <<'PYEOF' | tee "$OUT/summary.txt"
import csv, os, re, sys, xml.etree.ElementTree as ET
out, tests_rc, san_rc, bench_rc = sys.argv[1:]
print("\n== summary ==")
try:
    r = ET.parse(os.path.join(out, "junit_triton_sel.xml")).getroot()
    s = r if r.tag == "testsuite" else r.find("testsuite")
    print(f"GPU tests  rc={tests_rc}  tests={s.get('tests')} failures={s.get('failures')} "
          f"errors={s.get('errors')} skipped={s.get('skipped')} time={float(s.get('time', 0)):.0f}s")
except Exception as e:  # noqa: BLE001
    print(f"GPU tests  rc={tests_rc}  junit unreadable: {e}")
try:
    m = re.search(r"ERROR SUMMARY: (\d+) error", (open(p, errors="replace").read() if os.path.exists(p := os.path.join(out, "sanitizer", "triton_sel.log")) else ""))
except OSError:
    m = None
print(f"sanitizer  rc={san_rc}  memcheck errors={m.group(1) if m else '?'}")
try:
    rows = list(csv.DictReader(open(os.path.join(out, "bench", "bench_sel_triton.csv"))))
except OSError:
    rows = []
print(f"bench      rc={bench_rc}  rows={len(rows)}")
cols = ["T", "G", "Dk", "Dv", "indices", "fwd_ms", "bwd_ms", "dense_fa2_fwd_ms", "dense_fa2_bwd_ms", "speedup_fwd",
        "speedup_bwd", "fwd_tbps", "bwd_tbps", "status"]
print(" ".join(f"{c:>9}" for c in cols))
for r in rows:
    vals = []
    for c in cols:
        v = r.get(c, "")
        try:
            v = f"{float(v):.4g}" if c not in ("T", "G", "Dk", "Dv") else v
        except ValueError:
            pass
        vals.append(f"{v:>9}")
    print(" ".join(vals))
PYEOF
exit $rc
