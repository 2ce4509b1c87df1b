"""The emulated vLLM's KV-cache event publisher (vLLM 0.32's ``ZmqEventPublisher`` wire).

Configured by the same ``--kv-events-config`` JSON as vLLM (:class:`KvEventsConfig`,
the fields of ``vllm/config/kv_events.py``). Behaviour as vLLM 0.32's
``vllm/distributed/kv_events.py`` (notes in :mod:`fleetgate.engines.vllm`):

* one PUB message ``(topic, seq 8-byte big-endian, msgpack EventBatch)`` per engine
  step that produced events, ``seq`` counting from 0; the PUB socket binds when the
  endpoint has ``*`` or ``::`` or is ipc/inproc, and connects otherwise;
* a ROUTER replay socket (always bound) answers ``(b"", start seq)`` with every
  buffered batch from ``start`` on, then ``(b"", b"", -1, b"")``; the buffer keeps
  the last ``buffer_steps`` batches.

Sending happens on a daemon thread fed by a queue (as vLLM's), so a slow subscriber
never stalls the engine loop. A wildcard host (``tcp://*:P``) is bound on the address
the HTTP socket is bound to when that is a specific one (``wildcard_host``: the
``FLEETGATE_SIM_BIND_HOST`` address, or 127.0.0.1 under ``FLEETGATE_TEST_MODE=1``), so an
emulated pod never listens beyond its own address.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetgate.cli import CliError
from fleetgate.engines.base import KvEvent, KvEventBatch
from fleetgate.engines.vllm import REPLAY_END_SEQ, encode_vllm_kv_batch

__all__ = ["BatchEncoder", "KvEventPublisher", "KvEventsConfig", "parse_kv_events_config"]

#: ``(seq, batch, topic) -> the 3 PUB frames``: the engine's wire format.
BatchEncoder = Callable[[int, KvEventBatch, str], tuple[bytes, bytes, bytes]]

log = logging.getLogger("fleetgate.sim.kv_events")


class KvEventsConfig(BaseModel):
    """``--kv-events-config`` (vLLM 0.32 ``KVEventsConfig``; same names and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """``zmq`` or ``null``; unset: ``zmq`` when events are on."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(default=10_000, ge=1)
    hwm: int = Field(default=100_000, ge=0)
    max_queue_size: int = Field(default=100_000, ge=1)
    topic: str = ""

    @property
    def active(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def parse_kv_events_config(text: str) -> KvEventsConfig:
    try:
        data = json.loads(text)
        config = KvEventsConfig.model_validate(data)
    except (ValueError, ValidationError) as e:
        raise CliError(f"--kv-events-config: {e}") from None
    if config.publisher not in (None, "zmq", "null"):
        raise CliError(f"--kv-events-config: unknown publisher {config.publisher!r}")
    return config


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _narrow(endpoint: str, environ: Mapping[str, str], wildcard_host: str | None) -> str:
    host = wildcard_host
    if host is None and environ.get("FLEETGATE_TEST_MODE") == "1":
        host = "127.0.0.1"
    if host is not None and endpoint.startswith("tcp://*:"):
        shown = f"[{host}]" if ":" in host else host
        narrow = endpoint.replace("tcp://*:", f"tcp://{shown}:", 1)
        log.warning("binding %s instead of %s (the engine's own address)", narrow, endpoint)
        return narrow
    return endpoint


class KvEventPublisher:
    """PUB + replay ROUTER sockets and the thread that serves them.

    ``encode`` writes a batch in the engine's wire format (vLLM's by default; the
    emulated TensorRT-LLM passes its own, :mod:`fleetgate.sim.trtllm.kv_events`);
    ``always_bind``: the PUB socket binds whatever the endpoint (TensorRT-LLM), instead
    of vLLM's rule (bind on ``*``, ``::``, ipc, inproc; connect otherwise).
    """

    def __init__(
        self,
        config: KvEventsConfig,
        environ: Mapping[str, str],
        wildcard_host: str | None = None,
        *,
        encode: BatchEncoder = encode_vllm_kv_batch,
        always_bind: bool = False,
        rank: int = 0,
    ) -> None:
        self.config = config
        self.rank = rank
        """The data-parallel rank its batches carry (TensorRT-LLM attention DP)."""
        self._encode = encode
        self._topic = config.topic
        self._queue: queue.Queue[Sequence[KvEvent] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, tuple[bytes, bytes, bytes]]] = deque(
            maxlen=config.buffer_steps
        )
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if always_bind or _is_bind_endpoint(config.endpoint):
                self._pub.bind(_narrow(config.endpoint, environ, wildcard_host))
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(_narrow(config.replay_endpoint, environ, wildcard_host))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise CliError(f"--kv-events-config: {e}") from None
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (as bound: a ``*`` port is resolved)."""
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Queue one step's events (nothing is sent for an empty step)."""
        if events and self._running:
            try:
                self._queue.put_nowait(events)
            except queue.Full:
                log.warning("KV event queue full: %d events dropped", len(events))

    def close(self, timeout_s: float = 1.0) -> None:
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # -- the thread ---------------------------------------------------------
    def _loop(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay(self._replay)
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            batch = KvEventBatch(
                seq=self._seq, events=tuple(events), ts=time.time(), data_parallel_rank=self.rank
            )
            frames = self._encode(self._seq, batch, self._topic)
            try:
                self._pub.send_multipart(frames)
            except zmq.ZMQError as e:
                log.warning("KV event batch %d not sent: %s", self._seq, e)
            self._buffer.append((self._seq, frames))
            self._seq += 1

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        request: list[Any] = sock.recv_multipart()
        if len(request) != 3:
            log.warning("invalid replay request of %d frames", len(request))
            return
        client, _empty, start_bytes = request
        start = int.from_bytes(start_bytes, "big")
        for seq, (topic, seq_bytes, payload) in list(self._buffer):
            if seq >= start:
                sock.send_multipart((client, b"", topic, seq_bytes, payload))
        sock.send_multipart((client, b"", b"", REPLAY_END_SEQ.to_bytes(8, "big", signed=True), b""))
