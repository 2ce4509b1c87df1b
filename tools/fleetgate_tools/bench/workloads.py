"""Seeded, reproducible benchmark workloads (pure: no I/O, no clock).

A workload is a list of :class:`Session` objects. A session is a closed loop of
turns: turn k+1 is sent ``think_s`` after turn k's answer arrived and carries
the real answer in its history, as a chat client or an agent would. A
single-shot request is a one-turn session. Arrival times of sessions follow a
seeded Poisson process (optionally with bursts), so every contender sees the
identical schedule.

Workloads and what they imitate:

``chat-multiturn``
    ShareGPT-like conversations. Lengths are drawn from log-normal fits whose
    means follow the figures the vLLM paper reports for ShareGPT (Kwon et al.,
    SOSP 2023, section 6: mean input about 161 tokens, mean output about 338),
    scaled by ``scale``; 2-6 turns each; every conversation opens with one of a
    handful of shared system prompts (as deployed assistants do).
``shared-prefix``
    Groups of questions over long shared documents, like the shared-prefix data
    set of inference-perf / the llm-d prefix-cache benchmarks: many groups, a few
    questions each, prefixes of thousands of tokens. The documents are a pool sized on
    :data:`SHARED_PREFIX_POOL_S` of arrivals, so runs longer than that reach a steady
    working set.
``agentic``
    Tool-calling loops whose context grows every call: each call appends the
    model's answer and a tool result to the history.
``priority-storm``
    Interactive ``critical`` chat plus ``batch`` traffic at about 1.5x fleet
    capacity, with bursts of critical requests.
``mixed-traffic``
    ``standard`` chat-multiturn plus a priority storm at once.
``flood``
    What ``fleetgate demo`` shows: a ``batch`` flood sized from the fleet's
    concurrent-sequence capacity (``slots``), so that it saturates the fleet at
    any duration, ``critical`` requests in bursts through it and ``standard``
    multi-turn chat over shared system prompts.
``evictions``
    Questions over more long documents than the fleet can cache: the distinct
    document tokens (the working set) are :data:`EVICTION_WORKING_SET` times the
    fleet's KV cache (``cache_tokens``), and document popularity is Zipf-like, so
    engines keep evicting prefixes and a router's memory of where a document went
    goes stale.
``flash-crowd``
    One long hot document and a burst of hundreds of questions on it (at least
    :data:`FLASH_MIN_BURST`, or one per concurrent-sequence slot of the fleet)
    arriving within :data:`FLASH_WINDOW_S`, over light shared-prefix background
    traffic (``rate``).

Text is built from a fixed word list so that one word is about one token for the
emulator's tokenizer; ``tokens`` below means those words.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can what about out up some them other into than its time only could "
    "new these two may first then do any like my now over such our man me even most made "
    "after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three cache block token router engine prefix queue batch stream model fleet node "
    "memory kernel tensor latency throughput priority request response schedule decode"
).split()


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session: the new user (or tool) content and limits."""

    content: str
    max_tokens: int
    role: str = "user"
    think_s: float = 0.0
    """Pause after the previous turn's answer before sending this one."""


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    start_s: float
    system: str | None
    turns: tuple[Turn, ...]
    priority_class: str | None = None
    tenant: str | None = None
    ignore_eos: bool = True
    """Fixed output lengths make contenders comparable token for token."""

    def messages_for(self, turn_index: int, answers: list[str]) -> list[dict[str, Any]]:
        """The chat history sent for ``turn_index``, given the answers so far."""
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        for i in range(turn_index + 1):
            t = self.turns[i]
            messages.append({"role": t.role, "content": t.content})
            if i < turn_index:
                messages.append({"role": "assistant", "content": answers[i]})
        return messages


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadParams:
    duration_s: float = 60.0
    rate: float = 4.0
    """Mean session arrivals per second."""
    scale: float = 1.0
    """Multiplies token lengths (use < 1 for small emulated fleets)."""
    seed: int = 0
    slots: int = 0
    """Concurrent sequences of the whole fleet (sum of the engines' slot limits);
    workloads sized from capacity (``flood``) use it, 0 means 32."""
    cache_tokens: int = 0
    """KV-cache tokens of the whole fleet (sum of blocks x block size); ``evictions``
    sizes its working set from it, 0 means 32768."""


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    return int(min(hi, max(lo, rng.lognormvariate(mu, sigma))))


def _arrivals(
    rng: random.Random,
    rate: float,
    duration: float,
    bursts: tuple[tuple[float, float, float], ...] = (),
) -> list[float]:
    """Poisson arrivals; ``bursts`` = (start, length, rate multiplier)."""
    times: list[float] = []
    t = 0.0
    peak = rate * max([1.0, *(m for _, _, m in bursts)])
    while True:
        t += rng.expovariate(peak)  # thinning
        if t >= duration:
            return times
        local = rate
        for start, length, mult in bursts:
            if start <= t < start + length:
                local = rate * mult
        if rng.random() < local / peak:
            times.append(t)


def chat_multiturn(p: WorkloadParams) -> list[Session]:
    rng = random.Random(p.seed)
    systems = [_text(random.Random(p.seed * 1000 + i), int(400 * p.scale)) for i in range(4)]
    sessions = []
    for i, t0 in enumerate(_arrivals(rng, p.rate, p.duration_s)):
        turns = tuple(
            Turn(
                content=_text(rng, _lognormal(rng, 161 * p.scale, 0.8, 4, int(1024 * p.scale))),
                max_tokens=_lognormal(rng, 338 * p.scale, 0.7, 4, int(1024 * p.scale)),
                think_s=0.0 if k == 0 else rng.uniform(0.5, 3.0),
            )
            for k in range(rng.randint(2, 6))
        )
        sessions.append(Session(f"chat-{i}", t0, rng.choice(systems), turns))
    return sessions


SHARED_PREFIX_POOL_S = 16.0
"""``shared-prefix`` draws its documents from a pool of about four questions per document
over this many modelled seconds of arrivals. A longer run reuses the pool, so its working
set stops growing: the pool sized on the whole run made a 60-second run's documents
outgrow the fleet's cache (one LRU cache the size of the fleet's held 22.8% against
76.2% over 16 s, bench/results/shared-prefix-16-60s-00874af.md), a workload that never
reaches a steady state. Runs of at most 16 s keep their documents."""


def shared_prefix_groups(p: WorkloadParams) -> int:
    """Documents in a ``shared-prefix`` run (:data:`SHARED_PREFIX_POOL_S`)."""
    return max(4, int(p.rate * min(p.duration_s, SHARED_PREFIX_POOL_S) / 4))


def shared_prefix(p: WorkloadParams) -> list[Session]:
    rng = random.Random(p.seed)
    groups = shared_prefix_groups(p)
    docs = [_text(random.Random(p.seed * 7919 + g), int(3000 * p.scale)) for g in range(groups)]
    sessions = []
    for i, t0 in enumerate(_arrivals(rng, p.rate, p.duration_s)):
        g = rng.randrange(groups)
        question = _text(rng, int(rng.uniform(40, 120) * p.scale))
        turn = Turn(content=f"{docs[g]}\n\nQuestion: {question}", max_tokens=int(120 * p.scale) + 4)
        sessions.append(Session(f"doc{g}-q{i}", t0, None, (turn,)))
    return sessions


def agentic(p: WorkloadParams) -> list[Session]:
    rng = random.Random(p.seed)
    tools = _text(random.Random(p.seed + 17), int(800 * p.scale))
    sessions = []
    for i, t0 in enumerate(_arrivals(rng, p.rate, p.duration_s)):
        calls = rng.randint(3, 8)
        turns = [Turn(content=_text(rng, int(150 * p.scale)), max_tokens=int(60 * p.scale) + 4)]
        for _ in range(calls - 1):
            turns.append(
                Turn(
                    content="tool result: " + _text(rng, int(rng.uniform(80, 400) * p.scale)),
                    max_tokens=int(60 * p.scale) + 4,
                    role="user",
                    think_s=rng.uniform(0.05, 0.3),
                )
            )
        sessions.append(
            Session(f"agent-{i}", t0, "You are an agent. Tools: " + tools, tuple(turns))
        )
    return sessions


def priority_storm(p: WorkloadParams) -> list[Session]:
    """Critical interactive chat plus a batch flood; ``rate`` is the batch rate."""
    rng = random.Random(p.seed)
    system = _text(random.Random(p.seed + 5), int(200 * p.scale))
    sessions = []
    for i, t0 in enumerate(_arrivals(rng, p.rate, p.duration_s)):
        turn = Turn(
            content=_text(rng, int(rng.uniform(200, 600) * p.scale)),
            max_tokens=int(300 * p.scale) + 4,
        )
        sessions.append(
            Session(f"batch-{i}", t0, None, (turn,), priority_class="batch", tenant=f"t{i % 3}")
        )
    bursts = tuple((s, p.duration_s / 10, 4.0) for s in (p.duration_s * 0.3, p.duration_s * 0.7))
    for i, t0 in enumerate(_arrivals(rng, p.rate / 4, p.duration_s, bursts)):
        turn = Turn(
            content=_text(rng, int(rng.uniform(40, 160) * p.scale)),
            max_tokens=int(64 * p.scale) + 4,
        )
        sessions.append(Session(f"crit-{i}", t0, system, (turn,), priority_class="critical"))
    sessions.sort(key=lambda s: s.start_s)
    return sessions


def mixed_traffic(p: WorkloadParams) -> list[Session]:
    """What a shared fleet serves at once (the demo): ``standard`` multi-turn chat
    at half of ``rate`` plus a priority storm (``critical`` + ``batch``) at the other half."""
    half = dataclasses.replace(p, rate=p.rate / 2)
    chat = chat_multiturn(half)
    storm = priority_storm(dataclasses.replace(half, seed=p.seed + 1))
    return sorted(
        [dataclasses.replace(s, priority_class="standard") for s in chat] + storm,
        key=lambda s: s.start_s,
    )


#: ``flood``: batch requests decode this many tokens: about 1 modelled second on a
#: vLLM Llama-8B/H100 engine at 8 sequences (6.4 ms per step), 0.75 s on TensorRT-LLM.
FLOOD_BATCH_TOKENS = 160
#: ``flood``: a slot frees about every BATCH_ROUND_S / slots seconds under the flood.
FLOOD_BATCH_ROUND_S = 0.9


def flood(p: WorkloadParams) -> list[Session]:
    """A batch flood sized from the fleet's capacity, critical bursts through it,
    and multi-turn chat (``fleetgate demo``); ``duration_s`` is modelled seconds.

    The flood does not wait for a long run to build up: ``2 x slots`` batch requests
    arrive in the first 5% of the run (every slot busy and about one more request
    queued per slot, so a class-blind engine queue makes a new request wait about
    one batch request's decode time, longer than the critical objective), then
    batch keeps arriving at about 0.45 x what the fleet completes until 65% of the
    run, while critical and standard traffic also take slots. Critical requests
    (short, over one shared system prompt) arrive from 5% to 70% of the run, 40%
    of them in two bursts. Standard chat sessions (3-5 turns, their history
    re-sent, over 3 shared system prompts) start in the first 60%: the part of the
    prompt an engine may already hold. ``rate`` is not used: every count follows
    from ``slots`` and ``duration_s``.
    """
    rng = random.Random(p.seed)
    slots = p.slots or 32
    d = p.duration_s
    sessions: list[Session] = []
    n_front = 2 * slots
    n_steady = round(0.45 * slots / FLOOD_BATCH_ROUND_S * 0.6 * d)
    starts = sorted(
        [rng.uniform(0.0, 0.05 * d) for _ in range(n_front)]
        + [rng.uniform(0.05 * d, 0.65 * d) for _ in range(n_steady)]
    )
    for i, t0 in enumerate(starts):
        turn = Turn(content=_text(rng, rng.randint(200, 600)), max_tokens=FLOOD_BATCH_TOKENS)
        sessions.append(
            Session(f"batch-{i}", t0, None, (turn,), priority_class="batch", tenant=f"t{i % 3}")
        )
    crit_system = _text(random.Random(p.seed + 5), 200)
    n_crit = max(16, round(0.4 * slots * d))
    n_burst = round(0.2 * n_crit)
    starts = sorted(
        [rng.uniform(0.05 * d, 0.7 * d) for _ in range(n_crit - 2 * n_burst)]
        + [rng.uniform(0.25 * d, 0.29 * d) for _ in range(n_burst)]
        + [rng.uniform(0.5 * d, 0.54 * d) for _ in range(n_burst)]
    )
    for i, t0 in enumerate(starts):
        turn = Turn(content=_text(rng, rng.randint(40, 160)), max_tokens=rng.randint(32, 64))
        sessions.append(Session(f"crit-{i}", t0, crit_system, (turn,), priority_class="critical"))
    systems = [_text(random.Random(p.seed * 1000 + 11 + i), 300) for i in range(3)]
    for i in range(max(6, round(0.1 * slots * d))):
        turns = tuple(
            Turn(
                content=_text(rng, rng.randint(30, 120)),
                max_tokens=rng.randint(32, 96),
                think_s=0.0 if k == 0 else rng.uniform(0.1, 0.4),
            )
            for k in range(rng.randint(3, 5))
        )
        sessions.append(
            Session(
                f"chat-{i}",
                rng.uniform(0.0, 0.6 * d),
                rng.choice(systems),
                turns,
                priority_class="standard",
            )
        )
    sessions.sort(key=lambda s: s.start_s)
    return sessions


#: ``evictions``: distinct document tokens / fleet KV-cache tokens.
EVICTION_WORKING_SET = 2.5
#: ``evictions``: words per document (times ``scale``).
EVICTION_DOC_TOKENS = 1500
#: ``evictions``: Zipf exponent of document popularity (0 = uniform).
EVICTION_ZIPF = 0.8


def eviction_documents(p: WorkloadParams) -> tuple[int, int]:
    """(number of documents, tokens per document) of ``evictions``: the working set
    is :data:`EVICTION_WORKING_SET` x ``cache_tokens``."""
    doc = max(16, int(EVICTION_DOC_TOKENS * p.scale))
    cache = p.cache_tokens or 32768
    return max(4, math.ceil(EVICTION_WORKING_SET * cache / doc)), doc


def evictions(p: WorkloadParams) -> list[Session]:
    """One question per session over Zipf-popular documents that do not all fit."""
    rng = random.Random(p.seed)
    groups, doc_tokens = eviction_documents(p)
    weights = [1.0 / (g + 1) ** EVICTION_ZIPF for g in range(groups)]
    # popularity rank is not document order: the hot documents are spread over the ids
    order = list(range(groups))
    random.Random(p.seed + 31).shuffle(order)
    docs = [_text(random.Random(p.seed * 7919 + 101 + g), doc_tokens) for g in range(groups)]
    sessions = []
    for i, t0 in enumerate(_arrivals(rng, p.rate, p.duration_s)):
        g = order[rng.choices(range(groups), weights)[0]]
        question = _text(rng, int(rng.uniform(20, 80) * p.scale))
        turn = Turn(content=f"{docs[g]}\n\nQuestion: {question}", max_tokens=int(64 * p.scale) + 4)
        sessions.append(Session(f"doc{g}-q{i}", t0, None, (turn,)))
    return sessions


#: ``flash-crowd``: words of the hot document (times ``scale``).
FLASH_DOC_TOKENS = 6000
#: ``flash-crowd``: the fewest questions in the burst.
FLASH_MIN_BURST = 200
#: ``flash-crowd``: modelled seconds over which the burst arrives.
FLASH_WINDOW_S = 0.5
#: ``flash-crowd``: the burst starts at this fraction of the run (after a 10% warm-up).
FLASH_AT = 0.3


def flash_burst(p: WorkloadParams) -> tuple[int, float, float]:
    """(questions, start, end) of the ``flash-crowd`` burst, in modelled seconds."""
    n = max(FLASH_MIN_BURST, p.slots)
    start = FLASH_AT * p.duration_s
    return n, start, min(p.duration_s, start + FLASH_WINDOW_S)


def flash_crowd(p: WorkloadParams) -> list[Session]:
    """Background shared-prefix questions at ``rate`` and a burst on one hot document."""
    rng = random.Random(p.seed)
    background = shared_prefix(dataclasses.replace(p, seed=p.seed + 1))
    hot = _text(random.Random(p.seed * 7919 + 977), int(FLASH_DOC_TOKENS * p.scale))
    n, start, end = flash_burst(p)
    crowd = []
    for i, t0 in enumerate(sorted(rng.uniform(start, end) for _ in range(n))):
        question = _text(rng, int(rng.uniform(20, 60) * p.scale))
        turn = Turn(content=f"{hot}\n\nQuestion: {question}", max_tokens=int(64 * p.scale) + 4)
        crowd.append(Session(f"hot-q{i}", t0, None, (turn,)))
    return sorted(background + crowd, key=lambda s: s.start_s)


WORKLOADS: dict[str, Callable[[WorkloadParams], list[Session]]] = {
    "chat-multiturn": chat_multiturn,
    "shared-prefix": shared_prefix,
    "agentic": agentic,
    "priority-storm": priority_storm,
    "mixed-traffic": mixed_traffic,
    "flood": flood,
    "evictions": evictions,
    "flash-crowd": flash_crowd,
}


def build(name: str, params: WorkloadParams) -> list[Session]:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    return factory(params)
