"""The emulated trtllm-serve's KV-cache events: the HTTP-drain buffer and the ZeroMQ stream.

Which one a release line uses is :attr:`~fleetgate.engines.trtllm.versions.TrtllmRelease.kv_events`.

* :class:`TrtllmKvEventBuffer`, drained by ``POST /kv_cache_events``. As TensorRT-LLM
  (notes in :mod:`fleetgate.engines.trtllm.kv_events`): events are kept in a buffer of
  ``kv_cache_config.event_buffer_max_size`` entries (the oldest are dropped when it is
  full), every event has the next ``event_id``, the first is ``created`` (a new, empty
  cache), and a read returns and removes everything buffered.
* :func:`trtllm_kv_publisher`, the streaming ``kv_cache_config.kv_events_config``
  publisher (notes in :mod:`fleetgate.engines.trtllm.kv_zmq`): the emulator's ZeroMQ
  publisher (:class:`fleetgate.sim.vllm.kv_events.KvEventPublisher`: one message per
  step with events, seq from 0, the replay ROUTER) writing TensorRT-LLM's batches
  (map-shaped events, signed hashes, removals coalesced) and always binding its
  endpoint, as ``ZmqEventPublisher`` does. Unlike the drain, no ``created`` event is
  published (the engine's streaming manager publishes none).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from fleetgate.engines.base import AllBlocksCleared, KvEvent
from fleetgate.engines.trtllm.kv_events import trtllm_event_items
from fleetgate.engines.trtllm.kv_zmq import encode_trtllm_kv_batch
from fleetgate.sim.vllm.kv_events import KvEventPublisher, KvEventsConfig

__all__ = ["TrtllmKvEventBuffer", "trtllm_kv_publisher"]


def trtllm_kv_publisher(
    config: KvEventsConfig,
    environ: Mapping[str, str],
    wildcard_host: str | None = None,
    rank: int = 0,
) -> KvEventPublisher:
    """A publisher of TensorRT-LLM's streaming wire for ``config`` (same field names as
    TensorRT-LLM's ``KVEventsConfig``); attention-DP rank ``rank`` binds the endpoints'
    ports + ``rank`` (``ZmqEventPublisher``) and stamps its batches with its rank."""
    if rank:
        config = config.model_copy(
            update={
                "endpoint": _offset(config.endpoint, rank),
                "replay_endpoint": None
                if config.replay_endpoint is None
                else _offset(config.replay_endpoint, rank),
            }
        )
    return KvEventPublisher(
        config, environ, wildcard_host, encode=encode_trtllm_kv_batch, always_bind=True, rank=rank
    )


def _offset(endpoint: str, rank: int) -> str:
    """``tcp://host:port`` with the port + ``rank`` (an ephemeral ``*`` port stays ``*``)."""
    head, sep, port = endpoint.rpartition(":")
    if not sep or not endpoint.startswith("tcp://"):
        raise ValueError(f"attention DP needs tcp://HOST:PORT endpoints, not {endpoint!r}")
    return endpoint if port == "*" else f"{head}:{int(port) + rank}"


class TrtllmKvEventBuffer:
    """The executor's event buffer behind ``POST /kv_cache_events``. With attention DP
    (``ranks`` > 1) every rank numbers its own events from 0 and rank 0 gathers them
    all, each tagged ``attention_dp_rank`` (TensorRT-LLM's ``KVCacheEventManager``); the
    buffer holds ``max_size`` per rank, as rank 0's grows by the rank count."""

    def __init__(self, max_size: int, window_size: int, num_blocks: int, ranks: int = 1) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=max_size * ranks)
        self._next_id = [0] * ranks
        self._window = window_size
        self._blocks = num_blocks
        self._ranks = ranks
        for rank in range(ranks):
            self.add([AllBlocksCleared()], rank)

    def add(self, events: Sequence[KvEvent], rank: int = 0) -> None:
        items = trtllm_event_items(self._next_id[rank], events, self._window, self._blocks)
        self._next_id[rank] += len(items)
        if self._ranks > 1:
            items = [{**item, "attention_dp_rank": rank} for item in items]
        self._items.extend(items)

    def drain(self) -> list[dict[str, Any]]:
        out = list(self._items)
        self._items.clear()
        return out
