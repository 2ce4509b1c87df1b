"""One priority class's queue inside one pool: weighted fair queueing among tenants.

Inside a class, *parked* requests (preempted or engine-died requests awaiting
resume: their client already holds a partial answer) come first, oldest original
arrival first; then fresh requests by weighted fair queueing among tenants
(``x-fleetgate-tenant``), ties by deadline (arrival + the class TTFT objective),
then arrival, then enqueue sequence.

Weighted fair queueing uses self-clocked virtual finish tags (SCFQ, Golestani
1994): each class keeps a virtual time ``V``; an item of tenant ``t`` with cost
``c`` (1 per request by default, or tokens) and weight ``w`` gets
``start = max(V, last_finish[t])`` and ``finish = start + c / w``
(:meth:`ClassQueue.finish_tag`); serving an item sets ``V`` to its finish tag
(:meth:`ClassQueue.served`). A tenant that floods the queue gets finish tags
1, 2, 3, ... while a tenant arriving later starts at the current ``V``, so it is
interleaved at once instead of waiting behind the flood, and over any busy
period each tenant's share of pops is proportional to its weight. Tags are
fixed at enqueue, so the order inside a class is a static sort key and a heap
serves it. Because every item of a class has the same TTFT objective, deadline
order equals arrival order inside a class: with a single tenant the order is
exactly "deadline, then arrival".

Class order, pools, limits and expiry are :mod:`.queue`'s
(:class:`~.queue.AdmissionQueue`). Pure and single-threaded.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from fleetgate.router.priority.config import PriorityClass

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
    pool: str = ""
    """The set of endpoints that can serve it (e.g. the model name)."""
    max_wait_s: float | None = None
    """A tighter queue-time limit than its class's (a request held for a cold start)."""

    def waited(self, now: float) -> float:
        """Seconds since this item entered the queue."""
        return now - self.enqueued_at


SortKey = tuple[int, float, float, float, int]


class ClassQueue(Generic[T]):
    """Items of one class in a heap of static sort keys (lazy deletion)."""

    def __init__(self, cls: PriorityClass) -> None:
        self.cls = cls
        self.heap: list[tuple[SortKey, str]] = []
        self.live: dict[str, QueueItem[T]] = {}
        self.virtual_time = 0.0
        self.last_finish: dict[str, float] = {}
        self.queued_by_tenant: dict[str, int] = {}

    @staticmethod
    def key(item: QueueItem[T]) -> SortKey:
        if item.parked:
            return (0, item.arrival, item.deadline, item.arrival, item.seq)
        return (1, item.virtual_finish, item.deadline, item.arrival, item.seq)

    def push(self, item: QueueItem[T]) -> None:
        self.live[item.request_id] = item
        self.queued_by_tenant[item.tenant] = self.queued_by_tenant.get(item.tenant, 0) + 1
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

    def first(self, expired: Callable[[QueueItem[T]], bool]) -> QueueItem[T] | None:
        """The first item in queue order that is not ``expired`` (the heap keeps them)."""
        skipped: list[tuple[SortKey, str]] = []
        head: QueueItem[T] | None = None
        while (top := self.head()) is not None:
            if not expired(top):
                head = top
                break
            skipped.append(heapq.heappop(self.heap))
        for entry in skipped:
            heapq.heappush(self.heap, entry)
        return head

    def finish_tag(self, tenant: str, cost: float, weight: float) -> float:
        """SCFQ: ``start = max(V, last_finish[tenant])``, ``finish = start + cost / weight``."""
        start = max(self.virtual_time, self.last_finish.get(tenant, 0.0))
        return start + cost / weight

    def served(self, item: QueueItem[T]) -> None:
        """``item`` leaves to be served: a fresh one moves ``V`` to its finish tag."""
        if not item.parked:
            self.virtual_time = max(self.virtual_time, item.virtual_finish)
        self.take(item.request_id)

    def take(self, request_id: str) -> QueueItem[T] | None:
        """Remove an item; forget a tenant with nothing left queued, and stale entries.

        Per-tenant state lives only while a tenant has work queued. A tenant that
        goes idle restarts at the virtual time ``V`` when it returns, as SCFQ
        treats a flow that went idle (its served items' tags are ``<= V`` already;
        items removed unserved earn it no penalty). Removed items' heap entries
        are compacted. So the memory held is bounded by what is queued, not by
        every tenant name ever seen.
        """
        item = self.live.pop(request_id, None)
        if item is not None:
            left = self.queued_by_tenant[item.tenant] - 1
            if left:
                self.queued_by_tenant[item.tenant] = left
            else:  # an idle tenant restarts at V, as SCFQ does for a flow that went idle
                del self.queued_by_tenant[item.tenant]
                self.last_finish.pop(item.tenant, None)
        if not self.live:
            self.last_finish.clear()
            self.heap.clear()
        elif len(self.heap) > 2 * len(self.live) + 64:  # lazy deletions piling up
            self.heap = [(k, rid) for k, rid in self.heap if rid in self.live]
            heapq.heapify(self.heap)
        return item
