"""The serve loop: admit -> exchange -> done, or park and admit again; one answer always."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from pathkit import Captured, request, services

from fleetgate.router.admission import ImmediateAdmission
from fleetgate.router.config import EnginePriority
from fleetgate.router.errors import ClientSend
from fleetgate.router.exchange import Exchange, Outcome, Result
from fleetgate.router.placement import Placer
from fleetgate.router.request import Request
from fleetgate.router.serve import ServeLoop
from fleetgate.router.services import Services
from fleetgate.router.state import Endpoint

Step = Callable[[Request, Endpoint, ClientSend], "Result"]


class Scripted(Exchange):
    """An exchange whose attempts play a script (no upstream)."""

    def __init__(self, s: Services, script: list[Result], sends: list[bytes] | None = None):
        super().__init__(s, EnginePriority())
        self.script = script
        self.sends = sends or []
        self.endpoints: list[str] = []

    async def run(self, req: Request, e: Endpoint, send: ClientSend) -> Result:
        self.endpoints.append(e.id)
        req.segments += 1
        result = self.script.pop(0)
        if self.sends:
            data = self.sends.pop(0)
            if data:
                if not send.started:
                    await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": data, "more_body": True})
        if result.outcome is Outcome.ANSWERED and not send.started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        return result


def loop_with(script: list[Result], sends: list[bytes] | None = None, **cfg):  # type: ignore[no-untyped-def]
    s, _, _ = services(lambda r: httpx.Response(200), **cfg)
    placer = Placer(s.fleet, s.pipeline, s.metrics, s.rng)
    admission = ImmediateAdmission(s.config, placer, s.classes, s.clock)
    exchange = Scripted(s, script, sends)
    return s, ServeLoop(s, admission, exchange), exchange


def metric(s: Services, name: str, **labels: str) -> float:
    value = s.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_a_failure_before_the_first_byte_is_placed_again_elsewhere() -> None:
    s, loop, ex = loop_with([Result(Outcome.FAILED, "connect"), Result(Outcome.ANSWERED)])
    req = request(s, {"prompt": "x"})
    out = Captured()
    await loop.serve(req, out.client())
    assert out.status == 200 and out.body == b"ok"
    assert len(set(ex.endpoints)) == 2, "each endpoint tried at most once"
    assert metric(s, "fleetgate_retries_total", model="m", cause="connect") == 1
    assert all(e.counts.in_flight == 0 for e in s.fleet), "every reservation released"


async def test_when_every_endpoint_failed_the_last_failure_is_the_answer() -> None:
    s, loop, _ = loop_with([Result(Outcome.FAILED, "timeout")] * 2)
    out = Captured()
    await loop.serve(request(s, {"prompt": "x"}), out.client())
    assert out.status == 504
    s, loop, _ = loop_with([Result(Outcome.FAILED, "connect")] * 2)
    out = Captured()
    await loop.serve(request(s, {"prompt": "x"}), out.client())
    assert out.status == 503 and b"connect" in out.body
    assert out.headers[b"retry-after"] == b"1"


async def test_attempts_are_bounded_by_limits_max_attempts() -> None:
    script = [Result(Outcome.FAILED, "status_5xx")] * 3
    s, loop, ex = loop_with(script, limits={"max_attempts": 1})
    out = Captured()
    await loop.serve(request(s, {"prompt": "x"}), out.client())
    assert len(ex.endpoints) == 1 and out.status == 503


async def test_a_broken_raw_stream_ends_in_band_once() -> None:
    # n=2 is not resumable: no splicer, so a started stream cannot be mended
    s, loop, ex = loop_with([Result(Outcome.FAILED, "stream_broken")], sends=[b"data: {}\n\n"])
    out = Captured()
    await loop.serve(request(s, {"prompt": "x", "stream": True, "n": 2}), out.client())
    assert out.status == 200 and out.body.endswith(b"data: [DONE]\n\n")
    assert b"stream broke" in out.body and len(ex.endpoints) == 1


async def test_fatal_outcome_is_a_502_and_counts_as_a_missed_objective() -> None:
    s, loop, _ = loop_with([Result(Outcome.FATAL, "continuation_error")])
    out = Captured()
    await loop.serve(request(s, {"prompt": "x"}), out.client())
    assert out.status == 502
    assert metric(s, "fleetgate_ttft_objective_total", model="m", **{"class": "standard"},
                  met="false") == 1  # fmt: skip


async def test_no_endpoint_serves_the_model_is_a_503() -> None:
    s, loop, ex = loop_with([])
    for e in s.fleet:
        e.healthy = False
    out = Captured()
    await loop.serve(request(s, {"prompt": "x"}), out.client())
    assert out.status == 503 and ex.endpoints == []


@pytest.mark.parametrize("stream", [True, False])
async def test_a_resumable_answer_gets_a_splicer_only_where_it_can_be_cut(stream: bool) -> None:
    s, loop, _ = loop_with([])
    req = request(s, {"prompt": "x", "stream": stream})
    # immediate admission never preempts: only streams (an engine may die mid-stream)
    assert (loop.splicer_for(req) is not None) == stream
    assert loop.splicer_for(request(s, {"prompt": "x", "stream": stream, "n": 3})) is None
