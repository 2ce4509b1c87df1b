#!/usr/bin/env bash
# The quick lint-time check of the container image (no container engine needed):
#  1. hadolint on the Dockerfile;
#  2. the package's install as a plain step: wheels, then `pip install --no-index`
#     of fleetgate into a fresh venv, and the entry points start;
#  3. the install holds the runtime package only: no fleetgate_tools (the
#     development tools in tools/), and `fleetgate bench` says so in one line.
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
if "$W/venv/bin/python" -c 'import fleetgate_tools' 2>/dev/null; then
  echo "the image's fleetgate install contains the development tools (fleetgate_tools)" >&2; exit 1
fi
if out=$("$W/venv/bin/fleetgate" bench --help 2>&1) || ! grep -q "development tool" <<<"$out"; then
  echo "fleetgate bench in the image should fail with the development-tool message, got: $out" >&2; exit 1
fi
echo "image check: hadolint clean; wheel install of fleetgate $version runs router/operator/sim; no tools"
