#!/usr/bin/env bash
# Reproduces bench/results/*.md and *.png (docs/bench.md shows the headline).
# Runs one contender at a time on a fresh emulated fleet; about an hour on a
# shared 2-core machine. JSON with every run goes to ${BENCH_JSON_DIR:-/tmp/fg-bench}.
set -euo pipefail
cd "$(dirname "$0")/.."
FG="${FLEETGATE:-.venv/bin/fleetgate}"
OUT="${BENCH_JSON_DIR:-/tmp/fg-bench}"
mkdir -p "$OUT" bench/results
PEERS=vllm-router-cache_aware,vllm-router-power_of_two,vllm-router-round_robin,sglang-router-cache_aware
PRIO=fleetgate,fleetgate-random,vllm-router-cache_aware,vllm-router-round_robin,sglang-router-cache_aware

for w in shared-prefix chat-multiturn; do
  "$FG" bench run "$w" --engines 4 --duration 30 --seed 0 --repeats 2 --contenders all \
    --json "$OUT/$w.json" --report bench/results
done
for w in priority-storm mixed-engine; do
  "$FG" bench run "$w" --engines 4 --duration 30 --seed 0 --repeats 1 --contenders "$PRIO" \
    --json "$OUT/$w.json" --report bench/results
done
echo "peers compared: $PEERS"
