"""The one interface every engine adapter implements, and the types it speaks.

Everything engine-specific (metric names and parsing, priority fields, error
shapes, container arguments, probes, volumes) lives behind :class:`EngineAdapter`.
The router, the operator and the emulator only ever talk to this Protocol, so
adding an engine (SGLang, say) means adding one module to ``fleetgate/engines/``
that defines a module-level ``ADAPTER``; the registry in
``fleetgate/engines/__init__.py`` finds it.

Pure: no I/O, no clock reads (times are passed in), no HTTP library imports.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel

#: fleetgate priority levels are integers in [LEVEL_MIN, LEVEL_MAX]; higher is
#: more urgent and 0 is the default ("standard"). Each adapter maps a level to
#: its engine's own field and direction.
LEVEL_MIN = -10
LEVEL_MAX = 10


class EngineError(Exception):
    """Base of the errors raised by adapters (bad exposition, bad settings)."""


class EngineVersionError(EngineError):
    """The engine release of a service cannot be determined or is not supported."""


class MetricsParseError(EngineError):
    """A metrics body could not be parsed; the scrape counts as failed, never as idle."""


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsSource:
    """One place an engine publishes load.

    ``drains`` is True when reading removes data (trtllm-serve's JSON
    ``/metrics``): exactly one poller may read such a source per engine.
    """

    name: str
    path: str
    format: Literal["prometheus", "json"]
    drains: bool = False
    port: int | None = None
    """A port of its own (Triton serves metrics on 8002); None = the engine's HTTP port."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """One scrape of one engine, normalised across engines.

    ``None`` always means *unknown*, never zero: a field the source does not
    carry stays ``None`` so that a scorer can tell "idle" from "not reported".
    Counters are cumulative since engine start (in tokens where named so).
    """

    scraped_at: float
    """Injected clock time (seconds) at which the scrape completed."""
    kv_usage: float | None = None
    """Fraction of KV blocks in use, 0..1."""
    running: int | None = None
    waiting: int | None = None
    paused: int | None = None
    """Requests paused for lack of KV (TensorRT-LLM MAX_UTILIZATION)."""
    prefix_query_tokens: float | None = None
    prefix_hit_tokens: float | None = None
    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    block_size: int | None = None
    """Tokens per KV block (vLLM 16 on GPU / 128 on CPU; TensorRT-LLM 32)."""
    blocks_total: int | None = None
    """KV blocks, as the engine reports them: like :attr:`max_running`, one scheduler's
    pool (TensorRT-LLM attention DP: rank 0's; each rank has one of the same size)."""
    blocks_free: int | None = None
    max_running: int | None = None
    """The engine's concurrent-sequence limit (max_num_seqs / max batch size) as it
    reports it: one scheduler's, so a replica of several (``EngineAdapter.schedulers``,
    TensorRT-LLM's attention-DP ranks) holds this times their number."""
    decode_seconds_sum: float | None = None
    """Cumulative sum of observed decode latencies, each in seconds per output token
    (a latency histogram's ``_sum``). With :attr:`decode_observations` it gives the
    engine's mean decode speed over any interval: ``delta sum / delta observations``.
    What one observation is depends on the engine (the adapter's docstring says):
    one inter-token gap (vLLM), or one finished request's mean time per output
    token (TensorRT-LLM's Prometheus histogram)."""
    decode_observations: float | None = None
    """Cumulative number of observations behind :attr:`decode_seconds_sum` (``_count``)."""
    models: tuple[str, ...] = ()
    source: str = ""
    """Name of the :class:`MetricsSource` this came from."""

    @property
    def total_kv_tokens(self) -> int | None:
        """The KV pool in tokens, when blocks and block size are known (and non-zero)."""
        if not self.blocks_total or not self.block_size:
            return None
        return self.blocks_total * self.block_size

    @property
    def free_kv_tokens(self) -> int | None:
        """KV capacity left, in tokens, when blocks and block size are known."""
        if self.blocks_total is None or self.block_size is None:
            return None
        if self.blocks_free is not None:
            return self.blocks_free * self.block_size
        if self.kv_usage is None:
            return None
        return int((1.0 - self.kv_usage) * self.blocks_total) * self.block_size


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An engine's error response, understood.

    ``kind``: ``overload`` (engine full: try another endpoint or queue),
    ``client`` (the request is bad: pass through unchanged), ``server``
    (engine fault: may retry elsewhere before any byte reached the client).
    """

    status: int
    kind: Literal["overload", "client", "server"]
    message: str
    type: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """An HTTP GET probe on the engine's port."""

    path: str
    port_name: str = "http"


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Engine-neutral facts the operator knows about one engine replica."""

    model_path: str
    """Where the weights are inside the container (or a hub id the engine resolves)."""
    served_model_name: str
    port: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    settings: BaseModel | None = None
    """The adapter's own typed settings (``adapter.settings_model``); None = defaults."""
    extra_args: tuple[str, ...] = ()
    revision: str | None = None
    image: str | None = None
    """The engine container image; adapters whose flags differ by release read the
    release from its tag."""
    engine_version: str | None = None
    """The engine release the image runs (``spec.engine.version``); wins over the tag."""


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerPlan:
    """What an engine container needs; the operator turns it into a pod spec."""

    command: tuple[str, ...]
    args: tuple[str, ...]
    port: int
    startup_probe: Probe
    readiness_probe: Probe
    liveness_probe: Probe
    metrics_path: str
    needs_shared_memory: bool = True
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    config_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """File name -> content, mounted from a ConfigMap at ``config_mount_path``."""
    config_mount_path: str = "/etc/fleetgate"
    kv_events: KvEventsEndpoint | None = None
    """Where the replica publishes KV-cache events; None = events off."""
    engine_version: str | None = None
    """The engine release line the plan was written for (e.g. TensorRT-LLM ``1.0``), for
    adapters whose flags differ by release; published to the router as an annotation."""


class KvEventsDecodeError(EngineError):
    """A KV-cache event message could not be decoded; the subscriber drops it and
    treats the stream as broken (a gap), never as "nothing changed"."""


BlockHash = int | bytes
"""An engine's block hash as it publishes it (vLLM: 64-bit int by default, bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; TensorRT-LLM: int, signed 64-bit on its ZeroMQ
stream)."""


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became resident (and matchable) in an engine's prefix cache.

    ``block_hashes`` chain: the first one's parent is ``parent_hash`` (None = the
    start of a sequence), each next one's parent is the one before it.
    ``token_ids`` are the tokens of all the blocks, in order; a full block holds
    ``block_size`` of them (vLLM can also report one partial block, whose
    ``block_size`` is then its token count).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    """Where the blocks live: ``GPU`` (vLLM's default, TensorRT-LLM cache level 0),
    ``CPU`` (offloaded / secondary), ``STORAGE``; None = not said."""
    lora_name: str | None = None
    group: int | None = None
    """KV-cache group (vLLM ``group_idx``) or attention window (TensorRT-LLM)."""
    spec_kind: str | None = None
    """The group's attention kind (vLLM ``kv_cache_spec_kind``, e.g. ``full_attention``;
    a sliding-window group's blocks do not make a reusable prefix)."""
    cache_salt: str | None = None
    """The request's cache salt (vLLM ``cache_salt``), hashed into the first block of
    its sequence and so into every block chained from it; only set on an event whose
    ``parent_hash`` is None."""


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer resident in ``medium`` (evicted or replaced)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Everything the engine had cached is gone (prefix-cache reset, or a new cache)."""

    medium: str | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One published batch of KV events, in engine order.

    ``seq`` is the publisher's sequence number (vLLM and TensorRT-LLM's streaming
    publisher: the ZeroMQ frame, 0, 1, 2 ... per publisher start; TensorRT-LLM's HTTP
    drain: the ``event_id``); a subscriber that
    sees ``seq`` jump has missed batches and asks for a replay. ``ts`` is the
    engine's wall-clock time (seconds) when known.
    """

    seq: int | None
    events: tuple[KvEvent, ...]
    ts: float | None = None
    data_parallel_rank: int | None = None


#: Most attention-DP ranks one replica may publish events from (``parallelism.tensor``'s
#: own bound in the CRD).
MAX_KV_RANKS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class KvEventsEndpoint:
    """Where and how one engine replica publishes KV events (what discovery needs).

    ``transport``: ``zmq`` (a ZeroMQ PUB socket on ``port``, ``topic`` prefix, a
    ROUTER replay socket on ``replay_port``) or ``http-drain`` (``POST`` on the
    engine's HTTP port at ``path``; reading removes the events, so one reader only).
    ``format`` names the decoder, i.e. the adapter that wrote it.

    ``ranks`` > 1: the replica is several attention-data-parallel ranks, each with its
    own KV cache and its own event stream (``seq`` counted per rank). ``zmq``: rank
    ``r`` binds ``port + r`` and ``replay_port + r``; ``http-drain``: one body holds
    every rank's events, each tagged with its rank. ``rank_choice`` says how the engine
    picks a rank for a request, so how much of a prefix held by some ranks it can expect
    to reuse: ``load`` (by load alone: the mean over ranks) or ``cache`` (the rank with
    the longest cached prefix: the best rank).
    """

    transport: Literal["zmq", "http-drain"]
    format: str
    port: int | None = None
    replay_port: int | None = None
    topic: str = ""
    path: str | None = None
    ranks: int = 1
    rank_choice: Literal["load", "cache"] = "load"

    def rank_ports(self, rank: int) -> tuple[int | None, int | None]:
        """The PUB and replay ports of attention-DP rank ``rank`` (``zmq``)."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} outside 0..{self.ranks - 1}")
        pub = None if self.port is None else self.port + rank
        replay = None if self.replay_port is None else self.replay_port + rank
        return pub, replay


@dataclasses.dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter an engine lists as a model of its own (``EngineAdapter.lora_adapter``)."""

    salt: str
    """The ``lora_name`` its blocks carry in the engine's KV events."""
    base_model: str
    """The model it adapts, as the engine lists that model."""


@dataclasses.dataclass(frozen=True, slots=True)
class TokenEventShapes:
    """How an engine writes a *plain token event* of a stream, byte for byte.

    A plain token event is one SSE event carrying one choice (index 0) with only
    generated text (and maybe its token ids): no role, no finish, no usage, no
    logprobs. It is by far the most frequent event of a stream, so the router's
    splicer reads it from its bytes instead of parsing the JSON (see
    :mod:`fleetgate.router.priority.fastpath`).

    Each pattern is matched with ``fullmatch`` from just after the OpenAI identity
    prefix ``data: {"id":..,"object":..,"created":..,"model":..,"choices":[`` to the
    end of the event (``\\n\\n`` included). What it matches is forwarded as is, so
    it must match only plain events written in compact JSON (no spaces, as
    ``json.dumps(separators=(",", ":"))`` writes them): every other field a fixed
    literal (``"finish_reason":null``...), and two named groups:

    * ``text``: the choice's text (``text`` or ``delta.content``) as a JSON string
      body without the quotes, no raw control characters, escapes complete
      (``_common.SSE_JSON_STRING``);
    * ``ids`` (optional): the choice's ``token_ids``, ``null`` or a non-empty list of
      integers (``_common.SSE_TOKEN_IDS``).

    Empty tuples (the default) mean the engine's events are always read as JSON:
    correct for any engine, only slower.
    """

    chat: tuple[re.Pattern[bytes], ...] = ()
    """``chat.completion.chunk`` events."""
    completions: tuple[re.Pattern[bytes], ...] = ()
    """``text_completion`` events."""

    def for_kind(self, kind: Literal["chat", "completions"]) -> tuple[re.Pattern[bytes], ...]:
        return self.chat if kind == "chat" else self.completions


@runtime_checkable
class EngineAdapter(Protocol):
    """Everything fleetgate knows about one engine."""

    name: str
    """Registry key, e.g. ``vllm`` or ``trtllm``."""
    aliases: tuple[str, ...]
    """Other names (e.g. the CRD's ``tensorrt-llm``)."""
    default_block_size: int
    settings_model: type[BaseModel]
    spec_key: str
    """Key of this engine's settings under an InferenceService's ``spec.engine``
    (camelCase, as stored: ``vllm``, ``tensorrtLlm``)."""
    metrics_sources: tuple[MetricsSource, ...]
    """In order of preference; the first is the default."""
    accepts_token_ids_prompt: bool
    """True when ``/v1/completions`` accepts a list of token ids as ``prompt``."""
    returns_token_ids: bool
    """True when the engine returns generated token ids on request
    (vLLM's ``return_token_ids``), so a resume can continue from exact ids."""
    continues_final_message: bool
    """True when a chat request can end with a partial assistant message that the
    engine continues instead of answering (vLLM ``continue_final_message: true`` with
    ``add_generation_prompt: false``): the router's text-only chat resume needs it."""
    token_events: TokenEventShapes
    """The byte layout of the engine's plain streamed token events."""

    def parse_metrics(
        self, source: MetricsSource, body: bytes, now: float, previous: LoadSnapshot | None
    ) -> LoadSnapshot:
        """Parse one scrape. ``previous`` lets draining sources carry state over."""
        ...

    def priority_fields(self, level: int) -> dict[str, Any]:
        """Request-body fields that carry fleetgate ``level`` to this engine."""
        ...

    def error_body(
        self, status: int, message: str, err_type: str, param: str | None = None
    ) -> dict[str, Any]:
        """The engine's own JSON error body for ``status`` (used by the emulator)."""
        ...

    def classify_error(self, status: int, body: bytes) -> ErrorInfo:
        """Understand an error response from this engine."""
        ...

    def container(self, launch: LaunchSpec) -> ContainerPlan:
        """Container command, args, probes and volumes for one replica."""
        ...

    def decode_kv_events(self, frames: Sequence[bytes]) -> tuple[KvEventBatch, ...]:
        """Decode one message of the engine's KV-event stream (pure).

        ``frames`` is one ZeroMQ multipart message (vLLM: topic, sequence number,
        payload) or, for an HTTP-drain engine, the one response body. Returns the
        batches it carries, in order (none for a replay's end marker); raises
        :class:`KvEventsDecodeError` for anything malformed.
        """
        ...

    def kv_replay_request(self, start: int) -> tuple[bytes, ...]:
        """The frames a ZeroMQ DEALER sends to the engine's replay socket to have every
        buffered batch from sequence number ``start`` on sent again (pure). The replies
        are decoded by :meth:`decode_kv_events`; its ``()`` marks the replay's end."""
        ...

    def lora_adapter(self, card: Mapping[str, Any]) -> LoraAdapter | None:
        """What this ``/v1/models`` card says of a LoRA adapter served under its own
        model name (pure): the ``lora_name`` the engine's KV events carry for its
        requests' blocks and the base model it adapts; None for a base model. The
        router salts such a request's block keys with it, as the index salts the
        blocks (:func:`fleetgate.router.scheduling.kvindex.block_keys`), and tokenizes
        it with the base model's tokenizer."""
        ...

    def schedulers(self, settings: Mapping[str, Any], tensor_parallel: int) -> int:
        """How many schedulers one replica runs, each with its own requests and its own
        concurrency limit (pure; arguments as :meth:`concurrency_limit`): 1 for most,
        TensorRT-LLM's attention-DP ranks. The limit the engine's metrics report
        (:attr:`LoadSnapshot.max_running`) is one scheduler's."""
        ...

    def concurrency_limit(self, settings: Mapping[str, Any], tensor_parallel: int) -> int | None:
        """The most requests one replica runs at once (all its :meth:`schedulers`), from
        its InferenceService (pure):
        ``settings`` is the raw ``spec.engine.<spec_key>`` section (camelCase; read
        defensively, as the object may be of another API revision), ``tensor_parallel``
        its ``parallelism.tensor``. None when the section does not say. The router's
        capacity hint for engines whose metrics do not carry the limit."""
        ...

    def request_lora_salt(self, doc: Mapping[str, Any]) -> str | None:
        """The salt of the KV blocks of a request that names a LoRA adapter in its body
        (pure; TensorRT-LLM's ``lora_request``), as :meth:`decode_kv_events` salts them;
        None when the body names none (an engine that names adapters by the model, as
        vLLM does, answers None: :meth:`lora_adapter` covers it)."""
        ...
