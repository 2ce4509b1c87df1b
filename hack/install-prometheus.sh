#!/usr/bin/env bash
# Debian's prometheus package, for the dashboard test (a REAL Prometheus that
# scrapes the router, the operator and emulated engines on loopback).
# Only the binary is used; the package's own service is stopped if it started.
set -euo pipefail
if ! command -v prometheus >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends prometheus >/dev/null; }
  # never leave the distribution's service running (it listens on all addresses)
  (service prometheus stop || systemctl stop prometheus || pkill -x prometheus) >/dev/null 2>&1 || true
fi
command -v prometheus
