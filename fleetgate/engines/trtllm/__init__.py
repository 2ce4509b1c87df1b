"""TensorRT-LLM adapter (trtllm-serve, and Triton's tensorrtllm backend for metrics).

Modules:

* :mod:`~.versions`: the supported release lines and what each accepts;
* :mod:`~.settings`: :class:`TrtllmSettings`, the CRD's ``spec.engine.trtllm``;
* :mod:`~.launch`: the trtllm-serve command line and the ``--extra_llm_api_options`` YAML;
* :mod:`~.sources`: the three metrics sources, in order of preference;
* :mod:`~.prometheus`, :mod:`~.iteration_stats`, :mod:`~.triton`: one parser each;
* :mod:`~.kv_events`, :mod:`~.kv_zmq`: KV-cache events, the HTTP drain's JSON and the
  streaming ZeroMQ publisher's msgpack (one decoder behind ``decode_kv_events``);
* :mod:`~.errors`: error bodies (built and understood);
* :mod:`~.stream`: the byte layout of a plain streamed token event;
* :mod:`~.adapter`: :class:`TrtllmAdapter` tying them together as ``ADAPTER``.

Metric facts (names from TensorRT-LLM's ``tensorrt_llm/metrics/collector.py`` and
``serve/openai_server.py``; iteration-stats keys from the executor's JSON
serialisation, ``cpp/tensorrt_llm/executor/jsonSerialization.cpp``):

* ``kvCacheStats.reusedBlocks``/``missedBlocks`` are cumulative: TensorRT-LLM's own
  Prometheus collector turns them into counters by differencing, so prefix counters
  in tokens are ``blocks * tokensPerBlock``.
* Decode speed (``decode_seconds_sum``/``decode_observations``, ratio of deltas =
  seconds per output token). ``prometheus``: the ``trtllm_time_per_output_token_seconds``
  histogram, one observation = one finished request's mean TPOT. ``iteration-stats``:
  an iteration's ``iterLatencyMS`` is the gap each request in its generation phase
  saw, so the counters add ``latency x numGenRequests`` and ``numGenRequests`` over
  every drained iteration (token-weighted, like vLLM's ITL; context requests' first
  tokens are TTFT, and several speculative tokens per iteration are not accounted).
  They count from the router's first read and survive empty drains. ``triton``:
  unknown (Triton's families carry no per-token latency).
* Priority: ``priority: float`` in [0, 1], higher first, default 0.5.
* Errors: flat ``{"object": "error", ...}`` bodies, request validation
  ``400 {"error": "<str>"}``, "Maximum queue size" surfacing as a 400 = overload.

Draining JSON policy (:func:`~.iteration_stats.parse_iteration_stats`). The executor
appends one ``IterationStats`` per iteration; a read returns and removes all queued ones.

* Non-empty list: the element with the highest ``iter`` (the latest) wins; earlier ones
  are older states of the same gauges, and its counters are cumulative.
* Empty list: no iteration completed since the last read. Between iterations nothing
  is scheduled, finished or freed, so capacity (block counts, block size, batch
  limit) and cumulative counters are carried over from ``previous`` when ``previous``
  came from this same source. Live figures depend on what ``previous`` said:

  - previous idle (running == waiting == 0): the executor does not iterate without
    work, so silence means still idle: running = waiting = 0 (paused 0 when known),
    and KV usage/free blocks are carried;
  - no previous (the router's first read): the same reasoning, so running = waiting
    = 0, and capacity and KV usage unknown. A fresh engine drains nothing until it
    serves, so calling it unknown would keep it unknown (and avoided) for good; a second
    reader draining the queue would make this wrong, as it makes every drained figure;
  - previous busy, or a previous from another source: silence with work outstanding
    means a stalled iteration or a second reader draining the queue; neither lets us
    state counts, so running/waiting/paused/KV usage/free blocks are ``None`` (unknown,
    never 0).

Caveat (both trtllm-serve sources): the figures describe the *last iteration*, and the
``trtllm_*`` gauges are set when the collector runs, so a router that sees no change
for long should weigh its own in-flight count instead.

Pure: no I/O, no clock reads; the Prometheus scanner is ``_common.PromScanner``.
"""

from __future__ import annotations

from fleetgate.engines.trtllm.adapter import ADAPTER, TrtllmAdapter
from fleetgate.engines.trtllm.launch import CONFIG_FILE, llm_api_options_yaml
from fleetgate.engines.trtllm.settings import TrtllmSettings
from fleetgate.engines.trtllm.sources import ITERATION_STATS, PROMETHEUS, TRITON
from fleetgate.engines.trtllm.versions import (
    LINES,
    EngineVersionError,
    TrtllmRelease,
    release_for,
    resolve_version,
)

__all__ = [
    "ADAPTER",
    "CONFIG_FILE",
    "LINES",
    "EngineVersionError",
    "TrtllmRelease",
    "release_for",
    "resolve_version",
    "ITERATION_STATS",
    "PROMETHEUS",
    "TRITON",
    "TrtllmAdapter",
    "TrtllmSettings",
    "llm_api_options_yaml",
]
