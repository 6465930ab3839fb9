#!/usr/bin/env bash
# Make a base image locally, with no registry: a minimal root file system from the distribution's own archive
# (debootstrap), holding the Python the cells need, imported as a Docker image.
#   docker/make_base.sh [TAG] [SUITE]      (needs root, debootstrap, docker)
#     bookworm (default TAG nsa-base:bookworm): Debian 12, python3.11 + venv (the CPU cell's Python)
#     noble    (default TAG nsa-base:noble):    Ubuntu 24.04, python3.12 + venv, and gcc and the Python
#              headers that Triton compiles its launcher with: the slim OS base of GPU images
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), UBUNTU_MIRROR (default
#   http://archive.ubuntu.com/ubuntu), WORKDIR (default: a temp dir), DOCKER (the docker client).
# Docs, man pages, locales and apt's package caches and lists are removed; apt works after `apt-get update`.
set -euo pipefail
suite=${2:-bookworm}
tag=${1:-nsa-base:${suite}}
docker=${DOCKER:-docker}
[ "$(id -u)" = 0 ] || { echo "make_base: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "make_base: debootstrap not installed (apt-get install debootstrap)" >&2; exit 1; }

own_tmp=""
if [ -z "${WORKDIR:-}" ]; then WORKDIR=$(mktemp -d /tmp/nsa-base.XXXXXX); own_tmp=$WORKDIR; fi
cleanup() { if [ -n "${own_tmp}" ]; then rm -rf "${own_tmp}"; fi; }
trap cleanup EXIT
rootfs=${WORKDIR}/rootfs-${suite}
opts=(--variant=minbase)

case "${suite}" in
  bookworm)
    mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
    opts+=(--include=python3,python3-venv)
    sources="deb http://deb.debian.org/debian bookworm main"
    script=()
    ;;
  noble)
    mirror=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
    # Ubuntu's archive key, from Ubuntu's own keyring package, pinned by its sha256 (noble's Packages index);
    # Debian's debootstrap has no noble script, Ubuntu's releases all use the gutsy one.
    keyring_deb=ubuntu-keyring_2023.11.28.1_all.deb
    keyring_sha256=36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8
    curl -fsS -o "${WORKDIR}/${keyring_deb}" "${mirror}/pool/main/u/ubuntu-keyring/${keyring_deb}"
    echo "${keyring_sha256}  ${WORKDIR}/${keyring_deb}" | sha256sum --check --strict --quiet \
      || { echo "make_base: ${keyring_deb} does not have the pinned sha256" >&2; exit 1; }
    dpkg-deb -x "${WORKDIR}/${keyring_deb}" "${WORKDIR}/keyring"
    opts+=(--keyring="${WORKDIR}/keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg" --components=main,universe
           --include=python3.12,python3.12-venv,python3.12-dev,gcc,libc6-dev)
    sources="deb http://archive.ubuntu.com/ubuntu noble main universe"
    script=(/usr/share/debootstrap/scripts/gutsy)
    ;;
  *) echo "make_base: unknown suite '${suite}' (bookworm or noble)" >&2; exit 2 ;;
esac

start=$(date +%s)
echo "make_base: debootstrap ${suite} (${opts[*]}) from ${mirror}"
debootstrap "${opts[@]}" "${suite}" "${rootfs}" "${mirror}" "${script[@]}" > "${WORKDIR}/debootstrap.log" 2>&1 \
  || { tail -n 30 "${WORKDIR}/debootstrap.log" >&2; echo "make_base: debootstrap failed" >&2; exit 1; }
echo "make_base: debootstrap done in $(( $(date +%s) - start )) s, $(du -sh "${rootfs}" | cut -f1)"

rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/* \
       "${rootfs}"/usr/share/doc/* "${rootfs}"/usr/share/man/* "${rootfs}"/usr/share/info/* \
       "${rootfs}"/var/log/*.log "${rootfs}"/var/cache/debconf/*-old "${rootfs}"/tmp/*
find "${rootfs}"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
# The distribution's archive, not the mirror this image was made from, is what the image's apt points to.
echo "${sources}" > "${rootfs}/etc/apt/sources.list"
echo "make_base: trimmed to $(du -sh "${rootfs}" | cut -f1)"

tar --numeric-owner -C "${rootfs}" -c . | "${docker}" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase ${suite} (docker/make_base.sh)" - "${tag}" >/dev/null
echo "make_base: imported ${tag} ($("${docker}" image inspect --format '{{.Size}}' "${tag}") bytes) in $(( $(date +%s) - start )) s"
