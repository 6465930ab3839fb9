#!/usr/bin/env bash
# The commands of the FA-2 enablement runbook and of the GPU test plan (the nsa-vibe documents;
# docs/migration.md maps every one) that need no GPU, run literally as written, or as the successor
# docs/migration.md names, from the repository root; each must exit 0 on a CPU machine. Slow (about
# 15 minutes on 2 cores: the whole test suite, the smokes and two decode benches), so not part of the fast suite:
# CI runs it with `nox -s runbooks`, in the CPU cell's environment (python, pytest and uv on PATH).
#
#   bash tests/runbooks.sh            # all
#   bash tests/runbooks.sh probe      # the steps whose name contains "probe"
#
# `uv run` runs in the active environment, never syncing it (UV_NO_SYNC=1, UV_PROJECT_ENVIRONMENT), so the
# seeds' `uv run -q ...` lines run as written. The GPU-only commands are listed at the end, not run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
only="${1:-}"
py_env="$(python -c 'import sys; print(sys.prefix)')"
export UV_NO_SYNC=1 UV_PROJECT_ENVIRONMENT="$py_env"
# The Triton kernels' CPU tests run interpreted, as in nox -s tests; on a GPU host the kernels compile for the GPU
# (the GPU tests run there) and the interpreter tests skip, saying why, unless TRITON_INTERPRET=1 is set.
if [ -z "${TRITON_INTERPRET+x}" ] && ! python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    export TRITON_INTERPRET=1
fi
# The commands stay as written; their pytest runs spread over the cores where pytest-xdist is installed, unless
# PYTEST_ADDOPTS already has -n (its other options, such as -m "not slow", are kept).
if [[ " ${PYTEST_ADDOPTS:-} " != *" -n "* ]] && python -c 'import xdist' 2>/dev/null; then
    export PYTEST_ADDOPTS="-n auto ${PYTEST_ADDOPTS:-}"
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"; rm -f "$ROOT/decode.csv" "$ROOT/decode.json" "$ROOT/decode_gpu_final.csv" "$ROOT/decode_gpu_final.json"' EXIT
failed=()
passed=0

step() {  # step NAME COMMAND: COMMAND is one shell line of the documents, run by bash in the repository root
    local name="$1" cmd="$2"
    [[ -n "$only" && "$name" != *"$only"* ]] && return 0
    printf '\n===== %s\n$ %s\n' "$name" "$cmd"
    local t0=$SECONDS
    if (cd "$ROOT" && bash -c "$cmd"); then
        passed=$((passed + 1))
        printf -- '----- %s: exit 0 (%d s)\n' "$name" $((SECONDS - t0))
    else
        local rc=$?
        failed+=("$name (exit $rc)")
        printf -- '----- %s: FAILED exit %d (%d s)\n' "$name" "$rc" $((SECONDS - t0))
    fi
}

# --- runbook: FA-2 enablement -----------------------------------------------------------------------------
# 2) Minimal FA-2 activation, then the sanity probe (prints False on a CPU machine, True on a GPU host).
step "runbook 2: probe" "export NSA_USE_FA2=1
export NSA_FA2_MIN_LEN_WIN=1
export NSA_FA2_MIN_LEN_CMP=1
python - <<'PY'
import torch
from nsa.kernels.flash_wrappers import is_flash_available, is_flash_varlen_available
print('flash_dense_available:', is_flash_available())
print('flash_varlen_available:', is_flash_varlen_available())
PY"
# 3) FA-2 tests (GPU tests: skipped with the reason here)
step "runbook 3: fa2 tests" 'NSA_TEST_FA2=1 uv run -q pytest -k "fa2_parity or backward_varlen"'
# 5) Throughput sanity: configs/base.yaml, prefill + 200 decode steps
step "runbook 5: decode throughput" 'PYTHONPATH=. NSA_USE_FA2=1 NSA_FA2_MIN_LEN_WIN=1 NSA_FA2_MIN_LEN_CMP=1 uv run -q python bench/bench_decode.py --config configs/base.yaml --steps 200'

# --- test plan: NSA selection + FA-2 parity and benches ---------------------------------------------------
step "plan setup: commit" 'git rev-parse --short HEAD'
step "plan 3: CPU smoke on the host" 'PYTHONPATH=. pytest -q'
step "plan matrix 1: triton sel parity (successor path)" 'NSA_USE_TRITON_SEL=1 NSA_TRITON_SEL_FORCE=1 PYTHONPATH=. pytest -q tests/gpu/test_triton_sel_parity_gpu.py'
step "plan matrix 2: triton sel backward (successor path)" 'NSA_USE_TRITON_SEL=1 NSA_SEL_TRITON_ALLOW_GRAD=1 NSA_TRITON_SEL_FORCE=1 PYTHONPATH=. pytest -q tests/gpu/test_triton_sel_backward_gpu.py'
step "plan matrix 3: fa2 gpu varlen (with the debug log)" 'NSA_DEBUG_LOG=1 NSA_LOG_LIMIT=5 NSA_TEST_FA2=1 NSA_USE_FA2=1 PYTHONPATH=. pytest -q -k fa2_gpu_varlen'
step "runbook/plan: fa2 gpu varlen through uv" 'NSA_TEST_FA2=1 PYTHONPATH=. uv run -q pytest -k fa2_gpu_varlen'
step "plan matrix 4: backward/gradcheck/train smokes" 'NSA_TEST_TRAIN=1 PYTHONPATH=. pytest -q -k "backward_parity or gradcheck or train"'
step "plan bench 1: decode bench" 'PYTHONPATH=. python bench/bench_decode.py --B 1 --dim 256 --heads 8 --groups 2 --dk 32 --dv 32 --l 32 --d 16 --l_sel 64 --n_sel 16 --w 512 --S_list 512,1024,2048,4096 --iters 64 --warmup 8 --csv decode_gpu_final.csv --branch_force_mode env'
step "plan bench 1: decode summary" 'python bench/summarize_decode_csv.py decode_gpu_final.csv'
step "plan artifacts: versions" "python -c \"import torch, triton; print('torch', torch.__version__); print('cuda', torch.version.cuda); print('triton', triton.__version__)\""
step "retired toggles warn, never silently ignored" "NSA_SDPA_AUDIT=1 NSA_SEL_TRITON_GROUP=1 NSA_DEBUG_COMPARE=1 PYTHONPATH=. python -W error::UserWarning -c 'import nsa, torch; from nsa import toggles; toggles.read()' 2>&1 | grep -q 'NSA_SDPA_AUDIT is set but has no effect'"

cat <<'GPU'

===== GPU-only commands (not run here; on a GPU host `bash scripts/runner_oneshot.sh` runs the plan):
  runbook 1   python - <<'PY' ... from flash_attn import flash_attn_func ... PY      (needs flash-attn, a CUDA build)
  runbook 4A  PYTHONPATH=. NSA_USE_FA2=1 uv run -q python bench/bench_fa2.py
  runbook 4B  the LlamaBlockNSA(...).cuda() forward smoke
  plan 5      PYTHONPATH=. pytest -q nsa/tests/test_sel_cuda_gpu.py                   (no successor: docs/migration.md)
  plan bench  NSA_USE_FA2=1 PYTHONPATH=. python bench/bench_fa2.py
  plan bench  NSA_USE_TRITON_SEL=1 NSA_TRITON_SEL_FORCE=1 PYTHONPATH=. python bench/bench_sel_triton.py
  plan        nvidia-smi; bash scripts/runner_oneshot.sh
  setup       uv venv / pip install lines: the README's Quick start (CI runs it)
GPU

printf '\nrunbooks: %d passed, %d failed\n' "$passed" "${#failed[@]}"
for f in "${failed[@]}"; do echo "  FAILED: $f"; done
[ "${#failed[@]}" -eq 0 ]
