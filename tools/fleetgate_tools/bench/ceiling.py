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

A third, :func:`ttft_quantile`: the TTFT each request would get alone on an idle engine,
prefilling what either cache above does not hold; its p90 says how far a TTFT goal
stated as a ratio to a peer can go before it asks for more hits than the cache has.

Conversations (chat-multiturn, agentic): a later turn carries the engine's earlier
answers. The emulator's output is a pure function of the prompt's token ids and the
seed (``fleetgate.sim.core.textgen``; the bench sends no seed, so 0, and fixed lengths),
so :func:`prompt_blocks` replays each conversation offline, turn by turn, and a turn
leaves its prompt's and its answer's blocks in the cache (the engine caches generated
tokens too; the next turn's prompt starts with them). A turn's arrival is estimated
(the session's start, the think times, and each earlier answer alone on an idle
engine), so the pooled LRU's order of use is approximate there; the ceiling does not
depend on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from fleetgate.router.scheduling.kvindex import block_keys
from fleetgate.router.scheduling.tokenize import Tokenizer, prompt_token_ids
from fleetgate.sim.core import textgen
from fleetgate.sim.core import tokenizer as sim_tokenizer
from fleetgate_tools.bench.workloads import Session

#: (arrival, prompt tokens, chain keys of the prompt's whole blocks, chain keys of the
#: whole blocks it leaves cached: the prompt's, and the answer's in a conversation), in
#: arrival order.
PromptBlocks = list[tuple[float, int, list[int], list[int]]]
#: (prompt tokens, tokens hit) of each steady request.
Hits = list[tuple[int, int]]
#: Modelled seconds of a turn alone on an idle engine: (prompt tokens, output tokens).
AnswerSeconds = Callable[[int, int], float]


def prompt_blocks(
    sessions: Sequence[Session],
    tokenizer: Tokenizer,
    block: int = 16,
    answer_seconds: AnswerSeconds | None = None,
) -> PromptBlocks | None:
    """Every request's blocks (tokenize once, then ask :func:`lru_hits` as often as
    needed), or None when a prompt cannot be tokenized, or a session has more than
    one turn and no ``answer_seconds`` to place its later turns in time."""
    multi = any(len(s.turns) != 1 for s in sessions)
    if multi and answer_seconds is None:
        return None
    out: PromptBlocks = []
    for s in sessions:
        if not multi:
            ids = prompt_token_ids({"messages": s.messages_for(0, [])}, tokenizer)
            if ids is None:
                return None
            keys = list(block_keys(ids, block))
            out.append((s.start_s, len(ids), keys, keys))
            continue
        assert answer_seconds is not None
        replayed = _replay(s, tokenizer, block, answer_seconds)
        if replayed is None:
            return None
        out += replayed
    out.sort(key=lambda r: r[0])
    return out


def _replay(
    s: Session, tokenizer: Tokenizer, block: int, answer_seconds: AnswerSeconds
) -> PromptBlocks | None:
    """One conversation's turns as the emulator answers them (seed 0, no stop tokens)."""
    answers: list[str] = []
    out: PromptBlocks = []
    t = s.start_s
    for k, turn in enumerate(s.turns):
        ids = prompt_token_ids({"messages": s.messages_for(k, answers)}, tokenizer)
        if ids is None:
            return None
        t += turn.think_s
        output, _ = textgen.generate(
            ids, seed=0, max_tokens=turn.max_tokens, ignore_eos=s.ignore_eos
        )
        # the last sampled token is never fed back, so never cached
        cached = ids + output[:-1]
        out.append((t, len(ids), list(block_keys(ids, block)), list(block_keys(cached, block))))
        answers.append(sim_tokenizer.decode(output))
        t += answer_seconds(len(ids), len(output))
    return out


def lru_hits(
    requests: PromptBlocks, warmup_s: float, capacity_blocks: int | None, block: int = 16
) -> Hits:
    """(prompt tokens, tokens hit) of each request starting at or after ``warmup_s``
    through one LRU cache of ``capacity_blocks`` blocks (None: unbounded); a
    request's blocks are used (hit or stored) when it arrives."""
    lru: OrderedDict[int, None] = OrderedDict()
    out: Hits = []
    for start, n_tokens, keys, stored in requests:
        matched = 0
        for k in keys:
            if k not in lru:
                break
            matched += 1
        if start >= warmup_s:
            out.append((n_tokens, matched * block))
        # tail first, as vLLM's free queue takes a finished request's blocks (and
        # the emulator's): a chain loses its end before its start, which later
        # prompts may still share
        for k in reversed(stored):
            lru[k] = None
            lru.move_to_end(k)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return out


def hit_rate(hits: Hits) -> float | None:
    """Tokens hit over prompt tokens (None: no steady request)."""
    total = sum(n for n, _ in hits)
    return sum(h for _, h in hits) / total if total else None


def ttft_quantile(
    hits: Hits, prefill_seconds: Callable[[int, int], float], quantile: float = 0.9
) -> float | None:
    """The ``quantile`` of the unloaded TTFTs: each prompt alone on an idle engine,
    ``prefill_seconds(uncached, cached)`` (e.g. the emulator profile's
    :meth:`~fleetgate.sim.core.timing.Profile.lone_prefill_seconds`).

    With :func:`lru_hits` unbounded no router on this fleet goes below it (the
    ceiling's hits, no queue, no batch to share a step with). With the fleet's
    capacity it is the pooled-LRU reference's TTFT: what a perfect split of the
    prefixes would give with every engine idle; a TTFT goal under it asks the
    placement to beat LRU itself.
    """
    if not hits:
        return None
    times = sorted(prefill_seconds(n - h, h) for n, h in hits)
    return times[min(len(times) - 1, int(quantile * len(times)))]


def hit_ceiling(
    sessions: Sequence[Session], warmup_s: float, tokenizer: Tokenizer, block: int = 16
) -> float | None:
    """The ceiling (0-1) over the requests starting at or after ``warmup_s``; None
    when a session has more than one request (conversations need an answer-time model:
    :func:`prompt_blocks` with ``answer_seconds``) or nothing is steady."""
    return pooled_lru_hit_rate(sessions, warmup_s, tokenizer, None, block)


def pooled_lru_hit_rate(
    sessions: Sequence[Session],
    warmup_s: float,
    tokenizer: Tokenizer,
    capacity_blocks: int | None,
    block: int = 16,
) -> float | None:
    """The hit rate of one LRU cache of ``capacity_blocks`` blocks (None: unbounded,
    the ceiling)."""
    requests = prompt_blocks(sessions, tokenizer, block)
    return (
        None if requests is None else hit_rate(lru_hits(requests, warmup_s, capacity_blocks, block))
    )
