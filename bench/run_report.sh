#!/usr/bin/env bash
# Reproduces bench/results/*.md and *.png (docs/bench.md shows the headline).
# The emulator and the fleetgate router run from a `git archive` of HEAD, so
# the figures belong to one commit even while the working tree changes.
# One contender at a time on a fresh emulated fleet; about an hour on a shared
# 2-core machine. JSON with every run goes to ${BENCH_JSON_DIR:-/tmp/fg-bench}.
set -euo pipefail
cd "$(dirname "$0")/.."
FG="${FLEETGATE:-.venv/bin/fleetgate}"
OUT="${BENCH_JSON_DIR:-/tmp/fg-bench}"
SHA="$(git rev-parse --short HEAD)"
SRC="/tmp/fleetgate-src-$SHA"
rm -rf "$SRC" && mkdir -p "$SRC" "$OUT" bench/results
git archive HEAD fleetgate | tar -x -C "$SRC"
PRIO=fleetgate,fleetgate-random,vllm-router-cache_aware,vllm-router-round_robin,sglang-router-cache_aware

for w in ${WORKLOADS:-shared-prefix chat-multiturn}; do
  "$FG" bench run "$w" --engines 4 --duration 30 --seed 0 --repeats 2 --contenders all \
    --source "$SRC" --json "$OUT/$w.json" --report bench/results
done
for w in ${PRIORITY_WORKLOADS:-priority-storm mixed-engine}; do
  "$FG" bench run "$w" --engines 4 --duration 30 --seed 0 --repeats 1 --contenders "$PRIO" \
    --source "$SRC" --json "$OUT/$w.json" --report bench/results
done
