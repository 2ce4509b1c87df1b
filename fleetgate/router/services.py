"""The objects every request shares, built once per router app (no globals)."""

from __future__ import annotations

import dataclasses
import random
import secrets
from collections.abc import Callable

from fleetgate.router.config import RouterConfig
from fleetgate.router.metrics import ClassMetrics, RouterMetrics
from fleetgate.router.scheduling.pipeline import Pipeline
from fleetgate.router.state import EjectionPolicy, Fleet
from fleetgate.router.upstream import Upstream


def random_request_id() -> str:
    """The router's own request id: 64 random bits, so no client can guess another's."""
    return "fg-" + secrets.token_hex(8)


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
    ejection: EjectionPolicy = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        h = self.config.health
        self.ejection = EjectionPolicy(
            after_failures=h.eject_after_failures, base_s=h.eject_base_s, max_s=h.eject_max_s
        )
