"""Seams for priority scheduling: admission before placement, cancel while in flight.

The router's request path is::

    accepted (parsed, validated) -> Admission.admit(ticket)   <- may queue / reject
        -> pipeline picks an endpoint -> proxy relays
        -> Admission.release(ticket)  (always, in a finally)

``fleetgate/router/priority/`` (engineer "priority") plugs its admission queue
ordering in as an :class:`Admission`. The default admits at once.

Every relayed request is in the :class:`InFlightTable` while it runs, with a
:class:`InFlight` handle whose :meth:`InFlight.cancel` stops the relay and
closes the upstream connection (the engine aborts and frees its KV), the
hook for preemption and stream continuation. ``tokens_sent`` lets a
continuation know how far a stream had got.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol

from fleetgate.router.scheduling.types import RequestView


class AdmissionRejected(Exception):
    """Admission refused the request: answered with ``status`` and ``Retry-After``."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket:
    request_id: str
    model: str
    priority: int
    """fleetgate level (``x-fleetgate-priority`` header), LEVEL_MIN..LEVEL_MAX."""
    arrival: float
    stream: bool
    request: RequestView


class Admission(Protocol):
    async def admit(self, ticket: Ticket) -> None:
        """Return when the request may be placed; raise AdmissionRejected to refuse it."""
        ...

    def release(self, ticket: Ticket) -> None:
        """The request finished (any outcome)."""
        ...


class ImmediateAdmission:
    """Admit everything at once (no priority classes configured)."""

    async def admit(self, ticket: Ticket) -> None:
        return None

    def release(self, ticket: Ticket) -> None:
        return None


@dataclasses.dataclass(eq=False)
class InFlight:
    ticket: Ticket
    endpoint: str
    started: float
    task: asyncio.Task[None] | None = None
    chunks_sent: int = 0
    cancel_reason: str | None = None

    def cancel(self, reason: str) -> bool:
        """Stop relaying and close the upstream request. False when already done."""
        if self.task is None or self.task.done():
            return False
        self.cancel_reason = reason
        self.task.cancel()
        return True


class InFlightTable:
    def __init__(self) -> None:
        self._items: dict[str, InFlight] = {}

    def add(self, item: InFlight) -> None:
        self._items[item.ticket.request_id] = item

    def remove(self, item: InFlight) -> None:
        if self._items.get(item.ticket.request_id) is item:
            del self._items[item.ticket.request_id]

    def get(self, request_id: str) -> InFlight | None:
        return self._items.get(request_id)

    def all(self) -> list[InFlight]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)
