#!/usr/bin/env bash
# Debian's podman, buildah, runc and debootstrap: the tools `make image` and the
# image tests (pytest -m image) build and run OCI containers with (no Docker
# engine needed). Idempotent: installs only what is missing; apt's errors are
# shown, never swallowed. Prints the podman path on success.
set -euo pipefail
log() { echo "[install-podman] $*" >&2; }
need=()
for tool in podman:podman buildah:buildah runc:runc debootstrap:debootstrap; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
# rootful podman on this layout also needs fuse-overlayfs-free overlay and slirp
# is unused (host network), so nothing else is required.
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    log "missing: ${need[*]}; run as root (or: sudo apt-get install ${need[*]})"
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt_get() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }
  log "installing ${need[*]}"
  if ! apt_get install -y --no-install-recommends "${need[@]}"; then
    log "install failed; refreshing the package lists and retrying"
    apt_get update
    apt_get install -y --no-install-recommends "${need[@]}"
  fi
fi
for t in podman buildah runc debootstrap; do
  command -v "$t" >/dev/null || { log "$t still missing after install"; exit 1; }
done
command -v podman
