#!/usr/bin/env bash
# Build llmserve-base:local, a stand-in for python:3.11-slim where no registry serves images:
# Debian bookworm (Python 3.11, as the public base) made by debootstrap from the Debian mirror
# apt already uses, then `docker import`ed. The Dockerfile builds on either
# (--build-arg BASE_IMAGE=llmserve-base:local). Does nothing when the image exists.
#   usage: scripts/docker/base_image.sh [TAG]
set -euo pipefail

TAG=${1:-llmserve-base:local}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  exit 0
fi
command -v debootstrap >/dev/null || { echo "base image: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

# The mirror of the host's own apt sources (deb822 or one-line), else Debian's default.
MIRROR=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
  | head -n1 | tr -d ' ' || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}

WORK=$(mktemp -d /var/tmp/llmserve-base.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
echo "base image: debootstrap bookworm from $MIRROR (a few minutes) ..." >&2
# minbase + what python:3.11-slim has that the Dockerfile uses: python3 with venv/ensurepip
# and CA certificates (pip over HTTPS). No compiler: the Dockerfile's build stage adds one.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -n 20 "$WORK/debootstrap.log" >&2; exit 1; }
rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
# Trust what the host trusts: certificates in the host's bundle but not Debian's (an
# inspecting proxy's CA) are added, so pip reaches PyPI from the image's builds as from here.
HOST_BUNDLE=/etc/ssl/certs/ca-certificates.crt
if [ -f "$HOST_BUNDLE" ]; then
  ADDED=$(python3 "$(dirname "$0")/extra_ca_certs.py" "$HOST_BUNDLE" \
    "$WORK/rootfs$HOST_BUNDLE" "$WORK/rootfs/usr/local/share/ca-certificates")
  if [ "$ADDED" != 0 ]; then
    echo "base image: trusting $ADDED more CA certificate(s) from the host's bundle" >&2
    chroot "$WORK/rootfs" update-ca-certificates >/dev/null 2>&1
  fi
fi
echo "base image: docker import as $TAG ..." >&2
tar -C "$WORK/rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' \
  - "$TAG" >/dev/null
docker image ls "$TAG" >&2
