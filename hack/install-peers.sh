#!/usr/bin/env bash
# Install the peer routers for bench/bench_router_overhead.py, each into its own venv:
#   vllm-router==0.1.17    -> ~/.cache/fleetgate/peers/vllm-router-0.1.17/bin/vllm-router
#   sglang-router==0.3.2   -> ~/.cache/fleetgate/peers/sglang-router-0.3.2/bin/python -m sglang_router.launch_router
# Both are Rust binaries shipped as PyPI wheels. Idempotent: a venv whose package
# imports/runs is reused. Prints "NAME=PATH" per peer on success; on failure the
# exact pip/--help error is kept in ~/.cache/fleetgate/peers/NAME.log and the
# script exits non-zero after trying both.
# The bench always binds them to 127.0.0.1 (router and Prometheus ports).
set -uo pipefail

PEERS="${FLEETGATE_CACHE:-$HOME/.cache/fleetgate}/peers"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
mkdir -p "$PEERS"
status=0

install_one() {  # name version check-command...
    local name="$1" version="$2"; shift 2
    local venv="$PEERS/$name-$version" log="$PEERS/$name.log"
    local shown=""
    [ -x "$venv/bin/pip" ] && shown="$("$venv/bin/pip" show "$name" 2>/dev/null)"
    if grep -qx "Version: $version" <<<"$shown" && (cd /tmp && "$@" >/dev/null 2>&1); then
        echo "$name=$venv"
        return 0
    fi
    rm -rf "$venv"
    {
        echo "== $(date -u +%FT%TZ) installing $name==$version with $PYTHON"
        "$PYTHON" -m venv "$venv" && "$venv/bin/pip" install --quiet --disable-pip-version-check \
            "$name==$version" && (cd /tmp && "$@")
    } >"$log" 2>&1
    local rc=$?
    echo "rc=$rc" >>"$log"
    if [ $rc -ne 0 ]; then
        echo "$name: install or --help failed (rc=$rc); last lines of $log:" >&2
        tail -n 15 "$log" >&2
        status=1
        return 1
    fi
    echo "$name=$venv"
}

install_one vllm-router 0.1.17 "$PEERS/vllm-router-0.1.17/bin/vllm-router" --help
install_one sglang-router 0.3.2 "$PEERS/sglang-router-0.3.2/bin/python" -m sglang_router.launch_router --help
exit $status
