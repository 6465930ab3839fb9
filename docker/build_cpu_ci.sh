#!/usr/bin/env bash
# CI build-and-run test of the CPU cell's image, on a machine with no GPU and no registry (issue 5):
#   1. install Debian's docker.io and debootstrap (apt-get update first)
#   2. start dockerd with its data and exec roots under a temp dir; always stopped on exit (trap)
#   3. make the base image locally (docker/make_base.sh: debootstrap bookworm + python3.11)
#   4. fill docker/wheelhouse from the lock (pip's configured sources, hash-checked)
#   5. build the image offline (--network none) from docker/Dockerfile through `python -m ci.images build`
#   6. run the smoke job inside the container, copy its artifacts out
#   7. check the labels against the plan and the installed set against the lock (twice: ci.images and
#      nsa.env --check-lock); check the size (<= 1.5 GB)
#   8. build again from the same lock with the cache: the installed set must be the same
#   9. write artifacts/images/cpu-ci.json (sizes, timings, tags) and stop the daemon
# Usage (root): docker/build_cpu_ci.sh      or   nox -s images -- --ci
# Environment: NSA_CELL (default cpu-torch2.13-py311), PYTHON (default python3: needs pip and packaging),
#   NSA_IMAGE_SMOKE (command run in the container; default: nox --no-venv -s cpu_smoke when the lock has
#   nox, else python -m nsa.smoke, else python -m nsa.env while nsa.smoke does not exist yet),
#   NSA_CI_KEEP=1 keeps the temp dir (daemon data) for debugging.
# Exits non-zero on the first failure.
set -euo pipefail

cd "$(dirname "$0")/.."
cell=${NSA_CELL:-cpu-torch2.13-py311}
py=${PYTHON:-python3}
base_tag=nsa-base:bookworm
registry=local
out=artifacts/images
t0=$(date +%s)
declare -A timing=()
step_start=$t0
step() { # step NAME: close the previous step's timer, announce the next
  local now; now=$(date +%s)
  if [ -n "${current:-}" ]; then timing[$current]=$(( now - step_start )); echo "== ${current}: $(( now - step_start )) s"; fi
  current=$1; step_start=$now
  [ "$1" = finish ] || echo "== [$(( now - t0 )) s] ${1}"
}
fail() { echo "build_cpu_ci: FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (apt-get, dockerd, debootstrap)"
command -v "$py" >/dev/null || fail "no ${py} (set PYTHON)"

step "install docker.io and debootstrap"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null || fail "apt-get update"
apt-get install -y -q --no-install-recommends docker.io debootstrap >/dev/null || fail "apt-get install docker.io debootstrap"
# Debian's client (20.10) drives the daemon's built-in BuildKit; a newer client elsewhere on PATH may need buildx.
DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || fail "$DOCKER missing after installing docker.io"

step "start dockerd"
tmp=$(mktemp -d /tmp/nsa-ci-docker.XXXXXX)
sock=${tmp}/docker.sock
export DOCKER_HOST=unix://${sock}
dockerd_pid=""
cleanup() {
  local rc=$?
  if [ -n "${dockerd_pid}" ] && kill -0 "${dockerd_pid}" 2>/dev/null; then
    echo "== stopping dockerd (pid ${dockerd_pid})"
    local stop_start; stop_start=$(date +%s)
    kill -TERM "${dockerd_pid}"
    for _ in $(seq 1 30); do kill -0 "${dockerd_pid}" 2>/dev/null || break; sleep 1; done
    if kill -0 "${dockerd_pid}" 2>/dev/null; then echo "dockerd did not stop in 30 s, killing it" >&2; kill -KILL "${dockerd_pid}"; fi
    echo "== dockerd stopped in $(( $(date +%s) - stop_start )) s"
  fi
  if [ "$rc" -ne 0 ]; then
    echo "build_cpu_ci: failed (exit ${rc}) after $(( $(date +%s) - t0 )) s; dockerd log tail:" >&2
    tail -n 20 "${tmp}/dockerd.log" 2>/dev/null >&2 || true
  fi
  find docker/wheelhouse -mindepth 1 ! -name .gitignore ! -name README.md -delete 2>/dev/null || true
  if [ "${NSA_CI_KEEP:-0}" = 1 ]; then echo "== kept ${tmp}"; else
    # overlay mounts are gone once dockerd has stopped; anything left mounted is unmounted first.
    grep -o " ${tmp}[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "${tmp}" || echo "build_cpu_ci: could not remove ${tmp}" >&2
    echo "== cleaned up; $(( $(date +%s) - t0 )) s in all"
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

step "base image ${base_tag} (debootstrap)"
DOCKER=$DOCKER WORKDIR=${tmp} bash docker/make_base.sh "${base_tag}"

step "wheelhouse of ${cell}"
# (pip warns about every configured index that lacks a package; those lines are dropped)
"$py" -m ci.images wheelhouse "${cell}" --dest docker/wheelhouse 2>&1 | grep -v "is ignored: it is neither" \
  || fail "wheelhouse"

images_args=(--offline --registry "${registry}" --build-base "${base_tag}" --runtime-base "${base_tag}")
export NSA_DOCKER=$DOCKER
step "build ${cell} offline"
"$py" -m ci.images build "${cell}" "${images_args[@]}" > "${tmp}/build1.log" 2>&1 \
  || { tail -n 60 "${tmp}/build1.log" >&2; fail "image build (log above)"; }
grep -E '^\[1/1\]|pruning|^#[0-9]+ DONE' "${tmp}/build1.log" | grep -v ' DONE 0\.' | tail -n 25
image=$("$py" -m ci.images plan "${cell}" "${images_args[@]}" --json | "$py" -c 'import json,sys; print(json.load(sys.stdin)[0]["tags"][0])')

step "smoke job in the container"
if [ -n "${NSA_IMAGE_SMOKE:-}" ]; then
  smoke=${NSA_IMAGE_SMOKE}
elif [ -f nsa/smoke.py ] && grep -q '^nox==' "requirements/locks/${cell}.txt"; then
  smoke="nox --no-venv -s cpu_smoke"
elif [ -f nsa/smoke.py ]; then
  smoke="python -m nsa.smoke"
else
  echo "WARNING: nsa/smoke.py does not exist yet: running the environment report and a Triton interpreter check instead" >&2
  smoke="python -m nsa.env --json"
fi
echo "smoke command: ${smoke}"
name=nsa-ci-smoke-$$
"$DOCKER" run --name "${name}" --network none -e TRITON_INTERPRET=1 "${image}" sh -c "${smoke}" \
  || { "$DOCKER" rm -f "${name}" >/dev/null 2>&1; fail "smoke job (${smoke}) failed in ${image}"; }
rm -rf "${out}/cpu-smoke" && mkdir -p "${out}"
"$DOCKER" cp "${name}:/workspace/artifacts" "${out}/cpu-smoke" || fail "copying the smoke artifacts out"
"$DOCKER" rm "${name}" >/dev/null
echo "smoke artifacts: $(find "${out}/cpu-smoke" -type f | wc -l) file(s) in ${out}/cpu-smoke"

step "check labels, installed set, size"
"$DOCKER" image inspect "${image}" > "${tmp}/inspect.json"
"$py" -m ci.images check-labels "${cell}" "${images_args[@]}" --inspect "${tmp}/inspect.json" || fail "labels"
"$DOCKER" run --rm --network none -e NSA_ENV_REPORT=0 "${image}" python -m pip freeze --all > "${tmp}/freeze1.txt" \
  || fail "pip freeze in the image"
"$py" -m ci.images check-installed "${cell}" --freeze "${tmp}/freeze1.txt" || fail "installed set vs lock"
"$DOCKER" run --rm --network none -e NSA_ENV_REPORT=0 "${image}" \
  python -m nsa.env --check-lock "/workspace/requirements/locks/${cell}.txt" || fail "nsa.env --check-lock in the image"
size=$("$DOCKER" image inspect --format '{{.Size}}' "${image}")
echo "image ${image}: ${size} bytes ($(( size / 1000000 )) MB; limit 1500 MB)"
[ "${size}" -le 1500000000 ] || fail "the CPU image is ${size} bytes, above 1.5 GB"

step "rebuild from the same lock with the cache"
"$py" -m ci.images build "${cell}" "${images_args[@]}" > "${tmp}/build2.log" 2>&1 \
  || { tail -n 40 "${tmp}/build2.log" >&2; fail "second image build"; }
"$DOCKER" run --rm --network none -e NSA_ENV_REPORT=0 "${image}" python -m pip freeze --all > "${tmp}/freeze2.txt"
diff -u "${tmp}/freeze1.txt" "${tmp}/freeze2.txt" || fail "the rebuild installed a different set"
echo "rebuild: same installed set ($(wc -l < "${tmp}/freeze2.txt") distributions)"

step finish
total=$(( $(date +%s) - t0 ))
steps=""
for k in "${!timing[@]}"; do steps+="${k}=${timing[$k]}"$'\n'; done
CI_CELL=$cell CI_IMAGE=$image CI_SIZE=$size CI_SMOKE=$smoke CI_TOTAL=$total CI_STEPS=$steps \
CI_LOCK_SHA=$(sha256sum "requirements/locks/${cell}.txt" | cut -d' ' -f1) "$py" - > "${out}/cpu-ci.json" <<'PY'
import json, os
e = os.environ
steps = dict(line.rsplit("=", 1) for line in e["CI_STEPS"].splitlines() if line)
print(json.dumps({"cell": e["CI_CELL"], "image": e["CI_IMAGE"], "size_bytes": int(e["CI_SIZE"]),
                  "lock_sha256": e["CI_LOCK_SHA"], "smoke": e["CI_SMOKE"], "total_s": int(e["CI_TOTAL"]),
                  "steps_s": {k: int(v) for k, v in steps.items()}}, indent=2))
PY
echo "== build_cpu_ci: OK in ${total} s (report ${out}/cpu-ci.json)"
