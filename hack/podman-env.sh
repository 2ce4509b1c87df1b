# Sourced by the image scripts: podman/buildah with fleetgate's containers.conf.
# shellcheck shell=bash
_fg_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$_fg_root/hack/containers.conf}"
export FLEETGATE_CACHE="${FLEETGATE_CACHE:-$HOME/.cache/fleetgate}"
