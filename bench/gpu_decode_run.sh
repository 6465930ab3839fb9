#!/usr/bin/env bash
# The GPU run of the fast decode step (Triton decode kernels, ragged cache, CUDA graphs). From the repo root
# on the GPU machine:
#     OUT=/some/dir bash bench/gpu_decode_run.sh
# Writes to $OUT: env.json, nvidia-smi.txt; pytest_decode.log + junit_decode.xml (GPU decode tests, contiguous
# and paged cache, mostly Triton compiles, <= 300 s); sanitizer.log (compute-sanitizer memcheck over tests/sanitizer/decode_edge_sweep.py,
# after one plain run that fills Triton's cache, <= 350 s); bench/decode_sweep.{csv,json} + bench.log
# (bench_decode.py --sweep: no new row after 140 s, the held-to cells first, <= 200 s); summary.txt (results
# and the figures the step is held to). About 8 minutes typically, 13 at most. Exit status: non-zero when any
# part failed; every part runs regardless.
set -uo pipefail
# shellcheck source=bench/gpu_run_common.sh
source "$(dirname "$0")/gpu_run_common.sh"

echo "== GPU tests (decode) =="
timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/gpu/test_decode_fast_gpu.py tests/gpu/test_decode_gpu.py tests/gpu/test_paged_decode_gpu.py \
    --junitxml="$OUT/junit_decode.xml" 2>&1 | tee "$OUT/pytest_decode.log"
tests_rc=${PIPESTATUS[0]}; [ "$tests_rc" -eq 0 ] || rc=1

echo "== compute-sanitizer memcheck: decode edge sweep =="
# tests/sanitizer: the sweep under compute-sanitizer memcheck (its full output in $OUT/sanitizer/decode.log).
NSA_REQUIRE_SANITIZER=1 NSA_SANITIZER_LOGS="$OUT/sanitizer" timeout 350 $PY -m pytest -q -p no:cacheprovider \
    -rs "tests/sanitizer/test_memcheck.py::test_sweep_is_memcheck_clean[decode]" > "$OUT/sanitizer.log" 2>&1
san_rc=$?
[ "$san_rc" -eq 0 ] || rc=1
tail -3 "$OUT/sanitizer.log"

echo "== bench_decode --sweep =="
timeout 200 $PY bench/bench_decode.py --sweep --csv "$OUT/bench/decode_sweep.csv" --max-seconds 140 \
    2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}; [ "$bench_rc" -eq 0 ] || rc=1

$PY - "$OUT" "$tests_rc" "$san_rc" "$bench_rc" <<'PYEOF' | tee "$OUT/summary.txt"
import csv, json, os, re, sys, xml.etree.ElementTree as ET
out, tests_rc, san_rc, bench_rc = sys.argv[1], *sys.argv[2:]
print("\n== summary ==")
try:
    r = ET.parse(os.path.join(out, "junit_decode.xml")).getroot()
    s = r if r.tag == "testsuite" else r.find("testsuite")
    print(f"GPU tests  rc={tests_rc}  tests={s.get('tests')} failures={s.get('failures')} "
          f"errors={s.get('errors')} skipped={s.get('skipped')} time={float(s.get('time', 0)):.0f}s")
except Exception as e:  # noqa: BLE001 - the summary must print whatever is missing
    print(f"GPU tests  rc={tests_rc}  junit unreadable: {e}")
log = (open(p, errors="replace").read() if os.path.exists(p := os.path.join(out, "sanitizer", "decode.log")) else "")
m = re.search(r"ERROR SUMMARY: (\d+) error", log)
sweep = re.search(r"decode edge sweep: .*", log)
print(f"sanitizer  rc={san_rc}  memcheck errors={m.group(1) if m else '?'}  {sweep.group(0) if sweep else ''}")
path = os.path.join(out, "bench", "decode_sweep.csv")
try:
    rows = list(csv.DictReader(open(path)))
except OSError:
    rows = []
try:
    meta = json.load(open(path[:-4] + ".json"))["meta"]
    print(f"bench      rc={bench_rc}  rows={len(rows)}  device={meta.get('device_name')}  torch={meta.get('torch')} "
          f"triton={meta.get('triton')}")
except Exception:  # noqa: BLE001
    print(f"bench      rc={bench_rc}  rows={len(rows)}")

def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")

print(f"{'preset':6} {'S':>6} {'B':>3} {'ragged':>12} {'graph ms':>9} {'eager ms':>9} {'dense ms':>9} {'x dense':>8} "
      f"{'TB/s':>6} {'HBM %':>6} {'KV MiB':>8} {'check':>8} {'blocks=':>7} {'target':>6} splits")
for r in rows:
    print(f"{r['preset']:6} {r['S']:>6} {r['B']:>3} {r['ragged'] or '-':>12} {num(r['step_graph_ms']):9.4f} "
          f"{num(r['step_eager_ms']):9.4f} {num(r['dense_ms']):9.4f} {num(r['speedup_vs_dense']):8.2f} "
          f"{num(r['tbps']):6.2f} {100 * num(r['hbm_frac']):6.1f} {num(r['kv_bytes']) / 2**20:8.1f} "
          f"{num(r['check_rel_err']):8.1e} {num(r['check_idx_agree']):7.3f} {r['target_programs'] or '-':>6} "
          f"{r['splits'] or r['backend']}")
print("\nheld to (paper heads, bf16, CUDA-graph replay vs dense FA-2 decode):")
def find(S, B):
    return next((r for r in rows if r["preset"] == "paper" and int(r["S"]) == S and int(r["B"]) == B
                 and not r["ragged"]), None)  # the first such row: the step's default tuning
for (S, B, need, what) in ((65536, 8, 5.0, ">= 5x faster"), (65536, 1, 1.0, "at most as long"),
                           (8192, 8, 1.0, "at most as long")):
    r = find(S, B)
    if r is None:
        print(f"  S={S} B={B}: not measured")
        continue
    x = num(r["speedup_vs_dense"])
    verdict = "PASS" if x >= need else "MISS"
    print(f"  S={S} B={B}: step {num(r['step_ms']) * 1e3:.1f} us, dense {num(r['dense_ms']) * 1e3:.1f} us, "
          f"{x:.2f}x ({what}): {verdict}")
PYEOF
exit $rc
