#!/usr/bin/env bash
# The base image of kvrelay's container image, with no container registry: a Debian root made by debootstrap from
# the Debian mirror and imported as the local image kvrelay-base:bookworm. Does nothing when that image exists
# (FORCE=1 rebuilds it). Root only (debootstrap chroots and creates device nodes).
#
#   bash scripts/container-base.sh            # then: podman build -t kvrelay:cpu .  (the Dockerfile's default BASE)
#
# Python 3.11 and the venv module come from Debian; everything else (the compiler, pip's packages) from the
# Dockerfile. minbase: apt and dpkg without the "important" priority set (no editors, cron, man pages).
set -euo pipefail
IMAGE="${BASE_IMAGE:-kvrelay-base:bookworm}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
PODMAN="${PODMAN:-podman}"

if [ "${FORCE:-0}" != 1 ] && $PODMAN image exists "$IMAGE"; then
  echo "container-base: $IMAGE exists (FORCE=1 rebuilds it)"
  exit 0
fi
root="$(mktemp -d "${TMPDIR:-/var/tmp}/kvrelay-debootstrap.XXXXXX")"
trap 'rm -rf "$root"' EXIT
start=$SECONDS
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR"
# apt's package lists and the downloaded .debs are not part of the image (the Dockerfile's apt-get update refetches).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | $PODMAN import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$IMAGE"
echo "container-base: $IMAGE from debootstrap $SUITE ($MIRROR) in $((SECONDS - start)) s"
