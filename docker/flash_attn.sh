#!/usr/bin/env bash
# flash-attn in the builder stage of docker/Dockerfile, from the cell's pin /opt/nsa-image/flash-attn.txt
# (requirements/locks/<cell>.flash-attn.txt, written by `nox -s lock` from requirements/matrix.toml):
#   none    nothing to do (a cell without flash-attn, or a build that leaves it out: --without-flash-attn);
#   wheel   upstream's release wheel, by URL and sha256 (offline: from /wheelhouse, hash still checked);
#   source  the PyPI source package, pinned by its sha256, compiled for GPU_ARCHS with MAX_JOBS parallel jobs
#           and FLASH_ATTENTION_FORCE_BUILD=TRUE (setup.py never fetches an unpinned wheel instead); the wheel
#           is kept in a cache mount (CACHE_DIR) keyed by flash-attn, torch, Python and architectures, so a
#           rebuild of the image does not compile again.
# The sha256 of the wheel installed is written to /opt/nsa-image/flash_attn.sha256 in every case but none,
# and /opt/nsa-image/installed.txt (the lock, plus the flash-attn installed here) lists what the image must
# hold exactly (`python -m nsa_env --check-lock /opt/nsa-image/installed.txt`).
set -euo pipefail
: "${FLASH_ATTN_SOURCE:=none}" "${FLASH_ATTN_VERSION:=}"
: "${GPU_ARCHS:=}" "${TORCH_CUDA_ARCH_LIST:=}" "${MAX_JOBS:=4}" "${NVCC_THREADS:=2}" "${OFFLINE:=0}"
: "${CACHE_DIR:=/root/.cache/nsa-flash-attn}" "${PYTHON:=3.11}"
record=/opt/nsa-image/flash_attn.sha256
pin=/opt/nsa-image/flash-attn.txt
pip_src=()
if [ "${OFFLINE}" = 1 ]; then pip_src=(--no-index --find-links /wheelhouse); fi
die() { echo "flash_attn.sh: error: $*" >&2; exit 1; }

if [ "${FLASH_ATTN_SOURCE}" != none ]; then
  [ -f "${pin}" ] || die "FLASH_ATTN_SOURCE=${FLASH_ATTN_SOURCE} but the cell has no flash-attn pin (nox -s lock -- CELL)"
  grep -Eq "^flash-attn( @ .*/flash_attn-|==)${FLASH_ATTN_VERSION//./\\.}(%2B| )" "${pin}" \
    || die "${pin} does not pin flash-attn ${FLASH_ATTN_VERSION} (the plan and the pin disagree: relock)"
fi

case "${FLASH_ATTN_SOURCE}" in
  none)
    echo "flash-attn: none in this build"
    ;;
  wheel)
    reqs="${pin}"
    if [ "${OFFLINE}" = 1 ]; then  # a URL requirement would download even with --no-index
      python /usr/local/bin/nsa-localize-lock "${pin}" /wheelhouse > /tmp/flash-attn-offline.txt
      reqs=/tmp/flash-attn-offline.txt
    fi
    python -m pip install --require-hashes --no-deps --only-binary=:all: --no-compile "${pip_src[@]}" -r "${reqs}"
    grep -o 'sha256:[0-9a-f]*' "${pin}" | head -n1 | sed 's/^sha256:/(upstream wheel, pinned) /' > "${record}"
    ;;
  source)
    [ -n "${GPU_ARCHS}" ] || die "GPU_ARCHS is required with source=source"
    command -v nvcc >/dev/null || die "nvcc not found: BUILD_BASE must be a CUDA -devel image"
    torch_ver=$(python -c 'import torch; print(torch.__version__)')
    # flash-attn's setup.py reads FLASH_ATTN_CUDA_ARCHS as "80;90;100;120" (8.6/8.9 run the sm_80 code).
    fa_archs=${GPU_ARCHS//./}
    key="${FLASH_ATTN_VERSION}-torch${torch_ver}-py${PYTHON}-sm${fa_archs//;/_}"
    out="${CACHE_DIR}/${key}"
    if compgen -G "${out}/flash_attn-*.whl" >/dev/null; then
      echo "flash-attn: reusing the wheel compiled earlier (${key})"
    else
      echo "flash-attn ${FLASH_ATTN_VERSION}: compiling for ${fa_archs} with MAX_JOBS=${MAX_JOBS}," \
           "NVCC_THREADS=${NVCC_THREADS} (about 1 h on 16 cores; more jobs need more memory: ~4 GB each)"
      rm -rf "${out}.tmp" && mkdir -p "${out}.tmp"
      start=$(date +%s)
      FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${fa_archs}" \
        TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${GPU_ARCHS}}" MAX_JOBS="${MAX_JOBS}" \
        NVCC_THREADS="${NVCC_THREADS}" \
        python -m pip wheel --require-hashes --no-deps --no-build-isolation --no-binary flash-attn \
          "${pip_src[@]}" -w "${out}.tmp" -r "${pin}"
      mv "${out}.tmp" "${out}"
      echo "flash-attn: compiled in $(( $(date +%s) - start )) s"
    fi
    whl=$(compgen -G "${out}/flash_attn-*.whl" | head -n1)
    python -m pip install --no-deps --no-index "${whl}"
    sha256sum "${whl}" | sed "s|${out}/||" > "${record}"
    echo "flash-attn: built wheel $(cat "${record}")"
    ;;
  *) die "unknown FLASH_ATTN_SOURCE '${FLASH_ATTN_SOURCE}' (none, wheel or source)" ;;
esac

# flash-attn's own requirements (torch, einops) must be in the lock it was installed beside.
python -m pip check
cp /opt/nsa-image/lock.txt /opt/nsa-image/installed.txt
if [ -f "${record}" ]; then
  echo "flash-attn==$(python -c 'import importlib.metadata as m; print(m.version("flash-attn"))')" \
    >> /opt/nsa-image/installed.txt
fi
