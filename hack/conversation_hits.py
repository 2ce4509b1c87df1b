#!/usr/bin/env python3
"""Where a multi-turn workload's cache hits go: a ``fleetgate bench run --requests`` analysis.

    python hack/conversation_hits.py REQUESTS.jsonl [BLOCK_TOKENS]

Per run (contender, seed), over the requests sent after the warm-up:

* first turns: how many, their hit rate (cached / prompt tokens) and their share of
  all prompt tokens;
* later turns: their hit rate, and how many KEPT their history: the engine reported
  at least the previous turn's prompt in whole blocks as cached (an engine that kept
  the earlier prompt hits at least that much; ``BLOCK_TOKENS``, default 16, vLLM's
  block; on a mixed fleet give the largest block size of its engines, 32 for the
  emulated TensorRT-LLM, or a kept turn there reads as lost); the rest LOST it, and the
  tokens they lost (that floor minus what hit) as a share of all prompt tokens;
* kept share by the later turn's TTFT (a request that waits in an engine's queue
  waits while the engine allocates for others) and, where the router names the
  endpoint (``x-fleetgate-endpoint``), by whether it went where the previous turn did;
* per engine: hit rate / prompt tokens queried.
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterable
from typing import Any

DEFAULT_BLOCK = 16
TTFT_BUCKETS = ((0.0, 0.05), (0.05, 0.2), (0.2, 0.5), (0.5, 1.0), (1.0, float("inf")))


def load(lines: Iterable[str]) -> tuple[dict[Any, list[dict[str, Any]]], dict[Any, Any]]:
    runs: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    meta: dict[Any, Any] = collections.defaultdict(lambda: {"engines": []})
    for line in lines:
        r = json.loads(line)
        key = (r["contender"], r["seed"])
        if r["record"] == "run":
            meta[key]["warmup_s"] = r["warmup_s"]
        elif r["record"] == "engine":
            meta[key]["engines"].append(r)
        else:
            runs[key].append(r)
    return runs, meta


def analyse(
    requests: list[dict[str, Any]], warmup_s: float, block: int = DEFAULT_BLOCK
) -> dict[str, Any]:
    sessions: dict[str, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    for r in requests:
        sessions[r["session_id"]][r["turn"]] = r
    c: collections.Counter[str] = collections.Counter()
    later: list[tuple[float, bool, bool | None]] = []  # (ttft, kept, same endpoint)
    for turns in sessions.values():
        for t, r in turns.items():
            if r["sent_at"] < warmup_s or r["prompt_tokens"] is None or r["ttft"] is None:
                continue
            prompt, cached = r["prompt_tokens"], r["cached_tokens"] or 0
            if t == 0:
                c["first_n"] += 1
                c["first_prompt"] += prompt
                c["first_cached"] += cached
                continue
            prev = turns.get(t - 1)
            if prev is None or prev["prompt_tokens"] is None:
                continue
            floor = prev["prompt_tokens"] // block * block
            kept = cached >= floor
            c["later_n"] += 1
            c["later_prompt"] += prompt
            c["later_cached"] += cached
            c["kept"] += kept
            c["lost_tokens"] += 0 if kept else floor - cached
            same = None
            if r.get("endpoint") and prev.get("endpoint"):
                same = r["endpoint"] == prev["endpoint"]
            later.append((r["ttft"], kept, same))
    total = c["first_prompt"] + c["later_prompt"]
    return {"counts": c, "total": total, "later": later}


def report(key: Any, a: dict[str, Any], engines: list[dict[str, Any]]) -> list[str]:
    c, total, later = a["counts"], max(1, a["total"]), a["later"]
    hit = (c["first_cached"] + c["later_cached"]) / total
    out = [
        f"{key[0]} seed {key[1]}: hit {hit:.1%}; first turns {c['first_n']}, hit "
        f"{c['first_cached'] / max(1, c['first_prompt']):.1%}, "
        f"{c['first_prompt'] / total:.0%} of prompt tokens; later turns {c['later_n']}, hit "
        f"{c['later_cached'] / max(1, c['later_prompt']):.1%}, kept {c['kept']}, lost "
        f"{c['later_n'] - c['kept']} ({c['lost_tokens'] / total:.1%} of prompt tokens)"
    ]
    for lo, hi in TTFT_BUCKETS:
        sel = [k for ttft, k, _ in later if lo <= ttft < hi]
        if sel:
            out.append(
                f"  TTFT [{lo:g}, {hi:g}) s: {len(sel)} later turns, kept {sum(sel) / len(sel):.0%}"
            )
    for same in (True, False):
        sel = [k for _, k, s in later if s is same]
        if sel:
            where = "same endpoint" if same else "another endpoint"
            out.append(
                f"  {where} as the previous turn: {len(sel)}, kept {sum(sel) / len(sel):.0%}"
            )
    shown = [
        f"{e['prefix_hit_tokens'] / e['prefix_query_tokens']:.0%}/{e['prefix_query_tokens']:.0f}"
        for e in engines
        if e.get("prefix_query_tokens")
    ]
    if shown:
        out.append("  engines (hit rate / prompt tokens queried): " + " ".join(shown))
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or (len(argv) == 3 and not argv[2].isdigit()):
        print(__doc__, file=sys.stderr)
        return 2
    block = int(argv[2]) if len(argv) == 3 else DEFAULT_BLOCK
    with open(argv[1]) as f:
        runs, meta = load(f)
    for key in sorted(runs):
        a = analyse(runs[key], meta[key].get("warmup_s", 0.0), block)
        print("\n".join(report(key, a, meta[key]["engines"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
