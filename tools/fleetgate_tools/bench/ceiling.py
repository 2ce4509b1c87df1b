"""The hit-rate ceiling of a workload: what no router can beat.

One engine with an unbounded prefix cache holds every block of every earlier
prompt; a request then hits exactly the blocks its prompt shares, block for block
from the start, with some earlier prompt. The share of prompt tokens hit that way
over the steady window (after the warm-up) is the ceiling of the engines' hit rate
for any router and any fleet of that block size: a real fleet loses to it by
evictions (a cache smaller than the working set) and by placing one prefix on
several engines (each first visit misses). Reported next to the measured hit rates
so a "+5 points over the best peer" goal can be read against the room there is.

A second, tighter reference, :func:`pooled_lru_hit_rate`: the same requests through ONE
LRU cache the size of the whole fleet's KV cache. The engines evict least recently
used blocks, and a router only chooses where each request goes; a router that split
the prefixes across engines perfectly (no prefix on two engines, no engine's cache
wasted) would make the fleet behave about like that pooled cache. It is not a strict
bound (an engine's blocks of running requests cannot be evicted, and a placement can
beat pooled LRU in corner cases), but it says how much any placement can still win.

Only for workloads whose sessions are single requests (shared-prefix, evictions,
flash-crowd): later turns of a conversation carry the engine's answers, which are
not known before the run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from fleetgate.router.scheduling.kvindex import block_keys
from fleetgate.router.scheduling.tokenize import Tokenizer, prompt_token_ids
from fleetgate_tools.bench.workloads import Session


def _requests(
    sessions: Sequence[Session], tokenizer: Tokenizer, block: int
) -> Iterator[tuple[float, int, list[int]]] | None:
    """(start, prompt tokens, chain keys of its whole blocks) in arrival order, or
    None when a session has more than one request or a prompt cannot be tokenized."""
    if any(len(s.turns) != 1 for s in sessions):
        return None
    out = []
    for s in sorted(sessions, key=lambda s: s.start_s):
        ids = prompt_token_ids({"messages": s.messages_for(0, [])}, tokenizer)
        if ids is None:
            return None
        out.append((s.start_s, len(ids), list(block_keys(ids, block))))
    return iter(out)


def hit_ceiling(
    sessions: Sequence[Session], warmup_s: float, tokenizer: Tokenizer, block: int = 16
) -> float | None:
    """The ceiling (0-1) over the requests starting at or after ``warmup_s``; None
    when a session has more than one request or nothing is steady."""
    return pooled_lru_hit_rate(sessions, warmup_s, tokenizer, None, block)


def pooled_lru_hit_rate(
    sessions: Sequence[Session],
    warmup_s: float,
    tokenizer: Tokenizer,
    capacity_blocks: int | None,
    block: int = 16,
) -> float | None:
    """The hit rate of one LRU cache of ``capacity_blocks`` blocks (None: unbounded,
    the ceiling); a request's blocks are used (hit or stored) when it arrives."""
    requests = _requests(sessions, tokenizer, block)
    if requests is None:
        return None
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for start, n_tokens, keys in requests:
        matched = 0
        for k in keys:
            if k not in lru:
                break
            matched += 1
        if start >= warmup_s:
            hit += matched * block
            total += n_tokens
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return hit / total if total else None
