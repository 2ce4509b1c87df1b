#!/usr/bin/env bash
# The quick lint-time check of the container image (no container engine needed):
#  1. hadolint on the Dockerfile;
#  2. the package's install as a plain step: wheels, then `pip install --no-index`
#     of fleetgate into a fresh venv, and the entry points start.
# The image itself is built and run by the image tests (pytest -m image,
# tests/image/, with podman: hack/build-image.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
"$(dirname "$PY")/hadolint" Dockerfile
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
version=$("$PY" -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
"$PY" -m pip wheel -q --wheel-dir "$W/wheels" . >/dev/null
python3 -m venv "$W/venv"
"$W/venv/bin/pip" install -q --no-index --find-links="$W/wheels" "fleetgate==$version"
for cmd in "--version" "router --help" "operator --help" "sim --help"; do
  # shellcheck disable=SC2086
  "$W/venv/bin/fleetgate" $cmd >/dev/null
done
echo "image check: hadolint clean; wheel install of fleetgate $version runs router/operator/sim"
