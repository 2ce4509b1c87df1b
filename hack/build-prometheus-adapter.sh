#!/usr/bin/env bash
# Build prometheus-adapter (sigs.k8s.io/prometheus-adapter, cmd/adapter) from its Go
# module with the machine's Go, the way hack/build-k8s-bins.sh builds the control plane,
# for the HPA-on-Prometheus contender (tools/fleetgate_tools/devcluster/metricsstack.py).
# Cached OUTSIDE the checkout: $FLEETGATE_CACHE/prometheus-adapter/<version>/bin.
#
# `go install module@version` is refused here: the module proxy answers 403 to the
# module's version list, which go install reads for deprecation notices; the exact
# version is served, so it is required from a scratch module and built with go build.
# Measured on 2 cores with the control plane's module cache warm: 2m58s.
#
# Usage: hack/build-prometheus-adapter.sh     # builds if missing, prints the binary
# Env:   FLEETGATE_CACHE (default ~/.cache/fleetgate); ADAPTER_VERSION (default v0.12.0).
set -euo pipefail

ADAPTER_VERSION="${ADAPTER_VERSION:-v0.12.0}"
CACHE="${FLEETGATE_CACHE:-$HOME/.cache/fleetgate}"
ROOT="$CACHE/prometheus-adapter/$ADAPTER_VERSION"
BIN="$ROOT/bin"
export GOPATH="$CACHE/go"
export GOMODCACHE="$CACHE/go/pkg/mod"
export GOCACHE="$CACHE/go-build"
export GOFLAGS="-mod=mod"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
log() { echo "[build-prometheus-adapter] $*" >&2; }
mkdir -p "$BIN"
exec 9>"$ROOT/.build.lock"
if ! flock -n 9; then
  log "another build holds $ROOT/.build.lock; waiting for it"
  flock 9
fi
if [ -x "$BIN/prometheus-adapter" ]; then echo "$BIN/prometheus-adapter"; exit 0; fi

start=$(date +%s)
log "building prometheus-adapter $ADAPTER_VERSION"
W="$ROOT/src"; rm -rf "$W"; mkdir -p "$W"; cd "$W"
go mod init example.invalid/prometheus-adapter-bin
go get "sigs.k8s.io/prometheus-adapter@$ADAPTER_VERSION"
printf '//go:build tools\n\npackage tools\n\nimport _ "sigs.k8s.io/prometheus-adapter/cmd/adapter"\n' > tools.go
go mod tidy -e || log "go mod tidy -e reported the errors above; go build decides"
# built to a temp name and renamed: an interrupted build is never taken as done
go build -trimpath -ldflags "-s -w" -o "$BIN/prometheus-adapter.tmp" \
  sigs.k8s.io/prometheus-adapter/cmd/adapter
mv "$BIN/prometheus-adapter.tmp" "$BIN/prometheus-adapter"
log "done in $(( $(date +%s) - start ))s"
echo "$BIN/prometheus-adapter"
