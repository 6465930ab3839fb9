#!/usr/bin/env bash
# Make the CPU cell's base image locally, with no registry: a minimal Debian bookworm root file system
# (debootstrap, Debian's archive only) holding python3.11 and venv, imported as a Docker image.
#   docker/make_base.sh [TAG]            (default TAG: nsa-base:bookworm; needs root, debootstrap, docker)
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), WORKDIR (default: a temp dir),
#              DOCKER (the docker client, default docker).
# Bookworm's python3 is 3.11, the CPU cell's Python. Docs, man pages, locales and apt's package caches and
# lists are removed (about 140 MB); apt still works after `apt-get update`.
set -euo pipefail
tag=${1:-nsa-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}
[ "$(id -u)" = 0 ] || { echo "make_base: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "make_base: debootstrap not installed (apt-get install debootstrap)" >&2; exit 1; }

own_tmp=""
if [ -z "${WORKDIR:-}" ]; then WORKDIR=$(mktemp -d /tmp/nsa-base.XXXXXX); own_tmp=$WORKDIR; fi
cleanup() { if [ -n "${own_tmp}" ]; then rm -rf "${own_tmp}"; fi; }
trap cleanup EXIT
rootfs=${WORKDIR}/rootfs

start=$(date +%s)
echo "make_base: debootstrap bookworm (minbase + python3, python3-venv) from ${mirror}"
debootstrap --variant=minbase --include=python3,python3-venv bookworm "${rootfs}" "${mirror}" \
  > "${WORKDIR}/debootstrap.log" 2>&1 || { tail -n 30 "${WORKDIR}/debootstrap.log" >&2; echo "make_base: debootstrap failed" >&2; exit 1; }
echo "make_base: debootstrap done in $(( $(date +%s) - start )) s, $(du -sh "${rootfs}" | cut -f1)"

rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/* \
       "${rootfs}"/usr/share/doc/* "${rootfs}"/usr/share/man/* "${rootfs}"/usr/share/info/* \
       "${rootfs}"/var/log/*.log "${rootfs}"/var/cache/debconf/*-old "${rootfs}"/tmp/*
find "${rootfs}"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
# The archive, not this machine's mirror, is what the image's apt points to.
echo "deb http://deb.debian.org/debian bookworm main" > "${rootfs}/etc/apt/sources.list"
echo "make_base: trimmed to $(du -sh "${rootfs}" | cut -f1)"

tar --numeric-owner -C "${rootfs}" -c . | "${docker}" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase bookworm + python3 python3-venv" - "${tag}" >/dev/null
echo "make_base: imported ${tag} ($("${docker}" image inspect --format '{{.Size}}' "${tag}") bytes) in $(( $(date +%s) - start )) s"
