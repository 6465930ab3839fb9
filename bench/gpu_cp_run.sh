#!/usr/bin/env bash
# Context parallelism on the GPUs of one host: correctness with NCCL, then bench_cp per GPU count. From the
# repo root:
#     OUT=/some/dir GPUS="1 2 4 8" bash bench/gpu_cp_run.sh
# PARTS picks and orders the parts (default "check1 check bench"): check1 = two processes on GPU 0 over
# gloo; check = every GPU count of GPUS above 1 over NCCL (fp32 stream against the one-process call); bench =
# bench/bench_cp.py once per GPU count (the 1-GPU run first: the baseline), all into $OUT/bench, which
# each run re-summarizes (bench_cp_summary.csv, bench_cp.png). BENCH_ARGS go to every bench run. longest =
# bench_cp.py --longest per GPU count (the longest stream one layer's forward+backward fits; expandable
# allocator segments at every count; LONGEST_ARGS, LONGEST_TIMEOUT), into $OUT/bench/bench_cp_longest.csv.
# NVLink multicast stays off. Exit status non-zero when any part failed; every selected part runs regardless.
set -uo pipefail
# shellcheck source=bench/gpu_run_common.sh
source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=${GPUS:-$($PY -c 'import torch; n = torch.cuda.device_count(); print(*[w for w in (1, 2, 4, 8) if w <= n])')}
RUN="$PY -m torch.distributed.run --standalone"
for part in ${PARTS:-"check1 check bench"}; do
  case $part in
    check1)
      echo "== 2 processes on one GPU (gloo) =="
      CUDA_VISIBLE_DEVICES=0 timeout 300 $RUN --nproc_per_node 2 bench/bench_cp.py --gloo-one-gpu --check-only \
        --out "$OUT/check1" 2>&1 | tee "$OUT/check1.log" | grep -E "check|Error" ; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    check)
      for n in $GPUS; do
        [ "$n" -gt 1 ] || continue
        echo "== NCCL check on $n GPUs =="
        timeout 300 $RUN --nproc_per_node "$n" bench/bench_cp.py --check-only --out "$OUT/check$n" 2>&1 \
          | tee "$OUT/check$n.log" | grep -E "check|Error"; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      done ;;
    bench)
      for n in $GPUS; do
        echo "== bench_cp on $n GPUs =="
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-590}" $RUN --nproc_per_node "$n" bench/bench_cp.py --no-check --out "$OUT/bench" \
          ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_w$n.log" | tail -30; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      done ;;
    longest)
      for n in $GPUS; do
        echo "== longest stream on $n GPUs =="
        # shellcheck disable=SC2086
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${LONGEST_TIMEOUT:-590}" $RUN --nproc_per_node "$n" \
          bench/bench_cp.py --no-check --longest --strong-T '' --weak-T '' --out "$OUT/bench" ${LONGEST_ARGS:-} 2>&1 \
          | tee "$OUT/longest_w$n.log" | grep -E "longest|T_total|Error"; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      done ;;
    *) echo "unknown part $part" >&2; rc=1 ;;
  esac
done
exit $rc
