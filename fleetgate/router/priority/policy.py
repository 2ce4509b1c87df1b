"""One drain step: what the router should do now, given the queue and the fleet.

The router calls :func:`drain` on every event that may change the answer (a
request arrived, finished or was cancelled; a scrape landed; an endpoint came
or went; the queue's :meth:`~.queue.AdmissionQueue.next_expiry` timer fired)
and executes the returned actions in order:

* :class:`~.queue.Shed`: answer 429/503 (+ ``Retry-After``); for a *parked*
  request whose client already has part of a stream, end that stream instead;
* :class:`Dispatch`: send the item to ``endpoint`` (for a parked item, build its
  continuation with :func:`~.continuation.build_continuation`);
  with ``prefer`` given, the item may be one queued behind the head of its class
  (affinity dispatch, below);
* :class:`Preempt`: cancel ``victim`` upstream (closing the upstream stream
  makes the engine free its blocks), then :meth:`~.queue.AdmissionQueue.park`
  it; the freed capacity triggers the next :func:`drain`, which dispatches the
  most urgent waiting request, normally ``for_item``.

Within one call, every dispatch counts against its endpoint (the local
``in_flight`` bump, and its KV share with ``kv_share``), so one call can fill
several free slots without overfilling one; victims chosen in this call are not
chosen twice; and a waiting request listed in ``preempting_for`` (a preemption
already in progress for it) triggers no second one. Pure but for the queue it is
given (items taken, pass-over times noted): the router's state is passed in.

**Affinity dispatch** (``prefer``, ``config.affinity_wait_s``). Dispatching each
free slot to the head of the queue sends the head to whichever engine freed first,
so under saturation a request whose prompt prefix one engine holds lands on
another one and prefills it again (the hit rate falls to a round robin's). With
``prefer(item)`` (where the item should wait: the endpoints holding the most of
its prompt prefix among ALL eligible ones, else its prefix's rendezvous target,
load aside; empty: no preference) a free endpoint goes to the first item of the
head's class, in queue order, that prefers it, has no preference, or was first
passed over (a free endpoint given to an item behind it) ``affinity_wait_s`` ago;
among the head and the ``affinity_window`` items behind it. If none does, the item
of the window that loses the least cached prefix by going there takes it (``stake``;
the head without one, or among equals): no free slot idles while the class has work,
and the engines' backlogs even out at the smallest cost in prefills. So an item is
passed over for at most ``affinity_wait_s`` (then it takes any free engine; time
spent merely queued behind others does not count), a higher class is never
overtaken, and a request placed on its holder the moment a slot frees runs at
once: it cannot be evicted while it waits inside the engine.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from collections.abc import Set as AbstractSet
from typing import Generic, Literal, TypeVar

from fleetgate.router.priority.class_queue import QueueItem
from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.priority.preemption import InFlight, Waiting, choose_victim
from fleetgate.router.priority.queue import AdmissionQueue, Shed
from fleetgate.router.priority.saturation import (
    PoolSaturation,
    SaturationThresholds,
    SaturationView,
    pool_saturation,
)

T = TypeVar("T")


#: How a dispatch chose its item (``fleetgate_queue_dispatches_total{how}``):
#: ``in-order`` the head, to an endpoint it prefers or without a preference (or
#: affinity dispatch off); ``ahead`` an item behind the head, to the endpoint it
#: prefers; ``waited-out`` an item past ``affinity_wait_s`` whose holder was busy;
#: ``head-elsewhere`` the head, away from its busy holder, because no item in the
#: window wanted the free endpoint; ``cheapest-elsewhere`` likewise an item behind
#: the head, the one that loses the least cached prefix by going there (``stake``).
DispatchHow = Literal["in-order", "ahead", "waited-out", "head-elsewhere", "cheapest-elsewhere"]


@dataclasses.dataclass(frozen=True, slots=True)
class Dispatch(Generic[T]):
    item: QueueItem[T]
    endpoint: str
    how: DispatchHow = "in-order"


@dataclasses.dataclass(frozen=True, slots=True)
class Preempt(Generic[T]):
    victim: InFlight
    for_item: QueueItem[T]
    reason: str


Action = Shed[T] | Dispatch[T] | Preempt[T]


def drain(
    queue: AdmissionQueue[T],
    now: float,
    *,
    config: PriorityConfig,
    thresholds: SaturationThresholds | None = None,
    views_for: Callable[[QueueItem[T]], Sequence[SaturationView]],
    pick: Callable[[QueueItem[T], tuple[str, ...]], str],
    in_flight: Sequence[InFlight] | Callable[[int], Sequence[InFlight]],
    preempting_for: Collection[str] = (),
    prefer: Callable[[QueueItem[T]], AbstractSet[str]] | None = None,
    kv_share: Callable[[QueueItem[T], str], float] | None = None,
    stake: Callable[[QueueItem[T]], float] | None = None,
    holds: Callable[[QueueItem[T]], AbstractSet[str]] | None = None,
) -> list[Action[T]]:
    """Expire, dispatch while capacity lasts, then preempt for overdue requests.

    ``thresholds`` defaults to ``config.saturation``.
    ``in_flight``: the running requests preemption may choose from, or a function
    of a level that lists (at least) those below it, called only when an overdue
    item could preempt at all, with the highest such item's level.
    ``views_for(item)`` gives the eligible endpoints of the item's pool;
    ``pick(item, available)`` chooses one of ``available`` (the router's scoring
    pipeline: prefix affinity, load) and must return a member of it.
    ``prefer(item)``: the endpoints the item should wait for, busy or not
    (``Placer.affinity_targets``); empty: no preference (see "Affinity
    dispatch" above; None for the argument: strict order).
    ``kv_share(item, endpoint)``: the share of the endpoint's KV cache the item will
    take (0 when unknown), added to that endpoint's KV use for the rest of this
    call, as each dispatch adds one to its in-flight count.
    ``stake(item)``: what the item loses by running away from ``prefer(item)`` (the
    prompt tokens believed cached there); when no item of the window wants a free
    endpoint, the one with the smallest stake takes it (queue order among equals)
    rather than the head. None: the head takes it.
    ``holds(item)``: the endpoints holding the item's prompt prefix, available to it
    while over only by their own queue (:func:`~.saturation.pool_saturation`).
    """
    limits = thresholds if thresholds is not None else config.saturation
    actions: list[Action[T]] = list(queue.expire(now))
    extra: Counter[str] = Counter()
    extra_kv: dict[str, float] = {}

    def adjusted(item: QueueItem[T]) -> Sequence[SaturationView]:
        if not extra and not extra_kv:
            return views_for(item)  # nothing dispatched yet in this call
        return [
            dataclasses.replace(
                v,
                in_flight=v.in_flight + extra[v.endpoint],
                kv_usage=(
                    None
                    if v.kv_usage is None
                    else min(1.0, v.kv_usage + extra_kv.get(v.endpoint, 0.0))
                ),
            )
            for v in views_for(item)
        ]

    # An item's verdict changes only when a dispatch adds to an endpoint's load, so it
    # is computed once per item between dispatches: the head and its window are asked
    # by ``can_dispatch``, again by ``choose`` and once more for the one that goes (each
    # a pass over its endpoints, and a follower's may be a prefix match, ``holds``).
    known: dict[int, PoolSaturation] = {}

    def saturation(item: QueueItem[T]) -> PoolSaturation:
        got = known.get(id(item))
        if got is None:
            got = known[id(item)] = pool_saturation(
                adjusted(item), limits, None if holds is None else lambda: holds(item)
            )
        return got

    wait_s = config.affinity_wait_s
    by_affinity = prefer is not None and wait_s is not None

    def can_dispatch(head: QueueItem[T]) -> bool:
        """The head can go, or (affinity dispatch) an item of its window can: with
        ``holds``, a follower's holder may be open to it while the head has nowhere."""
        if not saturation(head).saturated:
            return True
        if not by_affinity or holds is None:
            return False
        return any(
            not saturation(f).saturated for f in queue.followers(head, now, config.affinity_window)
        )

    def choose(head: QueueItem[T]) -> tuple[QueueItem[T], DispatchHow]:
        """The item that takes the free capacity: the head, or one behind it."""
        if prefer is None or wait_s is None:
            return head, "in-order"
        skipped: list[QueueItem[T]] = []
        movable: list[QueueItem[T]] = []  # skipped items with a free endpoint to go to
        head_can_go = True
        for item in (head, *queue.followers(head, now, config.affinity_window)):
            want = prefer(item)
            free = saturation(item).available
            if not free:  # nowhere to go now (its holder's relief is not the head's)
                if item is head:
                    head_can_go = False
                continue
            if not want or not want.isdisjoint(free):
                how: DispatchHow = "in-order" if item is head else "ahead"
            elif queue.passed_over_for(item, now) >= wait_s:
                how = "waited-out"
            else:
                skipped.append(item)
                if free:
                    movable.append(item)
                continue
            for passed in skipped:
                queue.pass_over(passed, now)
            return item, how
        # Nobody wants a free endpoint: the item that loses least by going there.
        cheapest = head
        if stake is not None or not head_can_go:
            # min keeps the first of equals; can_dispatch saw a follower that can go
            cheapest = min(movable, key=stake or (lambda _: 0.0), default=head)
        if cheapest is head:
            return head, "head-elsewhere"
        for passed in skipped[: skipped.index(cheapest)]:
            queue.pass_over(passed, now)
        return cheapest, "cheapest-elsewhere"

    while True:
        head = queue.peek_next(now, can_dispatch)
        if head is None:
            break
        item, how = choose(head)
        available = saturation(item).available
        if not available:  # a follower whose own eligible endpoints are all busy
            item, how = head, "head-elsewhere"
            available = saturation(item).available
        queue.take(item)
        endpoint = pick(item, available)
        if endpoint not in available:
            raise ValueError(f"pick() returned {endpoint!r}, not one of {available}")
        extra[endpoint] += 1
        known.clear()
        if kv_share is not None:
            extra_kv[endpoint] = extra_kv.get(endpoint, 0.0) + max(0.0, kv_share(item, endpoint))
        actions.append(Dispatch(item, endpoint, how))

    # Preemption: overdue fresh requests, most urgent first, one victim each. A
    # victim runs at a strictly lower level, so the lowest class never preempts.
    overdue: list[QueueItem[T]] = []
    top: int | None = None  # the highest level with an overdue item
    lowest = min((c.level for c in config.classes), default=0)
    for cls in config.by_level_desc():
        threshold = cls.preempt_after_s
        if threshold is None or not config.preemption_enabled or cls.level <= lowest:
            continue
        found = [
            i
            for i in queue.items(cls.name)
            if not i.parked
            and now - i.enqueued_at >= threshold
            and i.request_id not in preempting_for
        ]
        if found and top is None:
            top = cls.level
        overdue.extend(found)
    if top is None:
        return actions
    overdue.sort(key=queue.rank)
    running = in_flight(top) if callable(in_flight) else in_flight
    free = [r for r in running if r.resumable]
    for item in overdue:
        if not free:
            break
        decision = choose_victim(
            config,
            Waiting(item.request_id, item.class_name, item.enqueued_at),
            free,
            now,
            pool_saturated=True,  # it is still queued after the dispatch loop
            eligible_endpoints={v.endpoint for v in views_for(item)},
        )
        if decision.victim is not None:
            free.remove(decision.victim)
            actions.append(Preempt(decision.victim, item, decision.reason))
    return actions
