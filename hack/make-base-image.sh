#!/usr/bin/env bash
# The base image for local builds: Debian bookworm with Debian's python3.11,
# made with debootstrap (no registry is needed). Cached twice: the root
# filesystem tarball under $FLEETGATE_CACHE/base/, and the imported image in
# podman's store. Prints the image reference on its last line.
#
# Users with a registry keep the Dockerfile's default base
# (python:3.11-slim-bookworm); this one only stands in for it here.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/podman-env.sh
. hack/podman-env.sh
log() { echo "[make-base-image] $*" >&2; }
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python3-venv: the build stage makes the runtime venv with it
PACKAGES="python3.11,python3,python3-venv"
REF="localhost/fleetgate-base:$SUITE-python3.11"
DIR="$FLEETGATE_CACHE/base"
TAR="$DIR/$SUITE-python3.11.tar"
mkdir -p "$DIR"

if [ ! -s "$TAR" ]; then
  start=$(date +%s)
  root=$(mktemp -d "$DIR/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  log "debootstrap $SUITE ($PACKAGES) from $MIRROR"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >"$DIR/debootstrap.log" 2>&1 \
    || { tail -30 "$DIR/debootstrap.log" >&2; log "debootstrap failed (full log: $DIR/debootstrap.log)"; exit 1; }
  # what a container never needs: package caches, docs, man pages, locales
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
    "$root"/usr/share/locale/* "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
  tar --numeric-owner -C "$root" -cf "$TAR.tmp" .
  mv "$TAR.tmp" "$TAR"
  log "root filesystem cached: $TAR ($(du -h "$TAR" | cut -f1), $(( $(date +%s) - start )) s)"
fi
sum=$(sha256sum "$TAR" | cut -c1-12)
if [ "$(podman image inspect --format '{{index .Labels "org.fleetgate.base-tar"}}' "$REF" 2>/dev/null || true)" != "$sum" ]; then
  log "importing $TAR as $REF"
  podman import --change "LABEL org.fleetgate.base-tar=$sum" --change 'CMD ["/bin/bash"]' \
    "$TAR" "$REF" >/dev/null
fi
echo "$REF"
