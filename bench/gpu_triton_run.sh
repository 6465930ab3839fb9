#!/usr/bin/env bash
# The one GPU run of the Triton selection kernel. From the repo root on the GPU machine:
#     OUT=/some/dir bash bench/gpu_triton_run.sh
# Writes to $OUT: env.json, nvidia-smi.txt, pytest_triton_sel.log + junit_triton_sel.xml (GPU tests,
# <= 200 s), bench/bench_sel_triton.{csv,json} + bench.log (<= 150 s), summary.txt. Total <= ~6 min.
# Exit status: non-zero when any part failed; every part runs regardless.
set -uo pipefail
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT/bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
rc=0

$PY -m nsa.env --json > "$OUT/env.json" 2> "$OUT/env.err" || echo "nsa.env failed (see env.err)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

echo "== GPU tests (Triton selection) =="
timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider -rs -s \
    tests/gpu/test_triton_sel_parity_gpu.py tests/gpu/test_triton_sel_backward_gpu.py \
    --junitxml="$OUT/junit_triton_sel.xml" 2>&1 | tee "$OUT/pytest_triton_sel.log"
tests_rc=${PIPESTATUS[0]}; [ "$tests_rc" -eq 0 ] || rc=1

echo "== bench_sel_triton =="
timeout 150 $PY bench/bench_sel_triton.py --out "$OUT/bench" --max-seconds 110 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}; [ "$bench_rc" -eq 0 ] || rc=1

$PY - "$OUT" "$tests_rc" "$bench_rc" <<'PYEOF' | tee "$OUT/summary.txt"
import csv, os, sys, xml.etree.ElementTree as ET
out, tests_rc, bench_rc = sys.argv[1:]
print("\n== summary ==")
try:
    r = ET.parse(os.path.join(out, "junit_triton_sel.xml")).getroot()
    s = r if r.tag == "testsuite" else r.find("testsuite")
    print(f"GPU tests  rc={tests_rc}  tests={s.get('tests')} failures={s.get('failures')} "
          f"errors={s.get('errors')} skipped={s.get('skipped')} time={float(s.get('time', 0)):.0f}s")
except Exception as e:  # noqa: BLE001
    print(f"GPU tests  rc={tests_rc}  junit unreadable: {e}")
try:
    rows = list(csv.DictReader(open(os.path.join(out, "bench", "bench_sel_triton.csv"))))
except OSError:
    rows = []
print(f"bench      rc={bench_rc}  rows={len(rows)}")
print(f"{'T':>6} {'shape':>11} {'impl':>18} {'mode':>8} {'ms':>9} {'GB/s':>7} {'x dense':>8} {'x torch':>8} status")
for r in rows:
    print(f"{r['T']:>6} {r['shape']:>11} {r['impl']:>18} {r['mode']:>8} {r['median_ms']:>9} {r['kv_GBps']:>7} "
          f"{r['speedup_vs_dense_sdpa_causal']:>8} {r['speedup_vs_torch_sel']:>8} {r['status']}")
PYEOF
exit $rc
