"""A bounded async load generator for OpenAI-compatible front doors.

It replays a workload's sessions (see ``workloads``) against one base URL with
streaming chat completions, and records per request: time to first token,
inter-token gaps, output tokens, status. It is bounded three ways: the schedule
ends at ``duration``, a hard ``deadline`` cancels whatever is still running, and
``max_in_flight`` caps concurrency. Only loopback URLs are accepted, and proxy
settings from the environment are ignored (``trust_env=False``).

``priority_header`` maps a session's class name to the ``x-fleetgate-priority``
value (None: send no header), for routers that take integer levels instead of
class names; ``keep_text`` stores each answer on its result for twin-run
comparisons.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.workloads import Session


def require_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"load generator only targets loopback addresses, not {url!r}")


def request_id(session_id: str, turn: int) -> str:
    """The ``x-request-id`` of one turn of one session."""
    return f"{session_id}/{turn}"


async def _one_turn(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    session: Session,
    turn_index: int,
    answers: list[str],
    result: RequestResult,
    clock: Callable[[], float],
    priority_header: Callable[[str], str | None] | None = None,
) -> str:
    turn = session.turns[turn_index]
    body: dict[str, Any] = {
        "model": model,
        "messages": session.messages_for(turn_index, answers),
        "max_tokens": turn.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": session.ignore_eos,
    }
    # the router uses x-request-id as its request id (logs), so a preempted request
    # can be traced back to its session and turn (runner.twin_mismatches)
    headers = {
        "x-fleetgate-session": session.session_id,
        "x-request-id": request_id(session.session_id, turn_index),
    }
    if session.priority_class:
        value = (
            session.priority_class
            if priority_header is None
            else priority_header(session.priority_class)
        )
        if value is not None:
            headers["x-fleetgate-priority"] = value
    if session.tenant:
        headers["x-fleetgate-tenant"] = session.tenant
    start = clock()
    pieces: list[str] = []
    last = start
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            result.status = resp.status_code
            result.endpoint = resp.headers.get("x-fleetgate-endpoint")
            if resp.status_code != 200:
                raw = await resp.aread()
                result.error = raw[:200].decode("utf-8", "replace")
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    break
                usage = event.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = clock()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        pieces.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
    result.e2e = clock() - start
    return "".join(pieces)


async def run_sessions(
    base_url: str,
    model: str,
    sessions: list[Session],
    *,
    deadline_s: float,
    max_in_flight: int = 512,
    request_timeout_s: float = 120.0,
    clock: Callable[[], float] = time.perf_counter,
    on_result: Callable[[RequestResult], None] | None = None,
    keep_text: bool = False,
    priority_header: Callable[[str], str | None] | None = None,
    send_until_s: float | None = None,
    on_send: Callable[[], None] | None = None,
) -> list[RequestResult]:
    """Replay ``sessions`` against ``base_url``; never runs past ``deadline_s``.

    No follow-up turn starts after ``send_until_s`` (default: never stop early;
    first turns are the schedule and always go, even when a busy loop wakes late);
    requests still in flight at the deadline are returned with the error
    ``unfinished at deadline`` so that a slow contender's worst requests count
    as misses instead of vanishing. ``on_send`` is called as each request goes out
    (with ``on_result``: what is in flight).
    """
    require_loopback(base_url)
    results: list[RequestResult] = []
    pending: dict[int, RequestResult] = {}
    limit = asyncio.Semaphore(max_in_flight)
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = clock()

        async def play(session: Session) -> None:
            delay = session.start_s - (clock() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            answers: list[str] = []
            for k, turn in enumerate(session.turns):
                if k and turn.think_s:
                    await asyncio.sleep(turn.think_s)
                if k and send_until_s is not None and clock() - t0 > send_until_s:
                    return  # first turns always go: they are the fixed schedule
                async with limit:
                    res = RequestResult(
                        session.session_id, k, session.priority_class or "standard", clock() - t0
                    )
                    pending[id(res)] = res
                    if on_send is not None:
                        on_send()
                    text = await _one_turn(
                        client, base_url, model, session, k, answers, res, clock, priority_header
                    )
                    del pending[id(res)]
                if keep_text:
                    res.text = text
                results.append(res)
                if on_result is not None:
                    on_result(res)
                if not res.ok:
                    return
                answers.append(text)

        tasks = [asyncio.create_task(play(s)) for s in sessions]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=deadline_s)
        except TimeoutError:
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    for res in pending.values():
        res.error = "unfinished at deadline"
        results.append(res)
    return results
