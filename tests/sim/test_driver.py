"""The engine driver and the token stream, with a tiny fake model (unit level).

We test these aspects: the driver sleeps ``duration * time_scale`` per step on
an injected clock, idles on an event (no steps without work), aborts at once,
ends open streams on stop; :class:`Generation` cuts stop strings and reports
finish / abort to the observer exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from fleetgate.sim.core.api import EngineStats, FinishReason, SimRequest, StepResult, TokenEvent
from fleetgate.sim.driver import EngineDriver
from fleetgate.sim.generation import EngineOptions, GenRequest, SimEngine, generate


@dataclasses.dataclass
class FakeModel:
    """One token per running request per step; token ids count up from 100."""

    step_s: float = 0.01
    block_size: int = 16
    max_model_len: int = 1000
    requests: dict[str, tuple[SimRequest, int]] = dataclasses.field(default_factory=dict)
    aborted: list[str] = dataclasses.field(default_factory=list)
    nows: list[float] = dataclasses.field(default_factory=list)

    def add_request(self, request: SimRequest) -> None:
        self.requests[request.request_id] = (request, 0)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self, now: float) -> StepResult:
        self.nows.append(now)
        events = []
        for rid, (req, done) in list(self.requests.items()):
            done += 1
            finish: FinishReason | None = "length" if done >= req.max_tokens else None
            events.append(TokenEvent(rid, (100 + done,), finish, first=done == 1))
            if finish:
                del self.requests[rid]
            else:
                self.requests[rid] = (req, done)
        return StepResult(self.step_s, tuple(events))

    def stats(self) -> EngineStats:
        n = len(self.requests)
        return EngineStats(n, 0, 0, 0.0, 16, 10, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0.0)


class Tok:
    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: object) -> str:
        return "".join(f"<{t}>" for t in token_ids)  # type: ignore[attr-defined]

    def render_chat(self, messages: object, add_generation_prompt: bool = True) -> list[int]:
        return [1]


@dataclasses.dataclass
class Recorder:
    log: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def on_admit(self, request: GenRequest, now: float) -> None:
        self.log.append(("admit", request.request_id))

    def on_tokens(
        self,
        request: GenRequest,
        count: int,
        now: float,
        first: bool,
        cached: int,
        scheduled_at: float | None = None,
    ) -> None:
        pass

    def on_finish(
        self, request: GenRequest, reason: FinishReason, completion_tokens: int, now: float
    ) -> None:
        self.log.append((f"finish:{reason}", request.request_id))

    def on_abort(self, request: GenRequest, completion_tokens: int, now: float) -> None:
        self.log.append(("abort", request.request_id))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


def make(time_scale: float = 2.0) -> tuple[SimEngine, FakeModel, Recorder, FakeClock]:
    model = FakeModel()
    clock = FakeClock()
    driver = EngineDriver(model, time_scale=time_scale, clock=clock, sleep=clock.sleep)
    rec = Recorder()
    opts = EngineOptions("vllm", "m", "/m", 1000, 16, 10, 8)
    return SimEngine(opts, Tok(), driver, rec), model, rec, clock


def req(rid: str, n: int, stop: tuple[str, ...] = ()) -> GenRequest:
    return GenRequest(rid, (5, 6, 7), n, stop=stop)


async def test_sleeps_scaled_duration_and_model_time() -> None:
    engine, model, rec, clock = make(time_scale=2.0)
    await engine.driver.start()
    try:
        deltas = [d async for d in generate(engine, req("a", 3))]
    finally:
        await engine.driver.stop()
    assert [d.text for d in deltas] == ["<101>", "<102>", "<103>"]
    assert deltas[-1].finish_reason == "length" and deltas[0].first
    assert clock.sleeps == [0.02, 0.02, 0.02]
    # model time runs at 1/time_scale of the (fake) wall clock
    assert model.nows == pytest.approx([1000.0, 1000.01, 1000.02])
    assert rec.log == [("admit", "a"), ("finish:length", "a")]


async def test_idle_driver_does_not_step() -> None:
    engine, model, _, _ = make()
    await engine.driver.start()
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.driver.steps == 0
        assert [d.text async for d in generate(engine, req("a", 1))] == ["<101>"]
        assert engine.driver.steps == 1
    finally:
        await engine.driver.stop()


async def test_close_aborts_at_once_and_once() -> None:
    engine, model, rec, _ = make()
    await engine.driver.start()
    try:
        run = generate(engine, req("a", 50))
        await anext(run)
        run.close()
        run.close()
        assert model.aborted == ["a"] and "a" not in model.requests
        assert rec.log == [("admit", "a"), ("abort", "a")]
    finally:
        await engine.driver.stop()


async def test_stop_string_cuts_output_and_aborts_model() -> None:
    engine, model, rec, _ = make()
    await engine.driver.start()
    try:
        deltas = [d async for d in generate(engine, req("a", 50, stop=("<103",)))]
    finally:
        await engine.driver.stop()
    assert "".join(d.text for d in deltas) == "<101><102>"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "<103"
    assert model.aborted == ["a"]
    assert rec.log == [("admit", "a"), ("finish:stop", "a")]


async def test_driver_stop_ends_open_streams() -> None:
    engine, _, rec, _ = make()
    await engine.driver.start()
    run = generate(engine, req("a", 10_000))
    await anext(run)
    await engine.driver.stop()
    rest = [d async for d in run]
    assert rest[-1].finish_reason == "abort"
    assert rec.log[-1] == ("abort", "a")


async def test_duplicate_in_flight_id_refused() -> None:
    engine, _, _, _ = make()
    await engine.driver.start()
    try:
        run = generate(engine, req("a", 100))
        with pytest.raises(ValueError, match="already in flight"):
            generate(engine, req("a", 1))
        run.close()
    finally:
        await engine.driver.stop()


async def test_stop_string_spanning_tokens_never_leaks() -> None:
    engine, _, _, _ = make()
    await engine.driver.start()
    try:
        deltas = [d async for d in generate(engine, req("a", 50, stop=("1><1",)))]
    finally:
        await engine.driver.stop()
    assert "".join(d.text for d in deltas) == "<10"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "1><1"


async def test_held_back_text_is_flushed_at_the_end() -> None:
    engine, _, _, _ = make()
    await engine.driver.start()
    try:
        deltas = [d async for d in generate(engine, req("a", 3, stop=("never-matches",)))]
    finally:
        await engine.driver.stop()
    assert "".join(d.text for d in deltas) == "<101><102><103>"
    assert deltas[-1].finish_reason == "length"


async def test_refused_request_leaves_nothing_behind() -> None:
    """A request the model refuses (prompt too long) must not stay registered."""

    class Refusing(FakeModel):
        def add_request(self, request: SimRequest) -> None:
            if len(request.prompt_token_ids) > 2:
                raise ValueError("prompt too long")
            super().add_request(request)

    model = Refusing()
    clock = FakeClock()
    driver = EngineDriver(model, time_scale=1.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(ValueError, match="too long"):
        driver.submit(SimRequest("a", [1, 2, 3], 4, 0.0))
    assert driver.in_flight() == 0
    driver.submit(SimRequest("a", [1, 2], 4, 0.0))  # the same id is free again
    assert driver.in_flight() == 1
