"""The router's admission queue: strict class order, WFQ among tenants inside a class.

Requests wait here while their pool is saturated (see
:mod:`fleetgate.router.priority.saturation`). The order is:

1. class level, most urgent first (strict priority between classes);
2. inside a class, *parked* requests first (preempted or engine-died requests
   awaiting resume: their client already holds a partial answer), oldest
   original arrival first;
3. then fresh requests by weighted fair queueing among tenants
   (``x-fleetgate-tenant``), ties by deadline (arrival + the class TTFT
   objective), then arrival, then enqueue sequence (:mod:`.class_queue`).

Inside one pool, each class is a :class:`~.class_queue.ClassQueue`, which keeps
the order of 2. and 3. and the tenants' virtual finish tags (SCFQ).

Limits per class: ``max_queued`` (a full class rejects at once) and
``max_queue_time_s`` (a queued item past it is expired by :meth:`expire`).
Both answer 429 with ``Retry-After`` for sheddable classes and 503 otherwise
(also with ``Retry-After``). Parked items bypass ``max_queued`` (they were
admitted already) and their queue time counts from when they were parked.

Items are also partitioned by *pool* (the endpoints that can serve them,
e.g. one model). Each pool is strictly ordered with head-of-line blocking: when
a pool's most urgent item cannot be dispatched, nothing behind it in that pool
overtakes it (a batch request never takes the slot a critical one waits for),
but other pools drain independently. WFQ virtual time is per (pool, class);
``max_queued`` counts a class over all pools.

Draining is event-driven: the router calls :meth:`pop_next` whenever capacity
may have appeared (a request finished, a scrape changed, an endpoint appeared),
passing a ``can_dispatch`` predicate that is asked about one head per pool; and
it arms one timer at :meth:`next_expiry` to call :meth:`expire`. Nothing polls.

Pure and single-threaded: time comes in as ``now``; the object holds state but
no globals; the router owns one instance per process.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, Literal, TypeVar

from fleetgate.router.priority.class_queue import ClassQueue, QueueItem
from fleetgate.router.priority.config import PriorityClass, PriorityConfig

T = TypeVar("T")


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


class AdmissionQueue(Generic[T]):
    """Per-pool, per-class queues: strict class priority, WFQ among tenants in a class."""

    def __init__(self, config: PriorityConfig) -> None:
        self._config = config
        self._order = config.by_level_desc()
        self._pools: dict[str, dict[str, ClassQueue[T]]] = {}
        self._where: dict[str, tuple[str, str]] = {}
        self._count: dict[str, int] = {c.name: 0 for c in self._order}
        self._seq = itertools.count()
        self._expiries: list[tuple[float, int, str]] = []
        self._passed_over: dict[str, float] = {}
        """request id -> when affinity dispatch first gave a free endpoint to an item
        behind it (:meth:`pass_over`)."""

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
        pool: str = "",
        max_wait_s: float | None = None,
    ) -> QueueItem[T] | Shed[T]:
        """Queue a fresh request, or refuse it at once when its class is full.

        ``pool`` names the set of endpoints that can serve it (e.g. the model);
        capacity, head-of-line order and WFQ virtual time are per pool.
        ``max_wait_s`` expires it earlier than its class's ``max_queue_time_s``.
        """
        if cost <= 0:
            raise ValueError(f"cost must be > 0, got {cost}")
        self._check_class(cls)
        item = self._make_item(request_id, cls, tenant, now, now, payload, cost, pool, parked=False)
        if self._count[cls.name] >= cls.max_queued:
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
        cq = self._class_queue(pool, cls)
        finish = cq.finish_tag(tenant, cost, self._config.tenant_weight(tenant))
        item = dataclasses.replace(item, virtual_finish=finish, max_wait_s=max_wait_s)
        self._insert(cq, item)
        cq.last_finish[tenant] = finish
        return item

    def park(
        self,
        request_id: str,
        cls: PriorityClass,
        tenant: str,
        arrival: float,
        now: float,
        payload: T,
        *,
        pool: str = "",
    ) -> QueueItem[T]:
        """Re-queue a preempted (or engine-died) request; it resumes first in its class."""
        self._check_class(cls)
        item = self._make_item(
            request_id, cls, tenant, arrival, now, payload, 1.0, pool, parked=True
        )
        self._insert(self._class_queue(pool, cls), item)
        return item

    def remove(self, request_id: str) -> QueueItem[T] | None:
        """Drop a request (client went away); returns it, or None if not queued."""
        where = self._where.pop(request_id, None)
        self._passed_over.pop(request_id, None)
        if where is None:
            return None
        pool, name = where
        self._count[name] -= 1
        item = self._pools[pool][name].take(request_id)
        self._drop_pool_if_empty(pool)
        return item

    # -- draining --------------------------------------------------------

    def pop_next(
        self, now: float, can_dispatch: Callable[[QueueItem[T]], bool]
    ) -> QueueItem[T] | None:
        """Remove and return the most urgent pool head that can be dispatched.

        Each pool is strictly ordered: only its head (its first item in queue
        order) is offered to ``can_dispatch``, so a lower class never overtakes a
        higher one for the same endpoints, while a saturated pool does not block
        another pool. The predicate runs once per non-empty pool per call.
        Expired items are never returned: call :meth:`expire` first (``now``
        guards that contract).
        """
        best = self.peek_next(now, can_dispatch)
        if best is not None:
            self.take(best)
        return best

    def peek_next(
        self, now: float, can_dispatch: Callable[[QueueItem[T]], bool]
    ) -> QueueItem[T] | None:
        """The item :meth:`pop_next` would return, left in the queue."""
        best: QueueItem[T] | None = None
        for classes in self._pools.values():
            head = self._pool_head(classes, now)
            if head is None or not can_dispatch(head):
                continue
            if best is None or self.rank(head) < self.rank(best):
                best = head
        return best

    def followers(self, head: QueueItem[T], now: float, limit: int) -> list[QueueItem[T]]:
        """Up to ``limit`` items queued behind ``head`` in its own pool AND class, in
        queue order, expired ones left out: the only items that may take a free
        endpoint before ``head`` (affinity dispatch, :func:`~.policy.drain`), so a
        lower class never overtakes a higher one."""
        cq = self._pools.get(head.pool, {}).get(head.class_name)
        if cq is None or limit <= 0:
            return []
        out: list[QueueItem[T]] = []
        for key, rid in heapq.nsmallest(limit + 1 + (len(cq.heap) - len(cq.live)), cq.heap):
            item = cq.live.get(rid)
            if item is None or cq.key(item) != key or item is head or self._expired(item, now):
                continue
            out.append(item)
            if len(out) == limit:
                break
        return out

    def pass_over(self, item: QueueItem[T], now: float) -> None:
        """Note that a free endpoint went to an item behind ``item`` (it waits for the
        endpoint it prefers); the first time counts."""
        self._passed_over.setdefault(item.request_id, now)

    def passed_over_for(self, item: QueueItem[T], now: float) -> float:
        """Seconds since ``item`` was first passed over (0: never)."""
        since = self._passed_over.get(item.request_id)
        return 0.0 if since is None else now - since

    def take(self, item: QueueItem[T]) -> None:
        """Remove ``item`` to be dispatched: WFQ counts it as served (its tenant's
        virtual time moves), unlike :meth:`remove`."""
        self._pools[item.pool][item.class_name].served(item)
        del self._where[item.request_id]
        self._passed_over.pop(item.request_id, None)
        self._count[item.class_name] -= 1
        self._drop_pool_if_empty(item.pool)

    def expire(self, now: float) -> list[Shed[T]]:
        """Remove every item past its class's queue-time limit; the router answers them.

        O(expired x log n): a heap of expiry times (lazy deletion) finds them.
        """
        out: list[Shed[T]] = []
        while self._expiries:
            at, seq, rid = self._expiries[0]
            item = self._live_item(rid, seq)
            if item is None:
                heapq.heappop(self._expiries)
                continue
            if not self._expired(item, now):
                break
            heapq.heappop(self._expiries)
            self.remove(rid)
            cls = self._config.get(item.class_name)
            out.append(
                Shed(
                    item=item,
                    status=cls.reject_status(),
                    reason="queue_timeout",
                    retry_after_s=cls.retry_after_s,
                    message=(
                        f"request waited {item.waited(now):.3f}s in priority class "
                        f"{cls.name!r}, over its limit of {self._limit(item)}s"
                    ),
                )
            )
        out.sort(key=lambda s: (-s.item.level, s.item.enqueued_at, s.item.seq))
        return out

    def next_expiry(self) -> float | None:
        """The earliest time at which :meth:`expire` will have work (arm one timer)."""
        while self._expiries:
            at, seq, rid = self._expiries[0]
            if self._live_item(rid, seq) is not None:
                return at
            heapq.heappop(self._expiries)
        return None

    # -- inspection ------------------------------------------------------

    def heads(self) -> list[QueueItem[T]]:
        """The head of every non-empty (pool, class), most urgent first."""
        found = [
            h for classes in self._pools.values() for cq in classes.values() if (h := cq.head())
        ]
        return sorted(found, key=self.rank)

    def ordered(self, class_name: str | None = None) -> list[QueueItem[T]]:
        """Queued items, all or one class's, by class then queue order (O(n log n))."""
        items = [
            item
            for classes in self._pools.values()
            for name, cq in classes.items()
            if class_name is None or name == class_name
            for item in cq.live.values()
        ]
        return sorted(items, key=self.rank)

    def items(self, class_name: str) -> Iterator[QueueItem[T]]:
        """One class's queued items over all pools, unordered (O(n), no sort)."""
        for classes in self._pools.values():
            cq = classes.get(class_name)
            if cq is not None:
                yield from cq.live.values()

    @staticmethod
    def rank(item: QueueItem[T]) -> tuple[int, tuple[int, float, float, float, int]]:
        """The total dispatch order of items: sort by this key."""
        return (-item.level, ClassQueue.key(item))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._where

    def stats(self, now: float) -> list[ClassStats]:
        """Gauges per class, over all pools, most urgent class first."""
        out = []
        for cls in self._order:
            items = [
                i
                for classes in self._pools.values()
                if cls.name in classes
                for i in classes[cls.name].live.values()
            ]
            out.append(
                ClassStats(
                    class_name=cls.name,
                    depth=len(items),
                    parked=sum(1 for i in items if i.parked),
                    oldest_wait_s=max((i.waited(now) for i in items), default=0.0),
                    tenants=len({i.tenant for i in items}),
                )
            )
        return out

    # -- internals -------------------------------------------------------

    def _check_class(self, cls: PriorityClass) -> None:
        if cls.name not in self._count or self._config.get(cls.name) != cls:
            raise KeyError(f"priority class {cls.name!r} is not in this queue's config")

    def _drop_pool_if_empty(self, pool: str) -> None:
        """A pool with nothing queued holds no state (its virtual times restart at 0,
        which SCFQ allows at the start of a busy period)."""
        classes = self._pools.get(pool)
        if classes is not None and not any(cq.live for cq in classes.values()):
            del self._pools[pool]
        if not self._where:
            self._expiries.clear()
        elif len(self._expiries) > 2 * len(self._where) + 64:
            self._expiries = [e for e in self._expiries if self._live_item(e[2], e[1])]
            heapq.heapify(self._expiries)

    def tenants_tracked(self) -> int:
        """Tenants with WFQ state (for tests: bounded by the tenants with work queued)."""
        return sum(len(cq.last_finish) for c in self._pools.values() for cq in c.values())

    def _class_queue(self, pool: str, cls: PriorityClass) -> ClassQueue[T]:
        classes = self._pools.get(pool)
        if classes is None:
            classes = self._pools[pool] = {c.name: ClassQueue(c) for c in self._order}
        return classes[cls.name]

    def _pool_head(self, classes: dict[str, ClassQueue[T]], now: float) -> QueueItem[T] | None:
        """The first non-expired item of a pool, in class then queue order."""
        for cq in classes.values():
            head = cq.first(lambda item: self._expired(item, now))
            if head is not None:
                return head
        return None

    def _make_item(
        self,
        request_id: str,
        cls: PriorityClass,
        tenant: str,
        arrival: float,
        now: float,
        payload: T,
        cost: float,
        pool: str,
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
            pool=pool,
        )

    def _insert(self, cq: ClassQueue[T], item: QueueItem[T]) -> None:
        if item.request_id in self._where:
            raise ValueError(f"request {item.request_id!r} is already queued")
        cq.push(item)
        self._where[item.request_id] = (item.pool, cq.cls.name)
        self._count[cq.cls.name] += 1
        heapq.heappush(
            self._expiries, (item.enqueued_at + self._limit(item), item.seq, item.request_id)
        )

    def _live_item(self, request_id: str, seq: int) -> QueueItem[T] | None:
        where = self._where.get(request_id)
        if where is None:
            return None
        item = self._pools[where[0]][where[1]].live.get(request_id)
        return item if item is not None and item.seq == seq else None

    def _limit(self, item: QueueItem[T]) -> float:
        """The item's queue-time limit: its class's, or its own tighter one."""
        limit = self._config.get(item.class_name).max_queue_time_s
        return limit if item.max_wait_s is None else min(limit, item.max_wait_s)

    def _expired(self, item: QueueItem[T], now: float) -> bool:
        return item.waited(now) > self._limit(item)
