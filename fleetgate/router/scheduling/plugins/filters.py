"""The filters: hard ones (healthy, not ejected, not draining, serves the model) and one soft one
(the prompt fits the context). Each is a one-line predicate over the views."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleetgate.router.scheduling.types import EndpointView, RequestView


@dataclasses.dataclass(frozen=True, slots=True)
class HealthyFilter:
    """Drops endpoints whose /health probe fails."""

    name: str = "healthy"
    soft: bool = False

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in endpoints if e.healthy]


@dataclasses.dataclass(frozen=True, slots=True)
class NotEjectedFilter:
    """Drops endpoints under passive outlier ejection."""

    name: str = "not-ejected"
    soft: bool = False

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in endpoints if not e.ejected]


@dataclasses.dataclass(frozen=True, slots=True)
class NotDrainingFilter:
    """Drops endpoints marked for removal (scale-down drain): no new request, retry or
    resume goes there; what runs there already finishes undisturbed."""

    name: str = "not-draining"
    soft: bool = False

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in endpoints if not e.draining]


@dataclasses.dataclass(frozen=True, slots=True)
class ServesModelFilter:
    """Keeps endpoints whose ``/v1/models`` lists the requested model."""

    name: str = "serves-model"
    soft: bool = False

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in endpoints if request.model in e.models]


@dataclasses.dataclass(frozen=True, slots=True)
class ContextFitsFilter:
    """Keeps endpoints whose context holds the prompt (estimated; soft).

    ``margin`` scales the character-based estimate down, so only prompts that
    clearly cannot fit are steered away from short-context engines.
    """

    margin: float = 0.5
    name: str = "context-fits"
    soft: bool = True

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        need = request.prompt_tokens * self.margin
        return [e for e in endpoints if e.max_model_len is None or need <= e.max_model_len]
