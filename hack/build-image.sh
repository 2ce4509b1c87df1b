#!/usr/bin/env bash
# Build fleetgate's container image(s); print the reference of the last one built
# on the last line of stdout.
#
#   hack/build-image.sh                  # the operator/router image (target runtime)
#   hack/build-image.sh emulator         # the engine emulator image
#   hack/build-image.sh runtime emulator # both (prints the emulator's reference last)
#
# With a reachable Docker engine: `docker build` from the Dockerfile's default
# base (python:3.11-slim-bookworm, pulled from its registry). Otherwise podman
# (hack/install-podman.sh installs Debian's podman, buildah and runc) with the
# settings in hack/containers.conf, the base made locally by
# hack/make-base-image.sh (debootstrap; no registry needed), --pull=never,
# --network=host, and this machine's CA bundle mounted read-only into RUN
# steps for pip. Layers are cached by the engine: only a changed
# pyproject.toml re-resolves dependencies. FLEETGATE_IMAGE_ENGINE=docker|podman
# forces the choice; IMAGE_TAG overrides the tag (default: the package version).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/podman-env.sh
. hack/podman-env.sh
log() { echo "[build-image] $*" >&2; }
targets=("$@"); [ "${#targets[@]}" -gt 0 ] || targets=(runtime)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
tag="${IMAGE_TAG:-$version}"

engine="${FLEETGATE_IMAGE_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then engine=docker; else engine=podman; fi
fi
build=()
case "$engine" in
  docker) build=(docker build) ;;
  podman)
    command -v podman >/dev/null 2>&1 || bash hack/install-podman.sh >&2  # stdout: the image ref only
    base=$(bash hack/make-base-image.sh | tail -1)
    ca="${FLEETGATE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
    build=(podman build --pull=never --network=host --layers --build-arg "BASE=$base")
    if [ -r "$ca" ]; then
      build+=(--volume "$ca:/run/fleetgate-ca.crt:ro" --build-arg CA_BUNDLE=/run/fleetgate-ca.crt)
    fi ;;
  *) log "FLEETGATE_IMAGE_ENGINE must be docker or podman, not $engine"; exit 2 ;;
esac

ref=""
for target in "${targets[@]}"; do
  case "$target" in
    runtime) ref="localhost/fleetgate:$tag" ;;
    emulator) ref="localhost/fleetgate-emulator:$tag" ;;
    *) log "unknown target $target (runtime, emulator)"; exit 2 ;;
  esac
  start=$(date +%s)
  log "$engine: building $ref (target $target)"
  "${build[@]}" --target "$target" --tag "$ref" . >&2
  log "built $ref in $(( $(date +%s) - start )) s"
done
echo "$ref"
