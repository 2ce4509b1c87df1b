"""Supported TensorRT-LLM release lines and what each one accepts.

trtllm-serve validates its command line (click: an unknown option is "No such
option") and its ``--extra_llm_api_options`` YAML (the LLM-API options models forbid
unknown keys), and its OpenAI request models forbid unknown fields. Writing a flag,
key or field a release does not have stops the pod from starting or fails every
request, so the launch spec and the request fields are built from the release's own
facts here. The facts were read from TensorRT-LLM's source; the contract data in
``tests/engines/data/trtllm_contract.yaml`` records each with its file and version and
the tests check every generated command line and options file against it.

How a service's release is known (:func:`resolve_version`): ``spec.engine.version``
when set, otherwise the image tag (``nvcr.io/nvidia/tensorrt-llm/release:1.0.0``,
``...:1.2.0rc3``). Anything else raises :class:`EngineVersionError`, which the operator
reports as a ``Degraded`` condition with reason ``UnknownEngineVersion``.

Pure: standard library only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from fleetgate.engines.base import EngineVersionError

__all__ = [
    "LINES",
    "MAIN",
    "R1_0",
    "R1_1",
    "R1_3",
    "EngineVersionError",
    "TrtllmRelease",
    "release_for",
    "resolve_version",
]


@dataclasses.dataclass(frozen=True, slots=True)
class TrtllmRelease:
    """What one release line of trtllm-serve accepts and publishes."""

    line: str
    """``1.0``, ``1.1`` (1.1.x and 1.2.x), ``1.3`` or ``main`` (1.4 and later)."""
    revision_flag: bool
    """``trtllm-serve --revision`` exists."""
    waiting_queue_policy: bool
    """``scheduler_config.waiting_queue_policy`` exists."""
    request_priority: bool
    """The OpenAI request models have a ``priority`` field (others forbid it: 400)."""
    load_source: Literal["iteration-stats", "prometheus"]
    """Where the live load (running, waiting, KV blocks) is read."""
    json_metrics: Literal["drain", "completion-buffer"]
    """JSON ``/metrics``: a queue drained on read, or a buffer refilled when a request
    completes (and then drained by the read)."""
    prometheus_load_gauges: bool
    """``/prometheus/metrics`` carries the ``trtllm_num_requests_*`` / KV gauges (set by
    the collector from iteration stats when a request completes)."""
    kv_events: Literal["http-drain", "zmq"] | None = None
    """How fleetgate has the engine publish KV-cache events on this line (None: off until
    verified for the line). ``http-drain``: ``kv_cache_config.event_buffer_max_size`` and
    ``POST /kv_cache_events`` (:mod:`.kv_events`). ``zmq``: the streaming publisher,
    ``kv_cache_config.kv_events_config`` with ``use_kv_cache_manager_v2: true``
    (:mod:`.kv_zmq`); it exists for the PyTorch backend only, so a ``tensorrt``-backend
    service on such a line still uses the drain."""
    adp_cache_routing: bool = False
    """``attention_dp_config.enable_kv_cache_aware_routing`` exists: with attention DP
    the engine places a request on the rank holding its prefix (``KVCacheAwareADPRouter``
    of the PyTorch executor's attention-DP router module, read in TensorRT-LLM's source;
    ``AttentionDpConfig`` in its LLM-API arguments); without it ranks are chosen by load
    (``DefaultADPRouter``: fewest active tokens, then requests)."""


R1_0 = TrtllmRelease(
    line="1.0",
    revision_flag=False,
    waiting_queue_policy=False,
    request_priority=False,
    load_source="iteration-stats",
    json_metrics="drain",
    prometheus_load_gauges=False,
)
#: 1.1.x and 1.2.x: 1.0's facts (the line differs in what fleetgate does not use).
R1_1 = dataclasses.replace(R1_0, line="1.1")
#: 1.3.x: main's request and metrics facts; KV events through the HTTP drain. The
#: streaming publisher's ``kv_events_config`` is in the 1.3.0rc27 LLM-API reference but
#: not in every 1.3 pre-release, so this line keeps the drain, which all of them have.
R1_3 = TrtllmRelease(
    line="1.3",
    revision_flag=True,
    waiting_queue_policy=True,
    request_priority=True,
    load_source="prometheus",
    json_metrics="completion-buffer",
    prometheus_load_gauges=True,
    kv_events="http-drain",
)
#: 1.4 and later: 1.3's facts, with the streaming KV-event publisher.
MAIN = dataclasses.replace(R1_3, line="main", kv_events="zmq", adp_cache_routing=True)

#: Every supported release line, oldest first.
LINES: tuple[TrtllmRelease, ...] = (R1_0, R1_1, R1_3, MAIN)

_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.-]?(?:rc|post|dev)\d*)?$")
_SUPPORTED = "1.0.x, 1.1.x, 1.2.x, 1.3.x or main (1.4 and later)"


def release_for(version: str) -> TrtllmRelease:
    """The release line of a version string (``1.0.0``, ``1.2.0rc3``, ``main``, ``1.1``)."""
    text = version.strip().lower()
    if text in ("main", "latest-main"):
        return MAIN
    m = _VERSION_RE.match(text)
    if m is None:
        raise EngineVersionError(
            f"TensorRT-LLM version {version!r} is not a version number; use {_SUPPORTED}"
        )
    major, minor = int(m.group(1)), int(m.group(2))
    if (major, minor) == (1, 0):
        return R1_0
    if (major, minor) in ((1, 1), (1, 2)):
        return R1_1
    if (major, minor) == (1, 3):
        return R1_3
    if (major, minor) >= (1, 4):
        return MAIN
    raise EngineVersionError(f"TensorRT-LLM {version} is not supported; use {_SUPPORTED}")


def resolve_version(declared: str | None, image: str | None) -> TrtllmRelease:
    """The release of a service: ``declared`` (``spec.engine.version``) or the image tag."""
    if declared:
        return release_for(declared)
    if not image:
        raise EngineVersionError(
            "the TensorRT-LLM version is unknown: no image and no spec.engine.version"
        )
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    # NGC tags look like 1.0.0 or 1.2.0rc3; some builds add a suffix (1.0.0-py3).
    head = tag.split("-", 1)[0]
    if head and _VERSION_RE.match(head.lower()):
        return release_for(head)
    raise EngineVersionError(
        f"cannot tell the TensorRT-LLM version from image {image!r} (tag {tag or 'missing'!r}); "
        f"set spec.engine.version to {_SUPPORTED}"
    )
