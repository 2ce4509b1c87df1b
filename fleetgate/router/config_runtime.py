"""The router configuration's sections for polling and bounds: ``scrape``, ``health``,
``timeouts`` and ``limits`` (``fleetgate.router.config`` puts them together in
``RouterConfig``; import them from there)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from fleetgate.engines import UnknownEngineError, get_adapter
from fleetgate.router.config_sections import _Strict
from fleetgate.router.scheduling.scrape_pace import ScrapePace


class Scrape(_Strict):
    """``scrape:`` how often each endpoint's ``/metrics`` is read (docs/router.md
    "Scrape intervals"; the rule is ``fleetgate.router.scheduling.scrape_pace``)."""

    interval_s: float = Field(0.2, gt=0)
    """Without a live KV-event feed, and near saturation with one; also the tick at
    which every endpoint's interval is re-decided."""
    timeout_s: float = Field(1.0, gt=0)
    interval_with_events_s: float | None = Field(0.5, gt=0)
    """Live KV-event feed, engine busy but not near saturation. ``null``: ``interval_s``
    whatever the feed (the behaviour before KV events)."""
    idle_interval_with_events_s: float | None = Field(1.5, gt=0)
    """Live KV-event feed, engine idle at the last scrape and no event, dispatch or
    in-flight request since. ``null``: as ``interval_with_events_s``."""
    near_kv_usage: float = Field(0.7, gt=0, le=1)
    """KV use at which an endpoint counts as near saturation (scraped at ``interval_s``)."""
    near_load: float = Field(0.75, gt=0, le=1)
    """Running + waiting + dispatched since the scrape, as a fraction of capacity, at
    which an endpoint counts as near saturation."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_follow_interval(cls, data: Any) -> Any:
        """Unset event intervals are never shorter than ``interval_s``: a config that
        scrapes slowly on purpose (``interval_s: 60``) keeps loading, and keeps its pace."""
        if not isinstance(data, dict):
            return data
        base = data.get("interval_s", 0.2)
        if not isinstance(base, int | float) or isinstance(base, bool):
            return data
        data = dict(data)
        if "interval_with_events_s" not in data:
            data["interval_with_events_s"] = max(0.5, float(base))
        busy = data["interval_with_events_s"]
        if "idle_interval_with_events_s" not in data and isinstance(busy, int | float):
            data["idle_interval_with_events_s"] = max(1.5, float(busy))
        return data

    @model_validator(mode="after")
    def _ordered(self) -> Scrape:
        busy = self.interval_with_events_s
        if busy is not None and busy < self.interval_s:
            raise ValueError("interval_with_events_s must be >= interval_s")
        idle = self.idle_interval_with_events_s
        if idle is not None and idle < (busy if busy is not None else self.interval_s):
            raise ValueError("idle_interval_with_events_s must be >= interval_with_events_s")
        return self

    def pace(self) -> ScrapePace:
        """The pure interval rule this section configures."""
        busy = self.interval_with_events_s
        return ScrapePace(
            base_s=self.interval_s,
            busy_s=busy,
            idle_s=self.idle_interval_with_events_s if busy is not None else None,
            near_kv=self.near_kv_usage,
            near_load=self.near_load,
        )


class Health(_Strict):
    interval_s: float = Field(1.0, gt=0)
    startup_interval_s: float = Field(0.1, gt=0)
    """Probe interval of an endpoint that has never answered its /health yet (a
    replica starting, e.g. from zero with requests held for it), like a Kubernetes
    startupProbe: the engine is used within this much of binding instead of up to
    ``interval_s``. A refused connection costs next to nothing. Never longer than
    ``interval_s``."""
    timeout_s: float = Field(1.0, gt=0)
    slow_probes_to_unhealthy: int = Field(3, ge=1)
    """Consecutive /health probes that TIME OUT before a healthy endpoint counts as
    unhealthy. An engine under a burst answers its probe late while it serves fine
    (the API server is busy tokenizing); one slow probe must not take every engine of a
    busy pool out at once. A refused connection or a non-200 answer counts at once."""
    models_refresh_s: float = Field(15.0, gt=0)
    eject_after_failures: int = Field(3, ge=1)
    """Consecutive connect errors / 5xx that eject an endpoint (passive)."""
    eject_base_s: float = Field(2.0, gt=0)
    eject_max_s: float = Field(60.0, gt=0)


#: Silent-stream failover per engine kind (``timeouts.stream_idle_s``): the longest gap
#: between two chunks of a streamed answer once its first chunk came. A healthy engine
#: sends a token every few to a few hundred milliseconds; the longest legitimate pause
#: is a running sequence waiting for KV: vLLM preempts by recompute under KV pressure
#: and resumes the sequence when blocks free up (seconds); TensorRT-LLM's default
#: scheduler (GUARANTEED_NO_EVICT) never pauses a running request. docs/router-limits.md.
DEFAULT_STREAM_IDLE_S: dict[str, float] = {"vllm": 15.0, "trtllm": 10.0}


class Timeouts(_Strict):
    connect_s: float = Field(2.0, gt=0)
    first_byte_s: float = Field(300.0, gt=0)
    """Headers from the engine (queueing + prefill for a stream)."""
    idle_s: float = Field(120.0, gt=0)
    """Longest gap between two body chunks of an engine's answer before its first
    chunk, and of answers that are not streams."""
    stream_idle_s: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_STREAM_IDLE_S))
    """Per engine kind: longest silence of a streamed answer after its first chunk;
    past it the attempt fails (``stream_idle``) and a resumable answer resumes on
    another endpoint. Engines not listed use ``stream_idle_default_s``."""
    stream_idle_default_s: float = Field(15.0, gt=0)
    total_s: float = Field(1800.0, gt=0)
    client_header_s: float = Field(10.0, gt=0)
    """From a new connection (or the first byte of the next request on a keep-alive
    one) to the end of the request headers; past it: 408 and close (slow-loris)."""
    client_body_s: float = Field(30.0, gt=0)
    """From the request headers to the last byte of its body; past it: 408."""
    client_keep_alive_s: float = Field(75.0, gt=0)
    """An idle keep-alive client connection is closed after this long."""

    @field_validator("stream_idle_s")
    @classmethod
    def _known_engines(cls, value: dict[str, float]) -> dict[str, float]:
        out = {}
        for engine, seconds in value.items():
            try:
                name = get_adapter(engine).name
            except UnknownEngineError as e:
                raise ValueError(str(e.args[0])) from None
            if not seconds > 0:
                raise ValueError(f"{engine}: must be > 0 seconds, got {seconds}")
            out[name] = float(seconds)
        return {**DEFAULT_STREAM_IDLE_S, **out}

    def stream_idle_for(self, engine: str) -> float:
        return self.stream_idle_s.get(engine, self.stream_idle_default_s)


class Limits(_Strict):
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """One request body; beyond it: 413."""
    max_bytes_in_flight: int = Field(256 * 1024 * 1024, ge=1024)
    """All request bodies being read or held by requests in progress, together;
    a body that would go beyond it: 503 + Retry-After (the chart's memory limit is
    1 GiB; a parsed body costs about as much again)."""
    max_headers: int = Field(100, ge=8)
    """Request header fields; beyond: 431."""
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    """Request line and header fields together, in bytes; beyond: 431."""
    max_attempts: int = Field(3, ge=1)
    """Endpoints tried per request (connect error / 5xx before the first byte)."""
    connections_per_endpoint: int = Field(512, ge=1)
    retry_after_s: int = Field(1, ge=0)
    max_held_requests: int = Field(1000, ge=0)
    """Requests held at once per model that scales from zero and has no ready endpoint
    (a cold start); beyond: 503 + Retry-After. 0 turns holding off."""
    hold_cold_start_factor: float = Field(1.5, gt=0, allow_inf_nan=False)
    """A held request waits at most its model's cold start x this factor (and never
    longer than its class's ``max_queue_time_s``); beyond: 503 + Retry-After."""
    default_cold_start_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """The cold start assumed for a model that scales from zero but declares none."""
