#!/usr/bin/env bash
# Debian's prometheus package, for the dashboard test (a REAL Prometheus that
# scrapes the router, the operator and emulated engines on loopback).
# Only the binary is used. If installing the package started its service, the
# script stops exactly that: the unit it just installed (systemd) or the
# prometheus processes that appeared during the install, by PID; a Prometheus
# the user runs is left alone. Errors of apt-get are shown, never hidden.
# Env: APT_GET (default apt-get; tests point it at a fake).
set -euo pipefail
log() { echo "[install-prometheus] $*" >&2; }
APT_GET="${APT_GET:-apt-get}"

if ! command -v prometheus >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  before=" $(pgrep -x prometheus | tr '\n' ' ' || true) "
  log "installing Debian's prometheus package"
  if ! "$APT_GET" install -y -q --no-install-recommends prometheus; then
    log "install failed; updating the package index and trying once more"
    "$APT_GET" update -q
    "$APT_GET" install -y -q --no-install-recommends prometheus
  fi
  # never leave the distribution's service running (it listens on all addresses)
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now prometheus.service || log "could not stop prometheus.service"
  fi
  installed=$(readlink -f "$(command -v prometheus)")
  for pid in $(pgrep -x prometheus || true); do
    case "$before" in *" $pid "*) continue ;; esac   # running before: not ours
    # only a process of the binary just installed (no one else could start it yet)
    [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" = "$installed" ] || continue
    log "stopping the prometheus the package started (pid $pid)"
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  done
fi
command -v prometheus
