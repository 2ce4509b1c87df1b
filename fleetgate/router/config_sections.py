"""The router configuration's sections for backends, scheduling, models, discovery and
KV events (``fleetgate.router.config`` puts them together in ``RouterConfig``; import
them from there). Polling and bounds (scrape, health, timeouts, limits) are in
``fleetgate.router.config_runtime``."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fleetgate.engines import UnknownEngineError, get_adapter
from fleetgate.engines.base import MAX_KV_RANKS, KvEventsEndpoint
from fleetgate.router.k8s_targets import KubernetesDiscoveryConfig
from fleetgate.router.served import EngineVersionError, check_version


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class BackendKvEvents(_Strict):
    """Where a static backend publishes its KV-cache events (``backends[].kv_events``).

    ``zmq`` (vLLM ``--kv-events-config``): PUB ``port`` and ROUTER ``replay_port`` on the
    backend URL's host, ``topic`` as configured on the engine (empty: every topic).
    ``http-drain`` (TensorRT-LLM): ``POST path`` on the backend URL.
    """

    transport: Literal["zmq", "http-drain"] = "zmq"
    port: int | None = Field(None, ge=1, le=65535)
    replay_port: int | None = Field(None, ge=1, le=65535)
    """Without it a gap cannot be replayed: the feed clears and goes ``partial``."""
    topic: str = ""
    path: str | None = None
    format: str | None = None
    """The decoder's name (informational; the backend's engine adapter decodes)."""
    ranks: int = Field(1, ge=1, le=MAX_KV_RANKS)
    """Attention-DP ranks, each with its own stream (``zmq``: rank r on ``port + r`` and
    ``replay_port + r``; ``http-drain``: every rank's events in one body)."""
    rank_choice: Literal["load", "cache"] = "load"
    """How the engine picks a rank: by load (a prefix counts as the mean over ranks) or
    by cached prefix (as the best rank's)."""

    @model_validator(mode="after")
    def _complete(self) -> BackendKvEvents:
        if self.transport == "zmq":
            if self.port is None:
                raise ValueError("transport zmq needs port")
            if self.path is not None:
                raise ValueError("path is for transport http-drain")
            if self.replay_port is not None and abs(self.replay_port - self.port) < self.ranks:
                raise ValueError(f"{self.ranks} ranks from port and replay_port overlap")
            if max(self.port, self.replay_port or 0) + self.ranks - 1 > 65535:
                raise ValueError(f"{self.ranks} ranks run past port 65535")
        else:
            if self.path is None or not self.path.startswith("/"):
                raise ValueError("transport http-drain needs path, e.g. /kv_cache_events")
            if self.port is not None or self.replay_port is not None:
                raise ValueError("http-drain uses the backend URL's port: no port/replay_port")
        return self

    def endpoint(self, engine: str) -> KvEventsEndpoint:
        return KvEventsEndpoint(
            transport=self.transport,
            format=self.format or engine,
            port=self.port,
            replay_port=self.replay_port,
            topic=self.topic,
            path=self.path,
            ranks=self.ranks,
            rank_choice=self.rank_choice,
        )


class Backend(_Strict):
    engine: str
    """``vllm`` or ``trtllm`` (any adapter name or alias)."""
    url: str
    name: str | None = None
    """Endpoint id in metrics and logs; defaults to ``host:port``."""
    metrics_source: str | None = None
    """Which of the adapter's ``metrics_sources`` to poll (default: its first)."""
    capacity: int | None = Field(None, ge=1)
    """Concurrent sequences (vLLM ``max_num_seqs``, TRT max batch size), used when the
    engine's metrics do not carry it (vLLM's do not)."""
    schedulers: int | None = Field(None, ge=1, le=MAX_KV_RANKS)
    """Schedulers the replica runs, each with its own requests and the concurrency limit
    its metrics report (TensorRT-LLM attention-DP ranks). Default: ``kv_events.ranks``,
    else 1."""
    version: str | None = None
    """Engine release, for engines whose request fields and metrics differ by release
    (TensorRT-LLM: ``1.0.0``, ``1.2.0rc3``, ``main``...; ``fleetgate.router.served``)."""
    served_model: str | None = Field(None, min_length=1)
    """The model name clients use, when the engine lists another (trtllm-serve lists
    its model path): shown by ``/v1/models`` and in answers in its place."""
    kv_events: BackendKvEvents | None = None
    """Where the engine publishes KV-cache events, for the exact prefix view (docs/router.md
    "Exact prefix view: KV events"). Absent: no subscriber for this backend."""

    @property
    def scheduler_count(self) -> int:
        """:attr:`schedulers`, defaulted."""
        if self.schedulers is not None:
            return self.schedulers
        return self.kv_events.ranks if self.kv_events is not None else 1

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        try:
            return get_adapter(value).name
        except UnknownEngineError as e:
            raise ValueError(str(e.args[0])) from None

    @field_validator("version")
    @classmethod
    def _supported_version(cls, value: str | None, info: ValidationInfo) -> str | None:
        engine = info.data.get("engine")
        if value is None or engine is None:
            return value
        try:
            return check_version(engine, value)
        except EngineVersionError as e:
            raise ValueError(str(e)) from None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {value!r}")
        return value.rstrip("/")

    @property
    def endpoint_id(self) -> str:
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class Pool(_Strict):
    name: str = "default"
    backends: tuple[Backend, ...] = ()


class Weights(_Strict):
    prefix: float = Field(3.0, ge=0)
    load: float = Field(2.0, ge=0)
    kv: float = Field(1.0, ge=0)
    speed: float = Field(1.0, ge=0)
    """``engine-speed`` scorer: urgent requests (priority > 0) to the fastest engines,
    batch (< 0) to the slower; neutral for priority 0 and homogeneous fleets
    (``scheduling.plugins.EngineSpeedScorer``; the default is justified on
    ``scheduling.pipeline.PipelineWeights``). 0 turns it off."""


class TokenizerSpec(_Strict):
    """Where one model's tokenizer comes from (``scheduling.tokenizers.<model>``).

    ``hf``: a directory holding the model's ``tokenizer.json`` and its chat template
    (``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``), read at
    start-up (``fleetgate.router.tokenizer_files``). ``emulator``: the emulator's own
    tokenizer, exactly what emulated engines compute (no files)."""

    kind: Literal["hf", "emulator"]
    path: str | None = None

    @model_validator(mode="after")
    def _path_for_hf(self) -> TokenizerSpec:
        if self.kind == "hf" and not self.path:
            raise ValueError("kind hf needs a path (the directory with tokenizer.json)")
        if self.kind == "emulator" and self.path:
            raise ValueError("kind emulator takes no path")
        return self


class Scheduling(_Strict):
    weights: Weights = Weights()
    picker: Literal["max-score", "round-robin"] = "max-score"
    """``max-score``: highest weighted score wins (seeded random tie-break).
    ``round-robin``: take turns over the endpoints the filters kept, ignoring
    scores and weights (``fleetgate.router.scheduling.plugins.RoundRobinPicker``).
    Same values as ``scheduling.plugins.PickerName`` (a test keeps them equal)."""
    seed: int = 0
    """Seed of the picker's tie-break random generator."""
    chunk_tokens: int = Field(32, ge=4)
    """Approximate prefix view: chunk size in ESTIMATED tokens (a regex pre-tokenizer
    counts words, digits and punctuation, ``scheduling.prefix``), so chunk boundaries
    follow tokens whatever the bytes per token of the text."""

    @model_validator(mode="before")
    @classmethod
    def _byte_chunks(cls, data: Any) -> Any:
        """The keys of byte-sized chunks (before ``chunk_tokens``) still load: a config
        that worked keeps working. ``chunk_bytes / bytes_per_token`` becomes
        ``chunk_tokens`` unless that is set too (then the old keys are ignored)."""
        if not isinstance(data, dict) or not ({"chunk_bytes", "bytes_per_token"} & data.keys()):
            return data
        data = dict(data)
        chunk_bytes = data.pop("chunk_bytes", 128)
        per_token = data.pop("bytes_per_token", 4.0)
        if "chunk_tokens" not in data:
            if not isinstance(chunk_bytes, int | float) or not isinstance(per_token, int | float):
                raise ValueError("chunk_bytes and bytes_per_token must be numbers")
            if per_token <= 0:
                raise ValueError("bytes_per_token must be > 0")
            data["chunk_tokens"] = max(4, round(chunk_bytes / per_token))
        return data

    tokenizers: dict[str, TokenizerSpec] = {}
    """Per served model: its tokenizer, so requests become the engine's token ids and
    are scored against the exact KV view (KV events) where an endpoint's feed is live.
    A model without one is scored by the approximate view only."""
    index_capacity: int = Field(65536, ge=1)
    """Chain hashes remembered per endpoint (LRU)."""
    cold_choices: int | Literal["all"] | None = None
    """Candidates for a prefix no endpoint holds (among those with the least prefill
    backlog, in rendezvous order); the least loaded wins (power of d choices). ``all``:
    every endpoint. 1: plain rendezvous, so router replicas that share no state put a
    new prefix on the same engine. Unset (default): ``all`` when ``router_replicas``
    is 1, else 1 (:meth:`effective_cold_choices`)."""
    router_replicas: int = Field(1, ge=1)
    """Router replicas sharing the traffic (the Helm chart sets it from
    ``router.replicas``). With more than one, new prefixes are placed by rendezvous so
    that replicas agree without sharing state."""
    load_bound: float | None = Field(None, ge=0)
    """Spill when an affinity target's work exceeds ``(1 + load_bound) x`` the pool mean.
    Unset (default): 1.0 when ``router_replicas`` is 1, else 0.25
    (:meth:`effective_load_bound`)."""
    load_bound_tokens: int | None = Field(1640, ge=1)
    """Hit-weighted load bound: an affinity target's bound is ``load_bound x min(1,
    saved / load_bound_tokens)``, ``saved`` being the prompt tokens its cache holds
    beyond the endpoint holding the least (what a spill would prefill again). A hot
    long document keeps its engine up to the full bound; a short conversation
    history spills near the mean. ``null``: ``load_bound`` for every prefix."""
    slack_requests: float = Field(2.0, ge=0)
    queue_work: float = Field(1.0, gt=0)
    queue_ratio: float | None = Field(1.5, ge=1)
    """No-queueing rule: affinity is dropped for a full batch (work >= ``queue_work``)
    only while another endpoint has a free slot AND at most ``1 / queue_ratio`` of its
    work. ``null``: any free slot elsewhere (the rule before 2026-12-02)."""
    prefill_slack: float | None = Field(0.25, ge=0)
    """Prefill-cost rule: affinity (or a rendezvous place) is kept only where the prompt
    tokens to prefill before this request's first token (the router's own backlog there
    plus this prompt's uncached part) are at most ``(1 + prefill_slack) x`` the cheapest
    endpoint's plus ``prefill_slack_tokens``. ``null`` turns the rule off. Unset: 0.25
    when ``router_replicas`` is 1, else off (:meth:`effective_prefill_slack`)."""
    prefill_slack_tokens: int = Field(512, ge=0)
    spill_prefill_weight: float = Field(1.0, ge=0)
    """Prefill-cost rule: an alternative's cost also counts the prompt tokens it would
    prefill beyond the endpoint holding the prefix (the duplicated work a spill adds),
    this many times (1 + prompts of this size queued for prefill there). 0: the rule
    before 2026-12-02."""
    held_prefix_sooner: bool = False
    """A request whose chosen endpoint is believed to hold at least half its prompt
    goes to that engine one priority level above its class (the engine's own
    ``priority`` field, where ``priority.engine_priority`` sends it): in a busy
    engine's waiting queue a conversation turn whose history is cached is admitted
    before requests that hold less, so it starts before running requests' growth
    evicts that history. Classes one level apart may then interleave."""
    held_prefix_guard_s: float | None = Field(None, gt=0)
    """With ``held_prefix_sooner``: an endpoint gets no raised request while one this
    router sent there at its own level has waited this many seconds for its first
    token (in an overload a stream of held requests would starve those that hold
    little). None: no guard."""
    default_capacity: int = Field(64, ge=1)
    """Concurrent sequences assumed when neither metrics nor the backend say."""
    default_max_tokens: int = Field(256, ge=1)
    """KV need assumed for requests that do not say ``max_tokens``."""
    fresh_for_s: float = Field(0.5, gt=0)
    stale_after_s: float = Field(3.0, gt=0)

    @field_validator("cold_choices")
    @classmethod
    def _positive_choices(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError("cold_choices must be >= 1, 'all', or unset")
        return v

    def effective_load_bound(self) -> float:
        """The affinity scorer's ``load_bound``.

        One router places every new prefix on the least loaded of the cheapest
        endpoints, so balance comes from placement and a hot prefix may stay put up
        to twice the mean load (a spill costs a second full prefill of it). Replicas
        place new prefixes by rendezvous, which does not balance, so the bound is
        tighter. docs/bench.md has the runs behind both figures.
        """
        if self.load_bound is not None:
            return self.load_bound
        return 1.0 if self.router_replicas == 1 else 0.25

    def effective_prefill_slack(self) -> float | None:
        """The scorer's ``prefill_slack``: as set, else 0.25 for one router and off
        with replicas.

        The rule weighs the prompt tokens this router itself has queued on each
        engine. Replicas each see only their own share, so for a new prefix they
        would pick different "least backlogged" engines and prefill it twice, where
        plain rendezvous (bounded by the shared load) puts it on one. Measured with
        KV events at 2 replicas (docs/bench.md): engine hit rate 44.1% with the
        rule, 47.3% without.
        """
        if "prefill_slack" in self.model_fields_set:
            return self.prefill_slack
        return 0.25 if self.router_replicas == 1 else None

    def effective_cold_choices(self) -> int | None:
        """The scorer's ``cold_choices``: a count, or None for every endpoint."""
        if self.cold_choices == "all":
            return None
        if self.cold_choices is None:
            return None if self.router_replicas == 1 else 1
        return self.cold_choices


class KvEventsSection(_Strict):
    """``kv_events:`` the KV-event subscribers and the exact index (docs/router.md)."""

    enabled: bool = True
    """False: no subscriber runs, whatever backends or discovery say."""
    max_blocks: int = Field(2_000_000, ge=1)
    """Bound of the exact index: (endpoint, block) entries over all endpoints; past it
    the biggest holder's least recently stored/matched entries are evicted."""
    drain_interval_s: float = Field(0.2, gt=0)
    """``http-drain`` (TensorRT-LLM): seconds between two ``POST``s."""
    replay_timeout_s: float = Field(2.0, gt=0)
    """Longest wait for a replay to end (and for one drain ``POST``)."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """A ZeroMQ feed not connected for this long is reported ``broken``."""
    retry_max_s: float = Field(10.0, gt=0)
    """Longest wait between retries of a broken feed (doubling from 0.25 s)."""
    idle_check_s: float = Field(5.0, gt=0)
    """A ZeroMQ feed silent this long asks a replay from its last batch: a lost last
    batch would otherwise show only at the next one (vLLM has no heartbeat)."""
    pending_ttl_s: float | None = Field(2.0, ge=0)
    """Blocks this router placed on an endpoint count as held there until its engine's
    ``BlockStored`` confirms them, or this long after the placing request's prefill is
    over (``scheduling/kvpending.py``). ``null``: no overlay (only confirmed blocks)."""
    pending_max_age_s: float = Field(600.0, gt=0)
    """... and never longer than this after the last placement."""
    pending_max_blocks: int = Field(65536, ge=1)
    """Pending blocks kept per endpoint (the oldest placed are dropped past it)."""


class ModelEntry(_Strict):
    """One entry of ``models:``: what the router knows of a model besides its backends."""

    scale_from_zero: bool = False
    """The model may have no backend at all (it is scaled to zero): its requests are
    held for a cold start instead of answered 503 at once."""
    cold_start_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Expected time from zero to a ready backend (default ``limits.default_cold_start_s``)."""
    pool: str = "default"


class Discovery(_Strict):
    kind: Literal["static", "kubernetes"] = "static"
    """``static``: only ``pools``; ``kubernetes``: also the engines the operator runs."""
    kubernetes: KubernetesDiscoveryConfig = KubernetesDiscoveryConfig()
    """Where to watch and what to select (used when ``kind`` is ``kubernetes``)."""
