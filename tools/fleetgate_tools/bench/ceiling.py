"""The hit-rate ceiling of a workload: what no router can beat.

One engine with an unbounded prefix cache holds every block of every earlier
prompt; a request then hits exactly the blocks its prompt shares, block for block
from the start, with some earlier prompt. The share of prompt tokens hit that way
over the steady window (after the warm-up) is the ceiling of the engines' hit rate
for any router and any fleet of that block size: a real fleet loses to it by
evictions (a cache smaller than the working set) and by placing one prefix on
several engines (each first visit misses). Reported next to the measured hit rates
so a "+5 points over the best peer" goal can be read against the room there is.

Only for workloads whose sessions are single requests (shared-prefix, evictions,
flash-crowd): later turns of a conversation carry the engine's answers, which are
not known before the run.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetgate.router.scheduling.tokenize import Tokenizer, prompt_token_ids
from fleetgate_tools.bench.workloads import Session


def hit_ceiling(
    sessions: Sequence[Session], warmup_s: float, tokenizer: Tokenizer, block: int = 16
) -> float | None:
    """The ceiling (0-1) over the requests starting at or after ``warmup_s``; None
    when a session has more than one request or nothing is steady."""
    if any(len(s.turns) != 1 for s in sessions):
        return None
    seen: set[int] = set()
    hit = total = 0
    for s in sorted(sessions, key=lambda s: s.start_s):
        ids = prompt_token_ids({"messages": s.messages_for(0, [])}, tokenizer)
        if ids is None:
            return None
        keys: list[int] = []
        h = 0
        for i in range(len(ids) // block):
            h = hash((h, tuple(ids[i * block : (i + 1) * block])))
            keys.append(h)
        matched = 0
        for k in keys:
            if k not in seen:
                break
            matched += 1
        if s.start_s >= warmup_s:
            hit += matched * block
            total += len(ids)
        seen.update(keys)
    return hit / total if total else None
