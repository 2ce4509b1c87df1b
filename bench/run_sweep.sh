#!/usr/bin/env bash
# TTFT against offered load (bench/results/shared-prefix-sweep.*): fleetgate and
# the peers at 0.5x, 1x and 1.5x the shared-prefix base rate, one repeat each.
# Like run_report.sh, the emulator and router run from a git archive of HEAD.
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
"$FG" bench run shared-prefix --engines 4 --wall-duration 30 --seed 0 --repeats 1 \
  --load-factors 0.5,1,1.5 \
  --contenders fleetgate,vllm-router-cache_aware,vllm-router-round_robin,sglang-router-cache_aware \
  --source "$SRC" --json "$OUT/shared-prefix-sweep.json" --report bench/results \
  --report-name shared-prefix-sweep
