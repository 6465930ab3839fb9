#!/usr/bin/env bash
# CI's build-and-run test of the images, on a machine with no GPU and no registry. Both images come from
# docker/Dockerfile with the build arguments of `python -m ci.images plan` (the ones images.yml bakes),
# built offline (--network none) from a wheelhouse of the cell's lock, on bases made here with debootstrap.
#   cpu   the CPU cell (cpu-torch2.13-py311) on nsa-base:bookworm: the smoke job runs in the container;
#         labels, installed set, size (<= 1.5 GB); a cached rebuild installs the same set
#   gpu   the cell of the lent H100/H200 (cu130-torch2.11-py312) on nsa-base:noble (Ubuntu 24.04 with
#         python3.12, gcc and the Python headers: the slim OS runtime base of GPU images), flash-attn left
#         out (--without-flash-attn: compiling it takes hours); labels, installed set, `import torch,
#         triton, nsa`, `python -m nsa_env` (no GPU here), and the size against a cudnn-runtime base
# Usage (root): docker/ci_images.sh [cpu] [gpu]   (default: both)   or   nox -s images -- --ci
# Environment: PYTHON (default python3: needs pip and packaging), NSA_IMAGE_SMOKE (command run in the CPU
#   container; default nox --no-venv -s cpu_smoke), NSA_CI_KEEP=1 keeps the temp dir (daemon data).
# Writes artifacts/images/ci.json (sizes, timings); exits non-zero on the first failure.
set -euo pipefail

cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
kinds=("$@")
[ "${#kinds[@]}" -gt 0 ] || kinds=(cpu gpu)
out=artifacts/images
t0=$(date +%s)
report=()   # KEY=VALUE lines for ci.json
step() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
fail() { echo "ci_images: FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (apt-get, dockerd, debootstrap)"
command -v "$py" >/dev/null || fail "no ${py} (set PYTHON)"

step "install docker.io and debootstrap"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null || fail "apt-get update"
apt-get install -y -q --no-install-recommends docker.io debootstrap curl >/dev/null || fail "apt-get install"
# Debian's client (20.10) drives the daemon's built-in BuildKit; a newer client elsewhere on PATH may need buildx.
export DOCKER=/usr/bin/docker NSA_DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || fail "$DOCKER missing after installing docker.io"

step "start dockerd"
tmp=$(mktemp -d /tmp/nsa-ci-docker.XXXXXX)
sock=${tmp}/docker.sock
export DOCKER_HOST=unix://${sock}
dockerd_pid=""
cleanup() {
  local rc=$?
  if [ -n "${dockerd_pid}" ] && kill -0 "${dockerd_pid}" 2>/dev/null; then
    kill -TERM "${dockerd_pid}"
    for _ in $(seq 1 30); do kill -0 "${dockerd_pid}" 2>/dev/null || break; sleep 1; done
    if kill -0 "${dockerd_pid}" 2>/dev/null; then echo "dockerd did not stop in 30 s, killing it" >&2; kill -KILL "${dockerd_pid}"; fi
  fi
  if [ "$rc" -ne 0 ]; then
    echo "ci_images: failed (exit ${rc}) after $(( $(date +%s) - t0 )) s; dockerd log tail:" >&2
    tail -n 20 "${tmp}/dockerd.log" 2>/dev/null >&2 || true
  fi
  find docker/wheelhouse -mindepth 1 ! -name .gitignore ! -name README.md -delete 2>/dev/null || true
  if [ "${NSA_CI_KEEP:-0}" = 1 ]; then echo "== kept ${tmp}"; else
    # overlay mounts are gone once dockerd has stopped; anything left mounted is unmounted first.
    grep -o " ${tmp}[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "${tmp}" || echo "ci_images: could not remove ${tmp}" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
dockerd --storage-driver=overlay2 --iptables=false --ip6tables=false --bridge=none \
  --data-root="${tmp}/data" --exec-root="${tmp}/exec" -H "unix://${sock}" --pidfile="${tmp}/dockerd.pid" \
  > "${tmp}/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 1 60); do
  if [ -S "${sock}" ] && "$DOCKER" version >/dev/null 2>&1; then break; fi
  kill -0 "${dockerd_pid}" 2>/dev/null || fail "dockerd exited: $(tail -n 5 "${tmp}/dockerd.log")"
  sleep 0.5
done
"$DOCKER" version --format 'dockerd {{.Server.Version}} ready' || fail "dockerd did not answer on ${sock} in 30 s"
mkdir -p "${out}"

in_image() { "$DOCKER" run --rm --network none -e NSA_ENV_REPORT=0 "$@"; }

# build CELL SUITE [ci.images options]: base image, wheelhouse, offline build, label and installed-set checks.
# Sets $image. The cell's own package index is served locally (ci.sessions.quickstart --mirror) where it has one.
build() {
  local cell=$1 suite=$2; shift 2
  local base="nsa-base:${suite}" start
  args=(--offline --repo local/nsa --build-base "${base}" --runtime-base "${base}" "$@")
  step "${cell}: base image ${base} (debootstrap)"
  WORKDIR=${tmp} bash docker/make_base.sh "${base}" "${suite}"
  step "${cell}: wheelhouse"
  # (pip warns about every configured index that lacks a package; those lines are dropped)
  "$py" -m ci.sessions.quickstart --mirror "${cell}" -- "$py" docker/wheelhouse.py "${cell}" "$@" --dest docker/wheelhouse \
    2>&1 | grep -v "is ignored: it is neither" || fail "wheelhouse"
  step "${cell}: build offline ($*)"
  start=$(date +%s)
  "$py" -m ci.images build "${cell}" "${args[@]}" > "${tmp}/build-${cell}.log" 2>&1 \
    || { tail -n 60 "${tmp}/build-${cell}.log" >&2; fail "image build (log above)"; }
  grep -E '^\[1/1\]|pruning|^#[0-9]+ DONE' "${tmp}/build-${cell}.log" | grep -v ' DONE 0\.' | tail -n 25
  report+=("${cell}|build_s=$(( $(date +%s) - start ))")
  image=$("$py" -m ci.images plan "${cell}" "${args[@]}" --json | "$py" -c 'import json,sys; print(json.load(sys.stdin)[0]["tags"][0])')
  find docker/wheelhouse -mindepth 1 ! -name .gitignore ! -name README.md -delete
  step "${cell}: labels and installed set"
  "$DOCKER" image inspect "${image}" > "${tmp}/inspect.json"
  "$py" -m ci.images plan "${cell}" "${args[@]}" --json > "${tmp}/plan.json"
  # Every label of the plan, exactly: the same commit gives the same revision and date.
  "$py" - "${tmp}/plan.json" "${tmp}/inspect.json" <<'PY' || fail "labels differ from the plan"
import json, sys
want = json.load(open(sys.argv[1]))[0]["labels"]
got = json.load(open(sys.argv[2]))[0]["Config"]["Labels"] or {}
bad = {k: {"plan": v, "image": got.get(k)} for k, v in want.items() if got.get(k) != v}
print(f"labels: all {len(want)} as planned" if not bad else f"labels that differ: {bad}")
sys.exit(1 if bad else 0)
PY
  # The image's installed set is its lock (plus flash-attn where the build installed it), exactly.
  in_image "${image}" python -m nsa_env --check-lock /opt/nsa-image/installed.txt || fail "installed set vs lock"
  report+=("${cell}|image=${image}" "${cell}|size_bytes=$("$DOCKER" image inspect --format '{{.Size}}' "${image}")"
           "${cell}|base_bytes=$("$DOCKER" image inspect --format '{{.Size}}' "${base}")")
}

for kind in "${kinds[@]}"; do
  case "${kind}" in
    cpu)
      cell=cpu-torch2.13-py311
      build "${cell}" bookworm
      step "${cell}: smoke job in the container"
      smoke=${NSA_IMAGE_SMOKE:-nox --no-venv -s cpu_smoke}
      name=nsa-ci-smoke-$$
      "$DOCKER" run --name "${name}" --network none -e TRITON_INTERPRET=1 "${image}" sh -c "${smoke}" \
        || { "$DOCKER" rm -f "${name}" >/dev/null 2>&1; fail "smoke job (${smoke}) failed in ${image}"; }
      rm -rf "${out}/cpu-smoke"
      "$DOCKER" cp "${name}:/workspace/artifacts" "${out}/cpu-smoke" || fail "copying the smoke artifacts out"
      "$DOCKER" rm "${name}" >/dev/null
      size=$("$DOCKER" image inspect --format '{{.Size}}' "${image}")
      echo "image ${image}: $(( size / 1000000 )) MB (limit 1500 MB)"
      [ "${size}" -le 1500000000 ] || fail "the CPU image is ${size} bytes, above 1.5 GB"
      step "${cell}: rebuild from the same lock with the cache"
      in_image "${image}" python -m pip freeze --all > "${tmp}/freeze1.txt"
      "$py" -m ci.sessions.quickstart --mirror "${cell}" -- "$py" docker/wheelhouse.py "${cell}" --dest docker/wheelhouse \
        2>&1 | grep -v "is ignored: it is neither" || fail "wheelhouse"
      "$py" -m ci.images build "${cell}" "${args[@]}" > "${tmp}/rebuild.log" 2>&1 \
        || { tail -n 40 "${tmp}/rebuild.log" >&2; fail "second image build"; }
      in_image "${image}" python -m pip freeze --all > "${tmp}/freeze2.txt"
      diff -u "${tmp}/freeze1.txt" "${tmp}/freeze2.txt" || fail "the rebuild installed a different set"
      echo "rebuild: same installed set ($(wc -l < "${tmp}/freeze2.txt") distributions)"
      ;;
    gpu)
      cell=cu130-torch2.11-py312
      build "${cell}" noble --without-flash-attn
      step "${cell}: import torch, triton, nsa; the environment report (no GPU here)"
      in_image "${image}" python -c "import torch, triton, nsa; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__, 'nsa', nsa.__version__)" \
        || fail "import torch, triton, nsa"
      in_image "${image}" python -m nsa_env || fail "python -m nsa_env"
      # The CUDA and cuDNN libraries the torch wheels bring: what a cudnn-runtime base would hold a second time.
      nvidia_mb=$(in_image "${image}" sh -c 'du -sm /opt/venv/lib/python*/site-packages/nvidia | cut -f1')
      report+=("${cell}|nvidia_libs_mb=${nvidia_mb}")
      echo "image ${image}: $(( $("$DOCKER" image inspect --format '{{.Size}}' "${image}") / 1000000 )) MB;" \
           "CUDA/cuDNN libraries from the torch wheels: ${nvidia_mb} MB"
      ;;
    *) fail "unknown image kind '${kind}' (cpu or gpu)" ;;
  esac
done

total=$(( $(date +%s) - t0 ))
printf '%s\n' "${report[@]}" "total_s=${total}" | "$py" -c '
import json, sys
doc = {}
for line in sys.stdin.read().splitlines():
    key, _, value = line.partition("=")
    cell, _, field = key.rpartition("|")
    (doc.setdefault(cell, {}) if cell else doc)[field] = int(value) if value.isdigit() else value
print(json.dumps(doc, indent=2))' > "${out}/ci.json"
cat "${out}/ci.json"
step "ci_images: OK in ${total} s (report ${out}/ci.json)"
