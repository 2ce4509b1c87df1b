"""vLLM (V1 engine) adapter: settings, metrics parsing, priority, errors, streams, container.

What the adapter relies on (the current behaviour checked on a real vLLM 0.32 server):

* Metrics: every engine series carries ``model_name`` and ``engine`` (the
  data-parallel rank) labels, in an order that differs between client versions,
  so labels are matched by name. Counters are exposed with ``_total``.
  ``vllm:cache_config_info`` carries ``block_size`` and ``num_gpu_blocks`` as labels.
  ``kv_cache_usage_perc`` is ``1 - free/(num_gpu_blocks - 1)`` (``block_pool.get_usage``),
  so the number of free blocks is recovered exactly from it. The names used before
  vLLM 0.12 (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``) are read as
  fallbacks.
  Decode speed: ``vllm:inter_token_latency_seconds`` (histogram, one observation per
  inter-token gap) gives ``decode_seconds_sum``/``decode_observations``
  from its ``_sum``/``_count``; before 0.12 the same histogram was also named
  ``vllm:time_per_output_token_seconds`` (read as the fallback). A real server after
  a load run reported 8145 gaps summing to 14.549 s.
* Priority: ``priority: int`` in the request body, lower is handled sooner, default 0.
* Errors: the nested ``{"error": {...}}`` envelope (0.33), 503 for the admission
  limits on queued requests/tokens; request-validation errors use the same envelope
  with ``type: "Bad Request"``; routing errors use FastAPI's ``{"detail": ...}``.
  Older servers used the flat ``{"object": "error", ...}`` body.
* Container: ``vllm.entrypoints.openai.api_server`` with ``/health`` and ``/metrics``;
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
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
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
    require_some,
    text_message,
    validate_launch,
)
from fleetgate.engines.base import (
    ContainerPlan,
    ErrorInfo,
    LaunchSpec,
    LoadSnapshot,
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

_MODEL_CONFIG = ConfigDict(
    frozen=True, extra="forbid", populate_by_name=True, alias_generator=to_camel
)


class VllmSettings(BaseModel):
    """vLLM engine settings as embedded in an ``InferenceService`` spec (camelCase keys).

    ``None`` means "leave vLLM's own default": the flag is not passed at all.
    """

    model_config = _MODEL_CONFIG

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

#: Messages of vLLM's admission-control rejections (queue and backlog limits).
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
        limits (``--max-num-queued-reqs``/``-tokens``) and 429 (llm-d's vLLM simulator);
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
        # The router reads usage.prompt_tokens_details.cached_tokens (its prefix-hit feedback).
        args.append("--enable-prompt-tokens-details")
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
        )


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
