#!/usr/bin/env bash
# Build the Kubernetes test control plane from Go modules with the machine's Go:
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (one release),
# etcd, kwok and helm. Binaries are cached per version OUTSIDE the checkout
# (default ~/.cache/fleetgate/k8s-bins/<versions>/bin) so a second run builds
# nothing. Never commit these binaries.
#
# Usage: hack/build-k8s-bins.sh            # builds what is missing, prints the bin dir
# Env:   FLEETGATE_CACHE (default ~/.cache/fleetgate); K8S_VERSION, ETCD_VERSION,
#        KWOK_VERSION, HELM_VERSION (tools/fleetgate_tools/devcluster/bins.py passes its pins).
# Measured cold on 2 cores (empty module + build cache): 14m30s wall (docs/dev-cluster.md).
# Warm (everything present): well under a second, nothing is compiled.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
HELM_VERSION="${HELM_VERSION:-v3.21.4}"

CACHE="${FLEETGATE_CACHE:-$HOME/.cache/fleetgate}"
ROOT="$CACHE/k8s-bins/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION"
BIN="$ROOT/bin"
export GOPATH="$CACHE/go"
export GOMODCACHE="$CACHE/go/pkg/mod"
export GOCACHE="$CACHE/go-build"
export GOFLAGS="-mod=mod"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
mkdir -p "$BIN"
log() { echo "[build-k8s-bins] $*" >&2; }
have() { [ -x "$BIN/$1" ]; }
start=$(date +%s)
step=$start
took() { local now; now=$(date +%s); log "$1 took $(( now - step ))s"; step=$now; }

# One build at a time per cache (parallel test sessions, CI retries): a second caller
# waits here, then finds everything built and skips it.
exec 9>"$CACHE/k8s-bins/.build.lock"
if ! flock -n 9; then
  log "another build holds $CACHE/k8s-bins/.build.lock; waiting for it"
  flock 9
fi

MINOR="${K8S_VERSION#1.}"; MINOR="${MINOR%%.*}"

if ! (have kube-apiserver && have kube-controller-manager && have kube-scheduler && have kubectl); then
  log "building Kubernetes v$K8S_VERSION (apiserver, controller-manager, scheduler, kubectl)"
  W="$ROOT/src/k8s"; rm -rf "$W"; mkdir -p "$W"; cd "$W"
  go mod init example.invalid/k8s-bins
  GOMOD=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
  for m in $(sed -n 's#^\s*\(k8s.io/[^ ]*\) => ./staging/.*#\1#p' "$GOMOD"); do
    go mod edit "-replace=$m=$m@v0.${K8S_VERSION#1.}"
  done
  # the main module's godebug defaults apply: copy k/k's
  gd=$(sed -n 's#^godebug \(.*\)#\1#p' "$GOMOD" | head -1 || true)
  if [ -n "$gd" ]; then go mod edit "-godebug=$gd"; fi
  go get "k8s.io/kubernetes@v$K8S_VERSION"
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  # -e: tidy what it can; a module it could not resolve is printed, and go build
  # below fails if it matters
  go mod tidy -e || log "go mod tidy -e reported the errors above; go build decides"
  V="v$K8S_VERSION"; LDF="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    LDF="$LDF -X $p.gitVersion=$V -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  go build -trimpath -ldflags "$LDF" -o "$BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
  took "Kubernetes v$K8S_VERSION"
fi

if ! have etcd; then
  log "building etcd $ETCD_VERSION"
  W="$ROOT/src/etcd"; rm -rf "$W"; mkdir -p "$W"; cd "$W"
  go mod init example.invalid/etcd-bin
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
  # -e: tidy what it can; a module it could not resolve is printed, and go build
  # below fails if it matters
  go mod tidy -e || log "go mod tidy -e reported the errors above; go build decides"
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  took "etcd $ETCD_VERSION"
fi

if ! have kwok; then
  log "building kwok $KWOK_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  took "kwok $KWOK_VERSION"
fi
# kwok >= 0.8 has no built-in stages: keep the stage files beside the binary
# (copied to a temp name and renamed, so an interrupted copy is never taken as done)
if [ ! -d "$ROOT/kwok-stages" ]; then
  go mod download "sigs.k8s.io/kwok@$KWOK_VERSION"
  rm -rf "$ROOT/kwok-stages.tmp"
  cp -r "$GOMODCACHE/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage" "$ROOT/kwok-stages.tmp"
  chmod -R u+w "$ROOT/kwok-stages.tmp"
  mv "$ROOT/kwok-stages.tmp" "$ROOT/kwok-stages"
fi

if ! have helm; then
  log "building helm $HELM_VERSION"
  HM=helm.sh/helm/v3
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w \
    -X $HM/pkg/chartutil.k8sVersionMajor=1 -X $HM/pkg/chartutil.k8sVersionMinor=$MINOR \
    -X $HM/pkg/lint/rules.k8sVersionMajor=1 -X $HM/pkg/lint/rules.k8sVersionMinor=$MINOR \
    -X $HM/internal/version.version=$HELM_VERSION" "$HM/cmd/helm@$HELM_VERSION"
  took "helm $HELM_VERSION"
fi

log "done in $(( $(date +%s) - start ))s"
echo "$BIN"
