""":class:`TrtllmAdapter`: the one object the router, operator and emulator use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from fleetgate.engines._common import clamp_level, spec_positive_int
from fleetgate.engines.base import (
    LEVEL_MAX,
    ContainerPlan,
    ErrorInfo,
    KvEventBatch,
    LaunchSpec,
    LoadSnapshot,
    LoraAdapter,
    MetricsParseError,
    MetricsSource,
)
from fleetgate.engines.trtllm import errors
from fleetgate.engines.trtllm.iteration_stats import parse_iteration_stats
from fleetgate.engines.trtllm.kv_events import decode_trtllm_kv_events
from fleetgate.engines.trtllm.kv_zmq import decode_trtllm_zmq, lora_id_salt
from fleetgate.engines.trtllm.launch import container_plan
from fleetgate.engines.trtllm.prometheus import parse_prometheus
from fleetgate.engines.trtllm.settings import TrtllmSettings
from fleetgate.engines.trtllm.sources import ITERATION_STATS, PROMETHEUS, TRITON
from fleetgate.engines.trtllm.stream import TOKEN_EVENTS
from fleetgate.engines.trtllm.triton import parse_triton
from fleetgate.engines.trtllm.versions import TrtllmRelease, release_for

__all__ = ["ADAPTER", "TrtllmAdapter"]


class TrtllmAdapter:
    """The :class:`~fleetgate.engines.base.EngineAdapter` for TensorRT-LLM's trtllm-serve.

    The registry's ``ADAPTER`` is not bound to a release: its request fields are main's
    and :meth:`container` takes the release from the launch spec. A caller that knows an
    endpoint's release (the operator's ``fleetgate.dev/engine-version`` annotation) uses
    :meth:`for_version`, whose :meth:`priority_fields` are empty where the release's
    request models have no ``priority`` and whose :attr:`metrics_sources` start with the
    source that release publishes load on.
    """

    name = "trtllm"
    aliases: tuple[str, ...] = ("tensorrt-llm", "tensorrt_llm", "trt-llm")
    default_block_size = 32
    settings_model: type[BaseModel] = TrtllmSettings
    spec_key = "tensorrtLlm"
    metrics_sources: tuple[MetricsSource, ...] = (PROMETHEUS, ITERATION_STATS, TRITON)
    #: trtllm-serve's ``CompletionRequest.prompt`` is
    #: ``Union[List[int], List[List[int]], str, List[str]]`` (serve/openai_protocol.py).
    accepts_token_ids_prompt = True
    #: fleetgate does not ask trtllm-serve for generated token ids, so resumes
    #: continue from text.
    returns_token_ids = False
    #: trtllm-serve has no way (in the versions fleetgate supports) to continue a
    #: partial assistant message (vLLM's ``continue_final_message``): it would answer
    #: it as a new turn, so a chat that must resume from text goes to an engine that can.
    continues_final_message = False
    token_events = TOKEN_EVENTS
    #: trtllm-serve serves one model and never checks a request's ``model``: its
    #: answers echo it (``serve/postprocess_handlers.py``, ``ChatPostprocArgs`` and
    #: ``CompletionPostprocArgs.from_request``: ``model=request.model``). The router
    #: sends a served name that differs from the model path as it is.
    accepts_any_model_name = True

    def __init__(self, release: TrtllmRelease | None = None) -> None:
        self.release = release
        if release is not None and release.load_source == "iteration-stats":
            self.metrics_sources = (ITERATION_STATS, TRITON)
        elif release is not None:
            # The collector drains the iteration-stats queue: never poll it as well.
            self.metrics_sources = (PROMETHEUS, TRITON)

    def for_version(self, version: str) -> TrtllmAdapter:
        """This adapter bound to the release line of ``version`` (``1.0.0``, ``main``...)."""
        return TrtllmAdapter(release_for(version))

    def parse_metrics(
        self, source: MetricsSource, body: bytes, now: float, previous: LoadSnapshot | None
    ) -> LoadSnapshot:
        """Parse one scrape of ``source`` (one of :attr:`metrics_sources`, matched by name)."""
        if source.name == PROMETHEUS.name and source.format == "prometheus":
            return parse_prometheus(body, now)
        if source.name == ITERATION_STATS.name and source.format == "json":
            return parse_iteration_stats(body, now, previous)
        if source.name == TRITON.name and source.format == "prometheus":
            return parse_triton(body, now)
        known = ", ".join(f"{s.name} ({s.format})" for s in self.metrics_sources)
        raise MetricsParseError(
            f"unknown trtllm metrics source {source.name!r} ({source.format}); known: {known}"
        )

    def priority_fields(self, level: int) -> dict[str, Any]:
        """``{"priority": 0.5 + level / (2 * LEVEL_MAX)}``: higher first, default 0.5.

        The level is clamped to [LEVEL_MIN, LEVEL_MAX] and the value to [0, 1]. Empty for
        a release whose request models forbid ``priority`` (1.0, 1.1/1.2: a 400).
        """
        if self.release is not None and not self.release.request_priority:
            return {}
        value = 0.5 + clamp_level(level) / (2 * LEVEL_MAX)
        return {"priority": min(1.0, max(0.0, value))}

    def error_body(
        self, status: int, message: str, err_type: str, param: str | None = None
    ) -> dict[str, Any]:
        """trtllm-serve's flat ``ErrorResponse``."""
        return errors.error_body(status, message, err_type, param)

    def classify_error(self, status: int, body: bytes) -> ErrorInfo:
        """See :func:`fleetgate.engines.trtllm.errors.classify_error`."""
        return errors.classify_error(status, body)

    def decode_kv_events(self, frames: Sequence[bytes]) -> tuple[KvEventBatch, ...]:
        """One HTTP-drain body (a single frame: :mod:`.kv_events`) or one ZeroMQ message
        of the streaming publisher (3 frames, 4 with a replay's delimiter: :mod:`.kv_zmq`)."""
        if len(frames) == 1:
            return decode_trtllm_kv_events(frames)
        return decode_trtllm_zmq(frames)

    def lora_adapter(self, card: Mapping[str, Any]) -> LoraAdapter | None:
        """None: trtllm-serve lists only its model; a LoRA adapter is named per request
        (``lora_request``: :meth:`request_lora_salt`)."""
        return None

    def schedulers(self, settings: Mapping[str, Any], tensor_parallel: int) -> int:
        """With attention DP each of the ``tensor_parallel`` ranks schedules its own
        requests under its own ``max_batch_size``, and ``maxNumActiveRequests`` in the
        iteration stats (and the Prometheus gauge fed from them) is one rank's: rank 0's
        executor fills them, and on current main the per-rank rows copy rank 0's
        (``adp_iter_stats.py``, read in TensorRT-LLM's source). Else one."""
        if settings.get("enableAttentionDp") is True and tensor_parallel > 1:
            return tensor_parallel
        return 1

    def concurrency_limit(self, settings: Mapping[str, Any], tensor_parallel: int) -> int | None:
        """``maxBatchSize`` of each of the replica's :meth:`schedulers`, times them."""
        limit = spec_positive_int(settings, "maxBatchSize")
        return None if limit is None else limit * self.schedulers(settings, tensor_parallel)

    def request_lora_salt(self, doc: Mapping[str, Any]) -> str | None:
        """trtllm-serve's OpenAI request names its adapter in ``lora_request``
        (``lora_name``, ``lora_int_id``, ``lora_path``); the LLM API runs it as LoRA
        task ``lora_int_id``, which keys its KV blocks and is the ``lora_id`` of their
        events on the streaming publisher (:func:`.kv_zmq.lora_id_salt`; the 1.3 HTTP drain
        does not serialize ``lora_id``, so there an adapter's blocks read as the base
        model's). Read from TensorRT-LLM's source and examples; not checked on a real
        engine (no GPU here)."""
        lora = doc.get("lora_request")
        if not isinstance(lora, Mapping):
            return None
        n = lora.get("lora_int_id")
        if isinstance(n, bool) or not isinstance(n, int):
            return None
        return lora_id_salt(n)

    def kv_replay_request(self, start: int) -> tuple[bytes, ...]:
        """The streaming publisher's replay request: ``(b"", start as 8-byte big-endian)``."""
        return (b"", start.to_bytes(8, "big"))

    def container(self, launch: LaunchSpec) -> ContainerPlan:
        """``trtllm-serve <model> ...`` plus the LLM-API options YAML as a config file."""
        return container_plan(launch, self.release if launch.engine_version is None else None)


ADAPTER = TrtllmAdapter()
