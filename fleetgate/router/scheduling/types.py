"""Plain data the scheduling pipeline reads: endpoints, the request, the decision.

Everything here is a frozen dataclass built by the HTTP layer once per request
(``fleetgate.router.state``) and handed to the pure pipeline
(``fleetgate.router.scheduling.pipeline``). Plugins never see mutable router
state, so a plugin is a function of its inputs and is unit-tested on plain
values (the Gateway API Inference Extension keeps plugin logic apart from state
the same way).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NewType

EndpointId = NewType("EndpointId", str)

#: Why the winner won, as exported in ``fleetgate_decisions_total{reason}``.
DecisionReason = Literal["affinity-hit", "spill", "cold", "fallback", "single"]

#: Which view said what an endpoint holds: ``events`` (the exact KV index, fed by the
#: engine's KV events, its feed live) or ``approximate`` (the router's prefix index).
CacheSource = Literal["events", "approximate"]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadEstimate:
    """The load the scorers use: last scrape + the router's own traffic since.

    All "work" figures are normalised by the engine's concurrent-sequence
    capacity so that vLLM and TensorRT-LLM compare fairly: ``work`` 1.0 means
    one full batch of requests in the engine (running + waiting + paused).
    """

    requests: float
    """Estimated requests inside the engine (running + waiting + paused)."""
    capacity: int
    """Concurrent sequences the engine runs at once (max_num_seqs / batch size)."""
    work: float
    """``requests / capacity`` blended towards pessimism as confidence falls."""
    kv_fraction: float
    """Estimated fraction of KV blocks in use, 0..1, pessimistic when stale."""
    free_kv_tokens: int | None
    """Estimated KV tokens left (None when the engine does not report blocks)."""
    total_kv_tokens: int | None
    """KV capacity in tokens (None when the engine does not report blocks)."""
    block_size: int
    confidence: float
    """1.0 for a fresh scrape, falling to 0.0 as the scrape ages or fails."""
    age: float
    """Seconds since the last successful scrape (inf when there was none)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointView:
    """One endpoint as the pipeline sees it at decision time."""

    id: EndpointId
    engine: str
    models: frozenset[str]
    healthy: bool
    ejected: bool
    load: LoadEstimate
    max_model_len: int | None = None
    prefix_match: int = 0
    """Leading prompt chunks this endpoint is believed to hold (approximate prefix index)."""
    exact_cached_tokens: int | None = None
    """Leading prompt tokens resident on this endpoint by the exact KV index (whole
    blocks x block size); None = no exact view for it (no tokenizer for the model, no
    index, or this endpoint's event feed is not live): ``prefix_match`` is used."""
    rendezvous_rank: int = 0
    """Position of this endpoint in the rendezvous order of the prompt's first chunk."""
    decode_s_per_token: float | None = None
    """Smoothed decode speed learned from scrapes (``scheduling.speed``); None = unknown."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens this router sent here that have no first token yet: the
    prefill work queued ahead of a new request on this engine (router-own count)."""
    draining: bool = False
    """Marked for removal (the pod's ``fleetgate.dev/drain`` annotation): its in-flight
    requests finish, no new work (the ``not-draining`` filter)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RequestView:
    """What the pipeline knows about one request (no body, no tokens)."""

    model: str
    chunks: int
    """Number of whole prompt chunks (prefix-index granularity)."""
    prompt_tokens: int
    """Prompt length in tokens: exact when the request was tokenized, else estimated
    (the approximate view's pre-tokenizer)."""
    max_tokens: int
    """Tokens the request may generate (its KV need beyond the prompt)."""
    priority: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ScoredEndpoint:
    id: EndpointId
    total: float
    scores: tuple[tuple[str, float], ...]
    """(scorer name, raw score in [0, 1]) before weighting."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one scheduling cycle."""

    ranking: tuple[EndpointId, ...]
    """Endpoints in preference order; the first is the pick, the rest are retry targets."""
    reason: DecisionReason
    decided_by: str
    """The plugin that made the call: ``filter:<n>``, ``scorer:<n>``, ``picker:tie-break``
    (max-score, equal totals) or ``picker:round-robin``."""
    scored: tuple[ScoredEndpoint, ...] = ()
    filtered_out: tuple[tuple[str, EndpointId], ...] = ()
    """(filter name, endpoint) for every endpoint a filter removed."""
    predicted_cached_chunks: int = 0
    """Prefix chunks the pick is believed to hold for this prompt (approximate view)."""
    predicted_cached_tokens: int = 0
    """Prompt tokens the pick is believed to hold, by the view that applies to it."""
    cache_source: CacheSource = "approximate"
    """The view that gave :attr:`predicted_cached_tokens` for the pick."""

    @property
    def pick(self) -> EndpointId:
        return self.ranking[0]
