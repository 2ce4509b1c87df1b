"""The objects every request shares, built once per router app (no globals)."""

from __future__ import annotations

import dataclasses
import random
import secrets
from collections.abc import Callable, Mapping

from fleetgate.router.config import RouterConfig
from fleetgate.router.metrics import ClassMetrics, RouterMetrics
from fleetgate.router.scheduling.pipeline import Pipeline
from fleetgate.router.scheduling.tokenize import Tokenizer
from fleetgate.router.state import EjectionPolicy, Fleet
from fleetgate.router.upstream import Upstream


def random_request_id() -> str:
    """The router's own request id: 64 random bits, so no client can guess another's."""
    return "fg-" + secrets.token_hex(8)


class ByteBudget:
    """Bytes of request bodies the router holds at once (``limits.max_bytes_in_flight``).

    A body's bytes are taken as they are read and given back when its request ends,
    so a flood of large bodies is refused (503) before it exhausts the memory that
    every other client's requests share.
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)


@dataclasses.dataclass(eq=False)
class Services:
    config: RouterConfig
    fleet: Fleet
    pipeline: Pipeline
    upstream: Upstream
    metrics: RouterMetrics
    classes: ClassMetrics
    clock: Callable[[], float]
    rng: random.Random
    new_id: Callable[[], str] = random_request_id
    tokenizers: Mapping[str, Tokenizer] = dataclasses.field(default_factory=dict)
    """Per served model: its tokenizer (``scheduling.tokenizers``), for the exact view."""
    ejection: EjectionPolicy = dataclasses.field(init=False)
    body_bytes: ByteBudget = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        h = self.config.health
        self.ejection = EjectionPolicy(
            after_failures=h.eject_after_failures, base_s=h.eject_base_s, max_s=h.eject_max_s
        )
        self.body_bytes = ByteBudget(self.config.limits.max_bytes_in_flight)
