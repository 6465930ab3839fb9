#!/usr/bin/env bash
# Make python${VERSION} (with venv) available in an image stage. Used by docker/Dockerfile in both stages.
#   install_python.sh VERSION SOURCE STAGE
# SOURCE:
#   auto        system when the base image has python${VERSION}, else deadsnakes (the Dockerfile's default)
#   system      the base image already has python${VERSION} (our CPU base made by docker/make_base.sh, or
#               a site's own air-gapped base): only checked, nothing is installed (works offline).
#   deadsnakes  Ubuntu bases (nvidia/cuda:*-ubuntu22.04/24.04): python${VERSION} from Ubuntu's archive when
#               it is the release's own Python, else from the deadsnakes PPA (needs network).
# STAGE: build (adds python${VERSION}-dev for compiling flash-attn) or runtime (adds a C compiler and the
#        Python headers only for GPU images: Triton compiles its launcher with them at run time).
set -euo pipefail
version=${1:?usage: install_python.sh VERSION SOURCE STAGE}
source=${2:?usage: install_python.sh VERSION SOURCE STAGE}
stage=${3:?usage: install_python.sh VERSION SOURCE STAGE}
py=python${version}

if [ "${source}" = auto ]; then
  if command -v "${py}" >/dev/null; then source=system; else source=deadsnakes; fi
fi
case "${source}" in
  system) ;;
  deadsnakes)
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    pkgs=("${py}" "${py}-venv" "${py}-dev")
    if [ "${stage}" = runtime ]; then pkgs+=(gcc libc6-dev ca-certificates); else pkgs+=(ca-certificates); fi
    if ! apt-cache show "${py}-venv" >/dev/null 2>&1; then
      echo "install_python: ${py} is not in this release's archive, adding the deadsnakes PPA"
      apt-get install -y -q --no-install-recommends software-properties-common gpg-agent
      add-apt-repository -y ppa:deadsnakes/ppa
      apt-get purge -y -q --auto-remove software-properties-common gpg-agent
      apt-get update -q
    fi
    apt-get install -y -q --no-install-recommends "${pkgs[@]}"
    rm -rf /var/lib/apt/lists/*
    ;;
  *) echo "install_python: unknown PYTHON_SOURCE '${source}' (auto, system or deadsnakes)" >&2; exit 2 ;;
esac

if ! command -v "${py}" >/dev/null; then
  echo "install_python: ${py} not found in the ${stage} base image (PYTHON_SOURCE=${2})" >&2
  exit 1
fi
if ! "${py}" -c 'import venv, ensurepip' 2>/dev/null; then
  echo "install_python: ${py} lacks venv/ensurepip (install ${py}-venv in the base image)" >&2
  exit 1
fi
echo "install_python: $("${py}" --version) at $(command -v "${py}") for the ${stage} stage (${source})"
