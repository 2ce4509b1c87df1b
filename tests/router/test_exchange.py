"""One upstream attempt -> one typed outcome; the client gets bytes only as promised."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pathkit import Captured, request, services, sse, token_event

from fleetgate.engines import get_adapter
from fleetgate.router.config import EnginePriority
from fleetgate.router.exchange import Exchange, Outcome
from fleetgate.router.priority.splice import StreamSplicer

SSE = {"content-type": "text/event-stream"}


async def run_once(  # type: ignore[no-untyped-def]
    handler,
    doc,
    *,
    headers=None,
    splice=False,
    segments=0,
    held=None,
    held_prefix_sooner=False,
    guard_s=None,
    waiting_since=None,
):
    s, _, (e, _) = services(handler)
    req = request(s, doc, headers=headers)
    if splice:
        req.splicer = StreamSplicer(req.kind, include_usage=False, return_token_ids=False)
    req.segments = segments
    req.reserve(e, 0)
    if held is not None:  # the placer's belief: ``held`` of the prompt's tokens cached there
        req.believed = (e.id, held(req.view.prompt_tokens), "events")
    if waiting_since is not None:  # another request sent there at its own level, waiting
        e.plain_waiting[0] = s.clock() - waiting_since
    out = Captured()
    exchange = Exchange(
        s, EnginePriority(), held_prefix_sooner=held_prefix_sooner, held_prefix_guard_s=guard_s
    )
    result = await exchange.run(req, e, out.client())
    return result, out, e, req


async def test_json_answer_is_relayed_byte_for_byte_and_answered() -> None:
    body = b'{"choices": [{"text": "hi"}],   "usage": {"prompt_tokens": 3}}'
    seen: list[bytes] = []

    def engine(r: httpx.Request) -> httpx.Response:
        seen.append(r.content)
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    raw = {"prompt": "x", "max_tokens": 2, "unknown": {"keep": True}}
    result, out, e, req = await run_once(engine, raw)
    assert result.outcome is Outcome.ANSWERED
    assert out.status == 200 and out.body == body
    assert out.headers[b"x-fleetgate-endpoint"] == e.id.encode()
    assert json.loads(seen[0]) == {"model": "m", **raw}  # standard class: no priority field
    assert req.first_token_at is not None and req.objective_counted


async def test_urgent_class_carries_the_engines_priority_field() -> None:
    seen: list[bytes] = []

    def engine(r: httpx.Request) -> httpx.Response:
        seen.append(r.content)
        return httpx.Response(200, json={"choices": []})

    await run_once(engine, {"prompt": "x"}, headers={"x-fleetgate-priority": "critical"})
    sent = json.loads(seen[0])
    for key, value in get_adapter("vllm").priority_fields(8).items():
        assert sent[key] == value


@pytest.mark.parametrize(
    ("sooner", "held", "cls", "level"),
    [
        (True, lambda n: n // 2 + 1, None, 1),  # most of the prompt held: one level up
        (True, lambda n: n // 2 - 1, None, 0),  # less than half: its class's level
        (False, lambda n: n, None, 0),  # the setting off
        (True, lambda n: n, "critical", 9),  # above its class, whatever the class
    ],
)
async def test_held_prefix_sooner_raises_the_engine_priority_of_a_held_prompt(
    sooner: bool, held: Callable[[int], int], cls: str | None, level: int
) -> None:
    seen: list[dict[str, Any]] = []

    def engine(r: httpx.Request) -> httpx.Response:
        seen.append(json.loads(r.content))
        return httpx.Response(200, json={"choices": []})

    headers = {"x-fleetgate-priority": cls} if cls else None
    doc = {"prompt": "a conversation turn with a history of many words " * 4}
    await run_once(engine, doc, headers=headers, held=held, held_prefix_sooner=sooner)
    want = get_adapter("vllm").priority_fields(level) if level else {}
    assert {k: seen[0][k] for k in ("priority",) if k in seen[0]} == want


@pytest.mark.parametrize(
    ("guard_s", "waiting_s", "raised"),
    [
        (1.0, None, True),  # nobody waits at its own level
        (1.0, 0.5, True),  # one waits, not for long
        (1.0, 1.5, False),  # one waits past the guard: no raise until it starts
        (None, 1.5, True),  # no guard
    ],
)
async def test_held_prefix_guard_stops_the_raise_while_a_plain_request_starves(
    guard_s: float | None, waiting_s: float | None, raised: bool
) -> None:
    seen: list[dict[str, Any]] = []

    def engine(r: httpx.Request) -> httpx.Response:
        seen.append(json.loads(r.content))
        return httpx.Response(200, json={"choices": []})

    doc = {"prompt": "a conversation turn with a history of many words " * 4}
    _, _, e, _ = await run_once(engine, doc, held=lambda n: n, held_prefix_sooner=True,
                                guard_s=guard_s, waiting_since=waiting_s)  # fmt: skip
    want = get_adapter("vllm").priority_fields(1) if raised else {}
    assert {k: seen[0][k] for k in ("priority",) if k in seen[0]} == want
    # the request itself is not left in the plain-waiting record
    assert list(e.plain_waiting) == ([0] if waiting_s is not None else [])


@pytest.mark.parametrize("engine_priority", [True, False])
async def test_held_prefix_guard_records_a_plain_request_until_its_first_token(
    engine_priority: bool,
) -> None:
    during: list[int] = []
    holder: list[Any] = []

    def engine(r: httpx.Request) -> httpx.Response:
        during.append(len(holder[0].plain_waiting))
        return httpx.Response(200, json={"choices": []})

    s, _, (e, _) = services(engine)
    holder.append(e)
    req = request(s, {"prompt": "a first turn"})
    req.reserve(e, 0)
    priority = EnginePriority(default=engine_priority)
    exchange = Exchange(s, priority, held_prefix_sooner=True, held_prefix_guard_s=1.0)
    result = await exchange.run(req, e, Captured().client())
    assert result.outcome is Outcome.ANSWERED
    # recorded while it waits, where a raise could pass it; never on an engine that
    # gets no priority field (nothing raised there to pause)
    assert during == [1 if engine_priority else 0] and e.plain_waiting == {}


async def test_engine_5xx_is_a_failure_that_keeps_the_answer_for_later() -> None:
    result, out, e, req = await run_once(
        lambda r: httpx.Response(500, json={"error": {"message": "boom"}}), {"prompt": "x"}
    )
    assert (result.outcome, result.cause) == (Outcome.FAILED, "status_5xx")
    assert out.messages == [] and e.consecutive_failures == 1
    assert req.last_response is not None and req.last_response[0] == 500


async def test_engine_4xx_passes_through_first_time_and_is_fatal_for_a_continuation() -> None:
    def bad(r: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad temperature"}})

    result, out, e, _ = await run_once(bad, {"prompt": "x"})
    assert result.outcome is Outcome.ANSWERED and out.status == 400
    assert b"bad temperature" in out.body and e.consecutive_failures == 0
    result, out, _, _ = await run_once(bad, {"prompt": "x", "stream": True}, splice=True,
                                       segments=1)  # fmt: skip
    assert (result.outcome, result.cause) == (Outcome.FATAL, "continuation_rejected")
    assert out.messages == []


async def test_connect_error_is_a_failure_before_any_byte() -> None:
    def down(r: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=r)

    result, out, _, _ = await run_once(down, {"prompt": "x"})
    assert (result.outcome, result.cause) == (Outcome.FAILED, "connect")
    assert out.messages == []


async def test_spliced_stream_completes_and_the_serve_loop_sends_the_tail() -> None:
    data = sse(token_event(" a", ids=[5]), token_event(" b", finish="length", ids=[6]))
    result, out, _, req = await run_once(
        lambda r: httpx.Response(200, content=data, headers=SSE),
        {"prompt": "x", "stream": True},
        splice=True,
    )
    assert result.outcome is Outcome.COMPLETE
    assert out.status == 200 and b" a" in out.body and b"[DONE]" not in out.body
    assert req.generated == 2 and req.splicer is not None and req.splicer.finished


async def test_spliced_stream_that_stops_early_is_a_broken_stream() -> None:
    data = sse(token_event(" a", ids=[5]), done=False)
    result, _, e, req = await run_once(
        lambda r: httpx.Response(200, content=data, headers=SSE),
        {"prompt": "x", "stream": True},
        splice=True,
    )
    assert (result.outcome, result.cause) == (Outcome.FAILED, "stream_broken")
    assert req.generated == 1 and e.consecutive_failures == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_raw_relay_answers_streams_and_bodies(stream: bool) -> None:
    data = sse(token_event(" a", finish="length"))
    headers = SSE if stream else {"content-type": "application/json"}
    content = data if stream else b'{"choices": []}'
    result, out, _, _ = await run_once(
        lambda r: httpx.Response(200, content=content, headers=headers),
        {"prompt": "x", "stream": stream, "n": 2},  # n > 1: not resumable, raw
    )
    assert result.outcome is Outcome.ANSWERED and out.body == content
