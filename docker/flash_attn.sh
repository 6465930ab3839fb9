#!/usr/bin/env bash
# flash-attn in the builder stage of docker/Dockerfile, for the three sources of requirements/matrix.toml:
#   none    nothing to do;
#   wheel   the release wheel is normally in the cell's lock (pinned by URL and sha256, installed with it);
#           while its sha256 is not recorded yet (FLASH_ATTN_WHEEL_URL set) it is installed here from the
#           URL (or /wheelhouse offline) and its sha256 printed, to be recorded in matrix.toml;
#   source  compiled from the PyPI source package (pinned by FLASH_ATTN_SDIST_SHA256) for GPU_ARCHS with
#           MAX_JOBS parallel jobs; the wheel is kept in a cache mount (CACHE_DIR) keyed by flash-attn,
#           torch, Python and architectures, so a rebuild of the image does not compile again.
# The sha256 of the wheel installed is written to /opt/nsa-image/flash_attn.sha256 in every case but none,
# and /opt/nsa-image/installed.txt (the lock, plus flash-attn where this script installed it) lists what the
# image must hold exactly (`python -m nsa.env --check-lock /opt/nsa-image/installed.txt`).
set -euo pipefail
: "${FLASH_ATTN_SOURCE:=none}" "${FLASH_ATTN_VERSION:=}" "${FLASH_ATTN_WHEEL_URL:=}" "${FLASH_ATTN_SDIST_SHA256:=}"
: "${GPU_ARCHS:=}" "${TORCH_CUDA_ARCH_LIST:=}" "${MAX_JOBS:=4}" "${NVCC_THREADS:=2}" "${OFFLINE:=0}"
: "${CACHE_DIR:=/root/.cache/nsa-flash-attn}" "${PYTHON:=3.11}"
record=/opt/nsa-image/flash_attn.sha256
pip_src=()
if [ "${OFFLINE}" = 1 ]; then pip_src=(--no-index --find-links /wheelhouse); fi
die() { echo "flash_attn.sh: error: $*" >&2; exit 1; }

case "${FLASH_ATTN_SOURCE}" in
  none)
    echo "flash-attn: none for this cell"
    ;;
  wheel)
    if [ -z "${FLASH_ATTN_WHEEL_URL}" ]; then
      python -c 'import importlib.metadata as m; m.version("flash-attn")' 2>/dev/null \
        || die "source=wheel but flash-attn is neither in the lock nor given by FLASH_ATTN_WHEEL_URL"
      grep -A3 '^flash-attn @' /opt/nsa-image/lock.txt | grep -o 'sha256:[0-9a-f]*' | head -n1 \
        | sed 's/^sha256:/(from the lock) /' > "${record}"
    else
      name=$(python -c 'import sys, urllib.parse as u; print(u.unquote(sys.argv[1].rsplit("/", 1)[1]))' "${FLASH_ATTN_WHEEL_URL}")
      mkdir -p /tmp/fa
      if [ "${OFFLINE}" = 1 ]; then
        [ -f "/wheelhouse/${name}" ] || die "offline: /wheelhouse/${name} missing (python -m ci.images wheelhouse)"
        cp "/wheelhouse/${name}" /tmp/fa/
      else
        echo "flash-attn: sha256 not recorded in matrix.toml yet: downloading ${FLASH_ATTN_WHEEL_URL}"
        python - "${FLASH_ATTN_WHEEL_URL}" "/tmp/fa/${name}" <<'PY'
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=600) as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f)
PY
      fi
      python -m pip install --no-deps --no-index "/tmp/fa/${name}"
      sha256sum "/tmp/fa/${name}" | sed "s|/tmp/fa/||" > "${record}"
      echo "flash-attn: RECORD THIS in requirements/matrix.toml: sha256 = \"$(cut -d' ' -f1 "${record}")\""
      rm -rf /tmp/fa
    fi
    ;;
  source)
    [ -n "${FLASH_ATTN_VERSION}" ] || die "FLASH_ATTN_VERSION is required with source=source"
    [ -n "${FLASH_ATTN_SDIST_SHA256}" ] || die "FLASH_ATTN_SDIST_SHA256 is required with source=source"
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
      echo "flash-attn==${FLASH_ATTN_VERSION} --hash=sha256:${FLASH_ATTN_SDIST_SHA256}" > /tmp/flash-attn.txt
      rm -rf "${out}.tmp" && mkdir -p "${out}.tmp"
      start=$(date +%s)
      FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${fa_archs}" \
        TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${GPU_ARCHS}}" MAX_JOBS="${MAX_JOBS}" \
        NVCC_THREADS="${NVCC_THREADS}" \
        python -m pip wheel --require-hashes --no-deps --no-build-isolation --no-binary flash-attn \
          "${pip_src[@]}" -w "${out}.tmp" -r /tmp/flash-attn.txt
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

cp /opt/nsa-image/lock.txt /opt/nsa-image/installed.txt
if [ -f "${record}" ] && ! grep -q '^flash-attn' /opt/nsa-image/lock.txt; then
  echo "flash-attn==$(python -c 'import importlib.metadata as m; print(m.version("flash-attn"))')" \
    >> /opt/nsa-image/installed.txt
fi
