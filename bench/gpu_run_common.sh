# Shared start of the bench/gpu_*_run.sh scripts; sourced, not run. From the repo root with OUT set, it
# creates $OUT/bench, puts the checkout on PYTHONPATH, makes sure Triton compiles for the GPU (no
# interpreter), sets PY (override with PYTHON=...) and rc=0, and records the environment: env.json
# (nsa_env --json, errors in env.err) and nvidia-smi.txt.
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT/bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
rc=0
$PY -m nsa_env --json > "$OUT/env.json" 2> "$OUT/env.err" || echo "nsa-env failed (see env.err)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
