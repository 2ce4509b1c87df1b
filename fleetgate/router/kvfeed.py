"""KV-event subscribers: one task per endpoint that publishes events, feeding the KvIndex.

Each endpoint whose :attr:`~fleetgate.router.state.Endpoint.kv_events` is set gets one
asyncio task (:class:`KvFeeds`), started with the app (static backends) or when
Kubernetes discovery adds the endpoint, cancelled when it leaves (its index entries
are then cleared). An engine of several attention-DP ranks (``kv_events.ranks``) has a
stream and a KV cache per rank: on ``zmq`` one task per rank (ports base + rank), each
with its own sequencer and its own entries in the index; the endpoint's feed status is
the least usable rank's (:class:`~fleetgate.router.kvfeed_base.RankGroup`). Batches are
decoded by the endpoint's adapter (``decode_kv_events``) and applied to
``Fleet.kv_index`` in order, under the rules of
:class:`~fleetgate.router.scheduling.kvsync.FeedSequencer`.

``zmq`` (vLLM, and TensorRT-LLM's streaming publisher: the same framing and replay
protocol; the adapter decodes and writes the replay request): a SUB socket on
``tcp://<endpoint host>:<port>`` subscribed to the topic, and for every replay a fresh
DEALER on the replay port (a request that timed out can never answer a later one).
A socket monitor reports the connection:

* connected (handshake done): replay from the first batch not applied yet (0 at
  start), so what was published before the subscription took effect is not lost;
  after a reconnect the replay starts one batch earlier, at the last applied one,
  whose timestamp must match: otherwise another publisher (a restarted engine) owns
  the port, the endpoint's entries are cleared and the replay starts again from 0;
* a batch whose ``seq`` jumps (or a message that does not decode: never "nothing
  changed") asks a replay from the first missing batch; a batch that goes back is an
  engine restart (entries cleared); replayed batches the SUB socket delivers again
  are skipped;
* a replay whose first batch is later than asked (the engine's buffer no longer
  reaches back) is applied anyway and the feed is ``partial``.

``http-drain`` (TensorRT-LLM's buffered events): ``POST`` the path on the engine's HTTP
port every ``kv_events.drain_interval_s`` through the router's httpx client. Reading removes
the events, so there is no replay: a lost or undecodable body clears the endpoint's
entries and the feed is ``partial`` until the engine reports a new cache
(``created``, decoded as ``AllBlocksCleared``).

Failures (no connection, replay unanswered, HTTP errors) make the feed ``broken``
and are retried with a doubling backoff up to ``kv_events.retry_max_s``; the scorer
uses an endpoint's exact view only while its feed is ``live``
(:attr:`~fleetgate.router.scheduling.kvsync.KvFeedStatus.exact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

import httpx
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from fleetgate.engines.base import (
    KvEventBatch,
    KvEventsDecodeError,
)
from fleetgate.router.config import KvEventsSection
from fleetgate.router.kvfeed_base import Broken, Feed, Gap, RankGroup
from fleetgate.router.kvfeed_drain import DrainFeed
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.state import Endpoint, Fleet

log = logging.getLogger("fleetgate.router.kvfeed")


def zmq_url(endpoint_url: str, port: int) -> str:
    """``tcp://host:port`` on the host of the engine's HTTP URL (brackets for IPv6)."""
    host = urlsplit(endpoint_url).hostname or ""
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:{port}"


class ZmqFeed(Feed):
    """A ZeroMQ PUB stream + ROUTER replay (see the module docstring). What the engine
    sends is decoded, and the replay request written, by the endpoint's adapter
    (``decode_kv_events``, ``kv_replay_request``): nothing here is engine-specific."""

    def __init__(
        self,
        e: Endpoint,
        index: KvIndex,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        config: KvEventsSection,
        ctx: zmq.asyncio.Context,
        rank: int = 0,
        group: RankGroup | None = None,
    ) -> None:
        super().__init__(e, index, metrics, clock, config, rank, group)
        kv = e.kv_events
        assert kv is not None and kv.transport == "zmq" and kv.port is not None
        self.ctx = ctx
        port, replay_port = kv.rank_ports(rank)
        assert port is not None
        self.url = zmq_url(e.url, port)
        self.replay_url = zmq_url(e.url, replay_port) if replay_port is not None else None
        self.topic = kv.topic.encode()
        self.ipv6 = self.url.startswith("tcp://[")

    async def run(self) -> None:
        self.state("syncing", "connecting")
        delay = 0.25
        while True:
            started = self.clock()
            try:
                await self._session()
            except Broken as err:
                self.state("broken", str(err))
            except zmq.ZMQError as err:
                self.state("broken", f"zmq: {err}")
            if self.clock() - started > self.config.retry_max_s:
                delay = 0.25  # the session had worked for a while: start the backoff over
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.retry_max_s)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    async def _session(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.url)
            await self._read(sub, monitor)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _read(self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected = False
        sync_cause: str | None = None
        waited_since = quiet_since = self.clock()
        while True:
            if connected and sync_cause is not None:
                await self._sync(sync_cause)
                sync_cause = None
                quiet_since = self.clock()
            ready = dict(await poller.poll(timeout=250))
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    connected = True
                    sync_cause = "start" if self.seq.last is None else "reconnect"
                elif event == zmq.EVENT_DISCONNECTED:
                    connected = False
                    waited_since = self.clock()
                    self.state("syncing", "publisher disconnected")
                continue
            if sub in ready:
                quiet_since = self.clock()
                if not await self._live(await sub.recv_multipart()):
                    sync_cause = "gap"
                continue
            now = self.clock()
            if not connected and now - waited_since > self.config.connect_timeout_s:
                self.state("broken", f"no connection to {self.url}")
            elif connected and self.replay_url is not None:
                if now - quiet_since > self.config.idle_check_s:
                    sync_cause = "idle"  # a lost last batch shows only this way

    async def _live(self, frames: list[bytes]) -> bool:
        """One message from the SUB socket; False when a replay must follow."""
        replayable = self.replay_url is not None
        try:
            for batch in self.decode(frames):
                self.offer(batch, replayed=False, replayable=replayable)
        except (Gap, KvEventsDecodeError) as err:
            if replayable:
                self.state("syncing", f"gap: {err}")
                return False
            # no replay: what the message held is lost for good
            self.forget()
            self.seq.accept_gap(self.seq.needed)
        if self.seq.last is not None:
            self.in_sync()  # live, or partial once something was lost for good
        return True

    async def _sync(self, cause: str) -> None:
        """Replay what is missing (see the module docstring); raises :class:`Broken`."""
        if self.replay_url is None:
            if self.seq.last is not None:
                self.restart()  # nothing can tell whether the publisher is the same one
            self.state("syncing", "no replay socket: waiting for the first batch")
            return
        verify = self.seq.last
        start = verify if verify is not None else self.seq.needed
        batches = await self._replay(start, cause)
        if verify is not None:
            first = batches[0] if batches else None
            if first is None or first.seq != verify or not self.seq.same_stream(verify, first.ts):
                self.restart()  # another stream on the port: start over from 0
                if verify != 0:
                    batches = await self._replay(0, "restart")
            else:
                batches = batches[1:]
        for i, batch in enumerate(batches):
            self.offer(batch, replayed=True, replayable=True)
            if i % 256 == 255:
                await asyncio.sleep(0)  # a long replay does not hold the event loop
        self.verified()
        self.in_sync()

    async def _replay(self, start: int, cause: str) -> list[KvEventBatch]:
        """Every buffered batch from ``start`` on, through a fresh DEALER socket."""
        assert self.replay_url is not None
        self.metrics.child(self.metrics.kv_replays, *self.lv, cause).inc()
        dealer = self._socket(zmq.DEALER)
        out: list[KvEventBatch] = []
        try:
            dealer.connect(self.replay_url)
            await dealer.send_multipart(list(self.e.adapter.kv_replay_request(start)))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.replay_timeout_s
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(timeout=int(left * 1000) + 1):
                    raise Broken(f"replay from {self.replay_url} unanswered")
                frames = await dealer.recv_multipart()
                try:
                    batches = self.decode(frames)
                except KvEventsDecodeError as err:
                    raise Broken(f"undecodable replay message: {err}") from None
                if not batches:
                    return out  # the end marker
                out.extend(batches)
        finally:
            dealer.close(linger=0)


class KvFeeds:
    """The subscriber tasks of a fleet: one per endpoint with ``kv_events``, or, for an
    engine of several attention-DP ranks on ``zmq``, one per rank (ports base + rank)."""

    def __init__(
        self,
        fleet: Fleet,
        client: httpx.AsyncClient,
        config: KvEventsSection,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.fleet = fleet
        self.client = client
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[EndpointId, list[asyncio.Task[None]]] = {}
        self.feeds: dict[EndpointId, tuple[Feed, ...]] = {}

    def start(self) -> None:
        """A task for every endpoint of the fleet that publishes events."""
        for e in self.fleet:
            self.add(e)

    def add(self, e: Endpoint) -> bool:
        """Start ``e``'s subscriber(s) (False: no events, or already running)."""
        kv = e.kv_events
        if kv is None or not self.config.enabled or e.id in self._tasks:
            return False
        index = self.fleet.kv_index
        index.set_ranks(e.id, kv.ranks, kv.rank_choice)
        feeds: tuple[Feed, ...]
        runners: list[Coroutine[Any, Any, None]]
        if kv.transport == "zmq":
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            group = RankGroup(e, kv.ranks) if kv.ranks > 1 else None
            zfeeds = tuple(
                ZmqFeed(e, index, self.metrics, self.clock, self.config, self._ctx, r, group)
                for r in range(kv.ranks)
            )
            feeds, runners = zfeeds, [f.run() for f in zfeeds]
        else:
            drain = DrainFeed(e, index, self.metrics, self.clock, self.config, self.client)
            feeds, runners = (drain,), [drain.run()]
        self.feeds[e.id] = feeds
        loop = asyncio.get_running_loop()
        self._tasks[e.id] = [
            loop.create_task(runner, name=f"kvfeed:{e.id}" + f":{r}" * (len(runners) > 1))
            for r, runner in enumerate(runners)
        ]
        return True

    async def remove(self, eid: EndpointId) -> None:
        """Stop ``eid``'s subscriber(s) and forget its blocks (the endpoint left)."""
        for task in self._tasks.pop(eid, []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        feeds = self.feeds.pop(eid, ())
        self.fleet.kv_index.clear(eid)
        if feeds:
            feeds[0].e.kv_feed.set("off", self.clock(), "stopped")
            feeds[0].e.kv_rank_feeds = ()

    async def stop(self) -> None:
        for eid in list(self._tasks):
            await self.remove(eid)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
