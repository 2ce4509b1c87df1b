"""The router's admission queue: strict class order, WFQ among tenants inside a class.

Requests wait here while their pool is saturated (see
:mod:`fleetgate.router.priority.saturation`). The order is:

1. class level, most urgent first (strict priority between classes);
2. inside a class, *parked* requests first (preempted or engine-died requests
   awaiting resume: their client already holds a partial answer), oldest
   original arrival first;
3. then fresh requests by weighted fair queueing among tenants
   (``x-fleetgate-tenant``), ties by deadline (arrival + the class TTFT
   objective), then arrival, then enqueue sequence.

Weighted fair queueing uses self-clocked virtual finish tags (SCFQ, Golestani
1994): each class keeps a virtual time ``V``; an item of tenant ``t`` with cost
``c`` (1 per request by default, or tokens) and weight ``w`` gets
``start = max(V, last_finish[t])`` and ``finish = start + c / w``; popping an item
sets ``V`` to its finish tag. A tenant that floods the queue gets finish tags
1, 2, 3, ... while a tenant arriving later starts at the current ``V``, so it is
interleaved at once instead of waiting behind the flood, and over any busy
period each tenant's share of pops is proportional to its weight. Tags are
fixed at enqueue, so the order inside a class is a static sort key and a heap
serves it. Because every item of a class has the same TTFT objective, deadline
order equals arrival order inside a class: with a single tenant the order is
exactly "deadline, then arrival".

Limits per class: ``max_queued`` (a full class rejects at once) and
``max_queue_time_s`` (a queued item past it is expired by :meth:`expire`).
Both answer 429 with ``Retry-After`` for sheddable classes and 503 otherwise
(also with ``Retry-After``). Parked items bypass ``max_queued`` (they were
admitted already) and their queue time counts from when they were parked.

Draining is event-driven: the router calls :meth:`pop_next` whenever capacity
may have appeared (a request finished, a scrape changed, an endpoint appeared),
passing a ``can_dispatch`` predicate; and it arms one timer at
:meth:`next_expiry` to call :meth:`expire`. Nothing polls.

Pure and single-threaded: time comes in as ``now``; the object holds state but
no globals; the router owns one instance per process.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, Literal, TypeVar

from fleetgate.router.priority.config import PriorityClass, PriorityConfig

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class QueueItem(Generic[T]):
    """One waiting request. ``payload`` is the router's own context object."""

    request_id: str
    class_name: str
    level: int
    tenant: str
    arrival: float
    """Original arrival time (kept across preemptions)."""
    enqueued_at: float
    """When this item entered the queue (arrival, or when it was parked)."""
    deadline: float
    """``arrival + ttft_objective_s`` of its class."""
    parked: bool
    """True for a preempted/engine-died request waiting to resume."""
    cost: float
    virtual_finish: float
    seq: int
    payload: T

    def waited(self, now: float) -> float:
        """Seconds since this item entered the queue."""
        return now - self.enqueued_at


@dataclasses.dataclass(frozen=True, slots=True)
class Shed(Generic[T]):
    """A request the queue refused or expired; the router answers ``status``."""

    item: QueueItem[T]
    status: int
    reason: Literal["queue_full", "queue_timeout"]
    retry_after_s: int
    message: str

    def openai_body(self) -> dict[str, object]:
        err_type = "RateLimitError" if self.status == 429 else "ServiceUnavailableError"
        return {
            "error": {"message": self.message, "type": err_type, "param": None, "code": self.status}
        }

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


@dataclasses.dataclass(frozen=True, slots=True)
class ClassStats:
    """Gauges for one class (for the router's metrics)."""

    class_name: str
    depth: int
    parked: int
    oldest_wait_s: float
    tenants: int


_SortKey = tuple[int, float, float, float, int]


class _ClassQueue(Generic[T]):
    """Items of one class in a heap of static sort keys (lazy deletion)."""

    def __init__(self, cls: PriorityClass) -> None:
        self.cls = cls
        self.heap: list[tuple[_SortKey, str]] = []
        self.live: dict[str, QueueItem[T]] = {}
        self.virtual_time = 0.0
        self.last_finish: dict[str, float] = {}

    @staticmethod
    def key(item: QueueItem[T]) -> _SortKey:
        if item.parked:
            return (0, item.arrival, item.deadline, item.arrival, item.seq)
        return (1, item.virtual_finish, item.deadline, item.arrival, item.seq)

    def push(self, item: QueueItem[T]) -> None:
        self.live[item.request_id] = item
        heapq.heappush(self.heap, (self.key(item), item.request_id))

    def _clean_top(self) -> None:
        while self.heap:
            key, rid = self.heap[0]
            item = self.live.get(rid)
            if item is not None and self.key(item) == key:
                return
            heapq.heappop(self.heap)

    def ordered(self) -> Iterator[QueueItem[T]]:
        """Live items in queue order (a sorted snapshot, for peeking/scans)."""
        for key, rid in sorted(self.heap):
            item = self.live.get(rid)
            if item is not None and self.key(item) == key:
                yield item

    def head(self) -> QueueItem[T] | None:
        self._clean_top()
        return self.live[self.heap[0][1]] if self.heap else None


class AdmissionQueue(Generic[T]):
    """Per-class queues with strict priority between classes and WFQ inside one."""

    def __init__(self, config: PriorityConfig) -> None:
        self._config = config
        self._classes: dict[str, _ClassQueue[T]] = {
            c.name: _ClassQueue(c) for c in config.by_level_desc()
        }
        self._where: dict[str, str] = {}
        self._seq = itertools.count()

    # -- admission -------------------------------------------------------

    def offer(
        self,
        request_id: str,
        cls: PriorityClass,
        tenant: str,
        now: float,
        payload: T,
        *,
        cost: float = 1.0,
    ) -> QueueItem[T] | Shed[T]:
        """Queue a fresh request, or refuse it at once when its class is full."""
        if cost <= 0:
            raise ValueError(f"cost must be > 0, got {cost}")
        cq = self._class_queue(cls)
        item = self._make_item(request_id, cls, tenant, now, now, payload, cost, parked=False)
        if len(cq.live) >= cls.max_queued:
            return Shed(
                item=item,
                status=cls.reject_status(),
                reason="queue_full",
                retry_after_s=cls.retry_after_s,
                message=(
                    f"priority class {cls.name!r} queue is full "
                    f"({cls.max_queued} waiting); retry later"
                ),
            )
        start = max(cq.virtual_time, cq.last_finish.get(tenant, 0.0))
        finish = start + cost / self._config.tenant_weight(tenant)
        cq.last_finish[tenant] = finish
        item = dataclasses.replace(item, virtual_finish=finish)
        self._insert(cq, item)
        return item

    def park(
        self,
        request_id: str,
        cls: PriorityClass,
        tenant: str,
        arrival: float,
        now: float,
        payload: T,
    ) -> QueueItem[T]:
        """Re-queue a preempted (or engine-died) request; it resumes first in its class."""
        cq = self._class_queue(cls)
        item = self._make_item(request_id, cls, tenant, arrival, now, payload, 1.0, parked=True)
        self._insert(cq, item)
        return item

    def remove(self, request_id: str) -> QueueItem[T] | None:
        """Drop a request (client went away); returns it, or None if not queued."""
        name = self._where.pop(request_id, None)
        if name is None:
            return None
        return self._classes[name].live.pop(request_id, None)

    # -- draining --------------------------------------------------------

    def pop_next(
        self, now: float, can_dispatch: Callable[[QueueItem[T]], bool]
    ) -> QueueItem[T] | None:
        """Remove and return the first item, in queue order, that can be dispatched.

        ``can_dispatch(item)`` answers for the item's pool (model/endpoints); an
        item whose pool is saturated is skipped, so it does not block an item
        bound for a pool with room. Expired items are never returned: call
        :meth:`expire` first (``now`` guards that contract).
        """
        for cq in self._classes.values():
            skipped: list[tuple[_SortKey, str]] = []
            found: QueueItem[T] | None = None
            while True:
                cq._clean_top()
                if not cq.heap:
                    break
                entry = heapq.heappop(cq.heap)
                item = cq.live[entry[1]]
                if self._expired(item, now):
                    skipped.append(entry)
                    continue
                if can_dispatch(item):
                    found = item
                    break
                skipped.append(entry)
            for entry in skipped:
                heapq.heappush(cq.heap, entry)
            if found is not None:
                del cq.live[found.request_id]
                del self._where[found.request_id]
                if not found.parked:
                    cq.virtual_time = max(cq.virtual_time, found.virtual_finish)
                return found
        return None

    def expire(self, now: float) -> list[Shed[T]]:
        """Remove every item past its class's queue-time limit; the router answers them."""
        out: list[Shed[T]] = []
        for cq in self._classes.values():
            for item in [i for i in cq.live.values() if self._expired(i, now)]:
                self.remove(item.request_id)
                cls = cq.cls
                out.append(
                    Shed(
                        item=item,
                        status=cls.reject_status(),
                        reason="queue_timeout",
                        retry_after_s=cls.retry_after_s,
                        message=(
                            f"request waited {item.waited(now):.3f}s in priority class "
                            f"{cls.name!r}, over its limit of {cls.max_queue_time_s}s"
                        ),
                    )
                )
        out.sort(key=lambda s: (-s.item.level, s.item.enqueued_at, s.item.seq))
        return out

    def next_expiry(self) -> float | None:
        """The earliest time at which :meth:`expire` will have work (arm one timer)."""
        times = [
            i.enqueued_at + cq.cls.max_queue_time_s
            for cq in self._classes.values()
            for i in cq.live.values()
        ]
        return min(times) if times else None

    # -- inspection ------------------------------------------------------

    def heads(self) -> list[QueueItem[T]]:
        """The head item of each non-empty class, most urgent class first."""
        return [h for cq in self._classes.values() if (h := cq.head()) is not None]

    def ordered(self, class_name: str | None = None) -> list[QueueItem[T]]:
        """Queued items in dispatch order, all or one class's (O(n log n))."""
        return [
            item
            for name, cq in self._classes.items()
            if class_name is None or name == class_name
            for item in cq.ordered()
        ]

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._where

    def stats(self, now: float) -> list[ClassStats]:
        out = []
        for name, cq in self._classes.items():
            items = list(cq.live.values())
            out.append(
                ClassStats(
                    class_name=name,
                    depth=len(items),
                    parked=sum(1 for i in items if i.parked),
                    oldest_wait_s=max((i.waited(now) for i in items), default=0.0),
                    tenants=len({i.tenant for i in items}),
                )
            )
        return out

    # -- internals -------------------------------------------------------

    def _class_queue(self, cls: PriorityClass) -> _ClassQueue[T]:
        cq = self._classes.get(cls.name)
        if cq is None or cq.cls != cls:
            raise KeyError(f"priority class {cls.name!r} is not in this queue's config")
        return cq

    def _make_item(
        self,
        request_id: str,
        cls: PriorityClass,
        tenant: str,
        arrival: float,
        now: float,
        payload: T,
        cost: float,
        *,
        parked: bool,
    ) -> QueueItem[T]:
        return QueueItem(
            request_id=request_id,
            class_name=cls.name,
            level=cls.level,
            tenant=tenant,
            arrival=arrival,
            enqueued_at=now,
            deadline=arrival + cls.ttft_objective_s,
            parked=parked,
            cost=cost,
            virtual_finish=0.0,
            seq=next(self._seq),
            payload=payload,
        )

    def _insert(self, cq: _ClassQueue[T], item: QueueItem[T]) -> None:
        if item.request_id in self._where:
            raise ValueError(f"request {item.request_id!r} is already queued")
        cq.push(item)
        self._where[item.request_id] = cq.cls.name

    def _expired(self, item: QueueItem[T], now: float) -> bool:
        return item.waited(now) > self._classes[item.class_name].cls.max_queue_time_s
