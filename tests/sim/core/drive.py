"""Test helper: drive an EngineModel to completion with a modelled clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fleetgate.sim.core.api import EngineModel, EngineStats, SimRequest, TokenEvent


@dataclasses.dataclass
class Run:
    events: list[tuple[float, TokenEvent]]
    """(modelled time at the end of the step, event)."""
    duration: float
    steps: int
    samples: list[EngineStats]
    """Stats after every step."""

    def tokens(self, request_id: str) -> list[int]:
        return [t for _, e in self.events if e.request_id == request_id for t in e.token_ids]

    def finish(self, request_id: str) -> str | None:
        ends = [e.finish_reason for _, e in self.events if e.request_id == request_id]
        return ends[-1] if ends else None

    def first_token_time(self, request_id: str) -> float:
        return next(t for t, e in self.events if e.request_id == request_id and e.first)

    def first_event(self, request_id: str) -> TokenEvent:
        return next(e for _, e in self.events if e.request_id == request_id and e.first)

    def start_order(self) -> list[str]:
        return [e.request_id for _, e in self.events if e.first]


def run(
    engine: EngineModel,
    *,
    now: float = 0.0,
    max_steps: int = 20_000,
    on_step: Callable[[int, float], None] | None = None,
) -> Run:
    events: list[tuple[float, TokenEvent]] = []
    samples: list[EngineStats] = []
    t = now
    steps = 0
    while engine.has_work():
        assert steps < max_steps, "engine did not drain"
        result = engine.step(t)
        t += result.duration
        steps += 1
        events.extend((t, e) for e in result.events)
        samples.append(engine.stats())
        if on_step is not None:
            on_step(steps, t)
    return Run(events, t - now, steps, samples)


def request(
    rid: str,
    prompt: list[int],
    max_tokens: int,
    *,
    arrival: float = 0.0,
    priority: float = 0.0,
    ignore_eos: bool = True,
    seed: int = 0,
) -> SimRequest:
    return SimRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        max_tokens=max_tokens,
        arrival_time=arrival,
        priority=priority,
        ignore_eos=ignore_eos,
        seed=seed,
    )
