#!/usr/bin/env python3
"""Count where router replicas copied a document: a decision-trace analysis.

Reads every ``PREFIX.<pid>`` file the router wrote with ``FLEETGATE_DECISION_TRACE=PREFIX``
(one per replica), merges the placements by time (the trace's ``t`` is the monotonic
clock, shared by processes on one machine) and groups them by document (the prompt's
first approximate chunk). A *new-engine placement* is a request for a document sent to
an engine no earlier request for it went to: a full prefill and a second copy.

    python hack/decision_trace_placements.py /tmp/trace/t

Prints the placements by reason, then the new-engine placements by (reason, whether
this replica's view held the document anywhere, whether an earlier placement was made
by the same replica), with the uncached prompt tokens the engines reported for them;
then how much of the prompts some engine held at the decision (the most any pick could
have got), and where cached tokens were lost: to picking an engine that held less of the
prompt than another did (by reason), and between the decision and the prefill (the
engine reported fewer cached tokens than the router predicted: evicted while the
request waited), with the picked engines' median work and prefill backlog for those.
"""

from __future__ import annotations

import collections
import glob
import json
import sys
from typing import Any


def load(prefix: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    placements: list[dict[str, Any]] = []
    usage: dict[str, dict[str, Any]] = {}
    for path in glob.glob(prefix + ".*"):
        replica = path.rsplit(".", 1)[1]
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if "usage" in record:
                    usage[record["usage"]] = record
                else:
                    record["replica"] = replica
                    placements.append(record)
    placements.sort(key=lambda r: r["t"])
    return placements, usage


def new_engine_placements(
    placements: list[dict[str, Any]], usage: dict[str, dict[str, Any]]
) -> tuple[collections.Counter[tuple[str, str, str]], collections.Counter[tuple[str, str, str]]]:
    count: collections.Counter[tuple[str, str, str]] = collections.Counter()
    tokens: collections.Counter[tuple[str, str, str]] = collections.Counter()
    by_doc: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in placements:
        by_doc[r["doc"]].append(r)
    for records in by_doc.values():
        seen: dict[str, str] = {}  # engine -> replica that first placed the document there
        for r in records:
            pick = r["pick"]
            if seen and pick not in seen:
                # eps: endpoint -> [exact tokens, approximate tokens, work, backlog, score]
                held = any(v[0] or v[1] for v in r["eps"].values())
                same = r["replica"] in seen.values()
                key = (
                    r["reason"],
                    "held somewhere" if held else "held nowhere",
                    "same replica before" if same else "other replica before",
                )
                count[key] += 1
                u = usage.get(r["id"])
                if u is not None:
                    tokens[key] += u["prompt"] - u["cached"]
            seen.setdefault(pick, r["replica"])
    return count, tokens


def losses(placements: list[dict[str, Any]], usage: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prompt and cached tokens over the placements the engines answered, the tokens lost
    to a lesser holder by reason, and those lost between decision and prefill; ``anywhere``:
    the prompt tokens the best holder held at the decision (the most a pick could get)."""
    out: dict[str, Any] = {
        "prompt": 0,
        "cached": 0,
        "anywhere": 0,
        "lesser": collections.Counter(),
        "evicted": 0,
        "evicted_requests": 0,
        "evicted_at": [],
        "kept_at": [],
    }
    for r in placements:
        u = usage.get(r["id"])
        if u is None:
            continue
        out["prompt"] += u["prompt"]
        out["cached"] += u["cached"]
        # eps: endpoint -> [exact tokens, approximate tokens, work, backlog, score]; the
        # view that predicted (``src``) says which count the router went by
        view = 0 if u.get("src") == "events" else 1
        best = max(v[view] for v in r["eps"].values())
        out["anywhere"] += min(u["prompt"], best)
        picked = r["eps"].get(r["pick"], [0, 0, 0.0, 0, 0.0])
        out["lesser"][r["reason"]] += best - picked[view]
        where = (picked[2], picked[3])
        if u["pred"] > u["cached"]:
            out["evicted"] += u["pred"] - u["cached"]
            out["evicted_requests"] += 1
            out["evicted_at"].append(where)
        else:
            out["kept_at"].append(where)
    return out


def _median(values: list[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2 if v else 0.0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    placements, usage = load(argv[1])
    if not placements:
        print(f"no trace files {argv[1]}.*", file=sys.stderr)
        return 2
    print(
        f"placements: {len(placements)}", dict(collections.Counter(r["reason"] for r in placements))
    )
    count, tokens = new_engine_placements(placements, usage)
    print(f"new-engine placements: {sum(count.values())}, uncached tokens {sum(tokens.values())}")
    for key, n in count.most_common():
        print(f"  {' / '.join(key)}: {n} ({tokens[key]} tokens)")
    lost = losses(placements, usage)
    if lost["prompt"]:
        p = lost["prompt"]
        print(f"hit rate {lost['cached'] / p:.1%} ({lost['cached']} of {p} prompt tokens)")
        print(
            f"  held by some engine at the decision: {lost['anywhere'] / p:.1%} (the rest was "
            "never cached or was evicted everywhere before it: no placement recovers it)"
        )
        for reason, n in sorted(lost["lesser"].items()):
            print(f"  lost to a lesser holder, {reason}: {n} tokens ({n / p:.1%})")
        ev, at, ok = lost["evicted"], lost["evicted_at"], lost["kept_at"]
        print(
            f"  lost between decision and prefill: {ev} tokens ({ev / p:.1%}) in "
            f"{lost['evicted_requests']} requests; picked engine's median work "
            f"{_median([w for w, _ in at]):.2f} and backlog {_median([b for _, b in at]):.0f} "
            f"tokens (the others: {_median([w for w, _ in ok]):.2f}, "
            f"{_median([b for _, b in ok]):.0f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
