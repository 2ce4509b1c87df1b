"""Engine behaviour the router depends on: prefix caching, priority, disconnects.

Both backends run with 24 KV blocks of 128 tokens and ``max_num_seqs`` 4 (the
fixtures' server S1), so the load gauges move with a handful of requests.

What real vLLM 0.32 does (fixture README sections 6-8, quirks 5-6):

* Prefix caching counts TOKENS and hits only whole 128-token blocks; a request's
  ``usage.prompt_tokens_details.cached_tokens`` equals its hit tokens.
* Under ``--scheduling-policy priority`` the waiting queue is ordered by
  (priority, arrival): a late ``priority=-10`` request is scheduled before
  earlier ``priority=10`` ones that are still waiting.
* A client disconnect aborts the request in the engine (``num_requests_running``
  falls, generation stops), but ``request_success_total{finished_reason="abort"}``
  is NOT incremented.

Every /metrics condition is polled with a deadline, never read once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from .backends import BLOCK_SIZE, MAX_NUM_SEQS, Backend
from .wire import RawStream, Scrape, poll, scrape, sse_events

pytestmark = pytest.mark.slow

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@pytest.fixture
async def client(backend: Backend) -> AsyncIterator[httpx.AsyncClient]:
    # generous: the real engine runs under a CPU quota (tests/realvllm.py) and eight
    # 1000-token requests through a 24-block cache take minutes there
    async with httpx.AsyncClient(timeout=600) as c:
        # Start from an idle engine: earlier checks must not bleed into this one.
        await poll(
            c,
            backend.base_url,
            lambda s: s.value(RUNNING) == 0 and s.value(WAITING) == 0,
            timeout_s=60,
            what="idle engine",
        )
        yield c


def _prefix(tag: str) -> str:
    # ~360 tokens with the real tokenizer (3+ blocks of 128); unique per check so
    # earlier checks never warm this check's blocks.
    return f"{tag}: " + " ".join(f"alpha{i} beta" for i in range(120)) + "."


async def _generate(
    client: httpx.AsyncClient, backend: Backend, route: str, max_tokens: int, **fields: Any
) -> dict[str, Any]:
    """A greedy, fixed-length request to ``route``; the 200 answer's body."""
    payload = {"model": backend.model, "max_tokens": max_tokens}
    payload |= {"temperature": 0, "ignore_eos": True} | fields
    resp = await client.post(f"{backend.base_url}{route}", json=payload)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def _complete(
    client: httpx.AsyncClient, backend: Backend, prompt: str, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    return await _generate(client, backend, "/v1/completions", max_tokens, prompt=prompt, **extra)


async def test_prefix_cache_hits_rise_on_shared_prefix(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    prefix = _prefix(f"prefix-{backend.name}")
    before = await scrape(client, backend.base_url)
    a = await _complete(client, backend, prefix + " Question A: what is gamma?", 4)
    b = await _complete(client, backend, prefix + " Question B: what is delta?", 4)
    prompt_total: int = a["usage"]["prompt_tokens"] + b["usage"]["prompt_tokens"]
    assert a["usage"]["prompt_tokens"] > 2 * BLOCK_SIZE

    def grew(s: Scrape) -> bool:
        return (
            s.value("vllm:prefix_cache_queries_total")
            >= before.value("vllm:prefix_cache_queries_total") + prompt_total
        )

    after = await poll(client, backend.base_url, grew, timeout_s=15, what="queries += prompts")
    hits = after.value("vllm:prefix_cache_hits_total") - before.value(
        "vllm:prefix_cache_hits_total"
    )
    assert hits >= BLOCK_SIZE, f"no whole-block hit for a shared {prompt_total // 2}-token prefix"
    assert hits % BLOCK_SIZE == 0, f"hits {hits} are not whole {BLOCK_SIZE}-token blocks"
    assert hits <= a["usage"]["prompt_tokens"]
    # cached_tokens (--enable-prompt-tokens-details) reports the same hit, per request.
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == hits


async def test_cached_tokens_in_stream_usage_chunk(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    prompt = _prefix(f"stream-usage-{backend.name}")
    await _complete(client, backend, prompt, 2)  # warm the blocks
    payload = {
        "model": backend.model,
        "prompt": prompt,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await client.post(f"{backend.base_url}/v1/completions", json=payload)
    events = sse_events(resp.content)
    usage = json.loads(events[-2])["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= BLOCK_SIZE and cached % BLOCK_SIZE == 0, usage
    assert cached < usage["prompt_tokens"], "the last prompt token is never served from cache"


class _SetupMissed(Exception):
    """The load did not reach the state a priority round needs (timing, not a verdict)."""


async def _priority_round(
    backend: Backend, client: httpx.AsyncClient
) -> tuple[dict[str, float], dict[str, float]]:
    """One round of the priority scenario; returns first-token and end times per tag."""
    prompt = "priority: " + "the " * 40
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    t0 = time.monotonic()

    async def job(tag: str, max_tokens: int, priority: int) -> None:
        payload = {"model": backend.model, "prompt": f"{tag} {prompt}", "max_tokens": max_tokens}
        payload |= {"ignore_eos": True, "temperature": 0, "priority": priority, "stream": True}
        url = f"{backend.base_url}/v1/completions"
        async with client.stream("POST", url, json=payload) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and tag not in first:
                    first[tag] = time.monotonic() - t0
        done[tag] = time.monotonic() - t0

    tasks: list[asyncio.Task[None]] = []
    try:
        # 4 x (45 + 700) tokens still fit the 24 x 128-token KV cache, so no
        # preemption happens before the first long one ends.
        for i, n in enumerate((700, 1000, 1300, 1600)):
            tasks.append(asyncio.create_task(job(f"long{i}", n, 10)))
        try:
            await poll(
                client,
                backend.base_url,
                lambda s: s.value(RUNNING) == MAX_NUM_SEQS,
                timeout_s=30,
                interval_s=0.05,
                what=f"the longs running ({MAX_NUM_SEQS})",
            )
        except AssertionError as e:
            # seen in loaded CI runs: the fourth long one admitted only after the
            # first three had filled the KV cache; the round says nothing about
            # priority, so it is a set-up miss (retried, at most 3 rounds, then FAIL)
            raise _SetupMissed(str(e)) from None
        for i in range(4):
            tasks.append(asyncio.create_task(job(f"queued{i}", 300, 10)))
        try:
            seen = await poll(
                client,
                backend.base_url,
                lambda s: s.value(WAITING) >= 4 and s.value(RUNNING) == MAX_NUM_SEQS,
                timeout_s=2,
                interval_s=0.05,
                what="the queued ones waiting (>= 4)",
            )
        except AssertionError as e:
            raise _SetupMissed(str(e)) from None
        if done:
            raise _SetupMissed(f"a request ended before the urgent one was sent: {done}")
        assert seen.value("vllm:kv_cache_usage_perc") > 0
        queued_started = {t: v for t, v in first.items() if t.startswith("queued")}
        if queued_started:
            # a stalled scrape let the queued ones start before the urgent one was
            # even sent: this round cannot show the order (seen on a quiet machine,
            # where the tiny model outruns the /metrics scrapes)
            raise _SetupMissed(f"queued requests started before the urgent one: {queued_started}")
        tasks.append(asyncio.create_task(job("urgent", 300, -10)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return first, done


async def test_priority_orders_the_waiting_queue(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """A late ``priority=-10`` request is scheduled before earlier ``priority=10`` ones.

    Like fixture run 7, in confirmed phases: four long ``priority=10`` requests
    fill the 4 slots (gauge: running 4); four 300-token ``priority=10`` requests
    queue behind them (gauges: running 4, waiting >= 4); then a 300-token
    ``priority=-10`` request arrives. The longs end at different lengths, so
    slots free one at a time: under priority scheduling the urgent request takes
    the first free slot, under FCFS it would start only after all four queued
    ones had started, about one long request's run later.

    "Started" is when the request's first streamed token reached us. The
    client can stall for a second on this VM (fixture README quirk 9), which
    may make events that were seconds apart arrive together; hence the
    tolerance: urgent must start no later than 0.5 s after the first queued
    request. FCFS puts it seconds behind (seen with the emulator under fcfs).

    A round whose set-up was not reached (a /metrics scrape stalled past the
    first long request's end, so the queue state is unknown) says nothing about
    priority; it is retried, at most 3 rounds, and then the check FAILS.
    """
    misses: list[str] = []
    for _ in range(3):
        try:
            first, done = await _priority_round(backend, client)
        except _SetupMissed as e:
            misses.append(str(e))
            await poll(
                client,
                backend.base_url,
                lambda s: s.value(RUNNING) == 0 and s.value(WAITING) == 0,
                timeout_s=60,
                what="idle engine before the next round",
            )
            continue
        queued_start = min(v for k, v in first.items() if k.startswith("queued"))
        report = f"first token at {first}, done at {done}; earlier rounds missed: {misses}"
        assert first["urgent"] <= queued_start + 0.5, report
        return
    pytest.fail(f"priority set-up never reached in 3 rounds: {misses}")


async def _pressure_round(
    backend: Backend, client: httpx.AsyncClient, tag: str
) -> tuple[list[float], list[dict[str, Any]]]:
    """Run 8 x 1000-token requests; sample kv_cache_usage_perc until they are all done."""
    prompt = f"pressure {tag}: " + "the " * 40
    jobs = [_complete(client, backend, f"p{i} {prompt}", 1000) for i in range(2 * MAX_NUM_SEQS)]
    tasks = [asyncio.create_task(j) for j in jobs]
    samples: list[float] = []
    try:
        while not all(t.done() for t in tasks):
            s = await scrape(client, backend.base_url)
            samples.append(s.value("vllm:kv_cache_usage_perc"))
            await asyncio.wait(tasks, timeout=0.05)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return samples, results


@pytest.mark.timeout(1200)  # up to 3 rounds of a multi-minute load on the throttled engine
async def test_kv_pressure_preempts_and_moves_the_gauges(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """Requests that outgrow the 3,072-token KV cache together force preemptions.

    Each needs ~45 + 1000 tokens (9 blocks of 128); 4 running x 9 = 36 > 24
    blocks, so when they reach ~720 tokens each a running request cannot get a
    block and the scheduler preempts one (vLLM: recomputed later). 8 requests
    make waves of them. All still return every token, ``kv_cache_usage_perc``
    reaches >= 0.5 in the sampled scrapes while they run and
    ``num_preemptions_total`` grows. Seen on
    real vLLM in fixture load_timeseries (2 preemptions, usage 0.87).

    The usage gauge is sampled all through the load. On this VM a scrape can
    stall for 1-2 s and miss the high-usage window entirely; a round with fewer
    than 10 samples is inconclusive and retried (at most 3 rounds).
    """
    key = "vllm:num_preemptions_total"
    before = await scrape(client, backend.base_url)
    rounds: list[str] = []
    for attempt in range(3):
        samples, results = await _pressure_round(backend, client, f"{backend.name}{attempt}")
        assert [r["usage"]["completion_tokens"] for r in results] == [1000] * len(results)
        peak = max(samples, default=0.0)
        rounds.append(f"{len(samples)} samples, peak {peak:.3f}")
        # 0.5 rather than the ~0.9 the engine reaches: under this load the real
        # server's /metrics often answers only every 1-2 s, so samples are few and
        # may all miss the top; 0.5 still shows the gauge moving with the load, and
        # the preemption counter below shows the cache really ran out.
        if peak >= 0.5 or len(samples) >= 10:
            assert 0.5 <= peak <= 1.0, f"kv usage never reached 0.5: {rounds}"
            break
    else:
        pytest.fail(f"every round inconclusive (scrapes stalled): {rounds}")
    print(f"kv pressure rounds on {backend.name}: {rounds}")
    after = await poll(
        client,
        backend.base_url,
        lambda s: s.value(key) > before.value(key) and s.value(RUNNING) == 0,
        timeout_s=15,
        what="num_preemptions_total grown and the engine idle",
    )
    assert after.value("vllm:kv_cache_usage_perc") < peak


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
async def test_client_disconnect_aborts_the_request(
    backend: Backend, client: httpx.AsyncClient, stream: bool
) -> None:
    max_tokens = 1800
    payload = {
        "model": backend.model,
        "prompt": f"Disconnect test ({stream=}): tell a long story.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    body = json.dumps(payload).encode()
    # Non-streaming: nothing to read before the end, and a /metrics scrape can stall past
    # the whole generation on the real engine, so the client disconnects after a fixed
    # delay. On a loaded machine the engine may not have admitted the request that soon
    # (then it never reaches the engine, which is not what this test is about): try a
    # longer delay; the prompt-token counter proves admission.
    for delay in (0.1, 0.5, 2.0) if not stream else (0.0,):
        before = await scrape(client, backend.base_url)
        if stream:
            conn = await RawStream.open(backend.base_url, "POST", "/v1/completions", body)
        else:  # no response head comes before the end: send and never read
            conn = await RawStream.send(backend.base_url, "POST", "/v1/completions", body)
        try:
            if stream:
                assert conn.status == 200
                for _ in range(3):  # streaming tokens: it is running
                    assert await conn.next_chunk() is not None
            else:
                await asyncio.sleep(delay)
        finally:
            await conn.close()
        after = await poll(
            client,
            backend.base_url,
            lambda s: s.value(RUNNING) == 0 and s.value(WAITING) == 0,
            timeout_s=20,
            what="running back to 0 after the disconnect",
        )
        admitted = after.value("vllm:prompt_tokens_total") - before.value(
            "vllm:prompt_tokens_total"
        )
        if admitted > 0:
            break
    generated = after.value("vllm:generation_tokens_total") - before.value(
        "vllm:generation_tokens_total"
    )
    assert admitted > 0, "the request never reached the engine"
    assert generated < max_tokens, f"{generated} tokens: the request was not aborted"
    # Quirk 5: vLLM 0.32 does not count client aborts as finished requests.
    key = "vllm:request_success_total"
    assert after.value(key, finished_reason="abort") == before.value(key, finished_reason="abort")


async def _chat(
    client: httpx.AsyncClient, backend: Backend, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    return await _generate(client, backend, "/v1/chat/completions", max_tokens, messages=messages)


async def test_a_conversations_next_turn_hits_the_earlier_prompt(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """A chat client sends the answer back in the next turn, which then hits at least
    every whole block of the earlier prompt (the router's conversation affinity rests
    on it), and at most those of the earlier prompt and answer. The real tiny model
    hits exactly the earlier prompt's blocks (its random-weight answers do not
    re-encode to the ids it generated); the emulator, whose answers do, hits into the
    answer too, as a trained model's would (docs/emulator-fidelity.md, F15)."""
    first = [{"role": "user", "content": _prefix(f"chat-{backend.name}")}]
    a = await _chat(client, backend, first, 2 * BLOCK_SIZE)
    prompt_a, answer_a = a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]
    second = first + [
        {"role": "assistant", "content": a["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what is gamma?"},
    ]
    b = await _chat(client, backend, second, 1)
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert b["usage"]["prompt_tokens"] > prompt_a + answer_a
    assert prompt_a > 2 * BLOCK_SIZE
    assert prompt_a // BLOCK_SIZE * BLOCK_SIZE <= cached, (
        f"turn 2 hit {cached} tokens, not every whole block of turn 1's {prompt_a}-token prompt"
    )
    assert cached <= (prompt_a + answer_a) // BLOCK_SIZE * BLOCK_SIZE
