"""Runs one pure :class:`~fleetgate.sim.core.api.EngineModel` on the event loop.

One asyncio task per engine (:meth:`EngineDriver.run`) loops::

    while the model has work:
        result = model.step(now)
        await sleep(result.duration * time_scale)
        deliver result.events to the per-request queues
    wait on an asyncio.Event until a request arrives   # never polls

Invariants:

* Tokens are delivered only after the modelled step time has elapsed, so a
  client sees exactly the modelled TTFT / ITL (scaled by ``time_scale``).
* :meth:`EngineDriver.abort` calls ``model.abort`` at once (a disconnected
  client frees its KV blocks without waiting for the next step) and drops the
  request's queue; events for it that a step in flight still produces are
  discarded.
* Model time: with ``time_scale > 0`` the model sees
  ``t0 + (clock() - t0) / time_scale`` so that modelled durations and arrival
  times share one timeline; with ``time_scale == 0`` (run as fast as possible,
  for benches) the model sees a virtual clock advanced by each step's duration.
* ``on_step`` is called after every step with the step's model time, duration
  and events; the HTTP layers use it for per-iteration statistics (TensorRT-LLM's
  drained ``/metrics``) without the driver knowing any engine format.

The clock is injected (``loop.time`` by default) and so is ``sleep``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from fleetgate.sim.core.api import EngineModel, SimRequest, StepResult, TokenEvent

__all__ = ["EngineDriver", "StepHook"]

StepHook = Callable[[float, StepResult], None]
"""``on_step(model_now, result)``, called after each step's sleep."""


class EngineDriver:
    """Owns one engine model, its stepping task and the per-request queues."""

    def __init__(
        self,
        model: EngineModel,
        *,
        time_scale: float = 1.0,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_step: StepHook | None = None,
    ) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.model = model
        self.time_scale = time_scale
        self._clock = clock
        self._sleep = sleep
        self._on_step = on_step
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._virtual = 0.0
        self.steps = 0

    # -- time ---------------------------------------------------------------

    def _wall(self) -> float:
        if self._clock is not None:
            return self._clock()
        return asyncio.get_running_loop().time()

    def now(self) -> float:
        """The model's current time (seconds)."""
        if self.time_scale == 0:
            return self._virtual
        return self._t0 + (self._wall() - self._t0) / self.time_scale

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._t0 = self._wall()
        self._virtual = self._t0
        self._task = asyncio.get_running_loop().create_task(self.run(), name="sim-engine-driver")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # End every open stream: its consumer sees finish_reason "abort".
        for rid, queue in list(self._queues.items()):
            self.abort(rid)
            queue.put_nowait(TokenEvent(rid, (), "abort"))

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- requests -----------------------------------------------------------

    def submit(self, request: SimRequest) -> asyncio.Queue[TokenEvent]:
        """Add ``request`` to the model; its events arrive on the returned queue.

        ``request.arrival_time`` is overwritten with the model's current time.
        Raises ``ValueError`` if the id is already in flight.
        """
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        request.arrival_time = self.now()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.model.add_request(request)  # may refuse it (e.g. prompt too long): register after
        self._queues[request.request_id] = queue
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> bool:
        """Abort at once (frees KV); False when the model did not know the id."""
        self._queues.pop(request_id, None)
        return self.model.abort(request_id)

    def in_flight(self) -> int:
        return len(self._queues)

    # -- the loop -----------------------------------------------------------

    async def run(self) -> None:
        while True:
            if not self.model.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.now()
            result = self.model.step(now)
            self.steps += 1
            delay = result.duration * self.time_scale
            await self._sleep(delay if delay > 0 else 0)
            if self.time_scale == 0:
                self._virtual = now + result.duration
            self._deliver(result.events)
            if self._on_step is not None:
                self._on_step(now + result.duration, result)

    def _deliver(self, events: tuple[TokenEvent, ...]) -> None:
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is None:
                continue
            queue.put_nowait(event)
            if event.finish_reason is not None:
                del self._queues[event.request_id]
