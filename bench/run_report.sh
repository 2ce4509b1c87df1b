#!/usr/bin/env bash
# Reproduces bench/results/*.md and *.png (docs/bench.md shows the headline).
# The emulator and the fleetgate router run from a `git archive` of HEAD, so
# the figures belong to one commit even while the working tree changes.
# One contender at a time on a fresh emulated fleet; about 90 minutes on a shared
# 2-core machine. JSON with every run goes to ${BENCH_JSON_DIR:-/tmp/fg-bench}.
# --wall-duration 30: the committed results were made with 30 WALL seconds of
# arrivals (the old --duration); the steady-state rules (docs/bench.md) take
# --duration in modelled seconds and leave out a 10% warm-up.
set -euo pipefail
cd "$(dirname "$0")/.."
FG="${FLEETGATE:-.venv/bin/fleetgate}"
OUT="${BENCH_JSON_DIR:-/tmp/fg-bench}"
SHA="$(git rev-parse --short HEAD)"
SRC="/tmp/fleetgate-src-$SHA"
rm -rf "$SRC" && mkdir -p "$SRC" "$OUT" bench/results
git archive HEAD fleetgate | tar -x -C "$SRC"
PRIO=fleetgate,fleetgate-no-preemption,vllm-router-cache_aware,vllm-router-round_robin,sglang-router-cache_aware
MIXED=fleetgate,fleetgate-no-speed,fleetgate-no-preemption,vllm-router-cache_aware,vllm-router-round_robin,sglang-router-cache_aware

for w in ${WORKLOADS:-shared-prefix chat-multiturn}; do
  "$FG" bench run "$w" --engines 4 --wall-duration 30 --seed 0 --repeats 2 --contenders all \
    --source "$SRC" --json "$OUT/$w.json" --report bench/results --force
done
"$FG" bench run priority-storm --engines 4 --wall-duration 30 --seed 0 --repeats 3 --contenders "$PRIO" \
  --source "$SRC" --json "$OUT/priority-storm.json" --report bench/results --force
"$FG" bench run mixed-engine --engines 4 --wall-duration 30 --seed 0 --repeats 2 --contenders "$MIXED" \
  --source "$SRC" --json "$OUT/mixed-engine.json" --report bench/results --force
"$FG" bench run agentic --engines 4 --wall-duration 30 --seed 0 --repeats 1 \
  --contenders fleetgate,fleetgate-least-loaded,vllm-router-cache_aware,vllm-router-power_of_two,sglang-router-cache_aware \
  --source "$SRC" --json "$OUT/agentic.json" --report bench/results --force
