"""The priority core end to end on a tiny deterministic fleet, all pure.

A discrete-time fake fleet (2 endpoints x 4 slots, one token per slot per
step, next token a pure function of the whole prefix, vLLM-shaped SSE events
with ``return_token_ids``) is driven by :func:`fleetgate.router.priority.policy.drain`,
the admission queue, continuations and the stream splicer, exactly as the
router is meant to wire them. A flood of ``batch`` requests from two tenants
fills the fleet; a burst of ``critical`` requests arrives. Checked:

* critical requests meet their TTFT objective only with preemption on;
* batch requests are preempted, parked, resumed from token ids, and every
  client byte stream equals the stream of an uninterrupted twin run;
* tenant fairness among the batch flood; one ``[DONE]`` per stream.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from fleetgate.router.priority.class_queue import QueueItem
from fleetgate.router.priority.config import PriorityConfig, resolve_class, resolve_tenant
from fleetgate.router.priority.continuation import build_continuation, upstream_body
from fleetgate.router.priority.policy import Dispatch, Preempt, drain
from fleetgate.router.priority.preemption import InFlight
from fleetgate.router.priority.queue import AdmissionQueue, Shed
from fleetgate.router.priority.saturation import SaturationThresholds, SaturationView
from fleetgate.router.priority.splice import StreamSplicer
from fleetgate.router.priority.wire import DONE, encode_json

DT = 0.05
SLOTS = 4
ENDPOINTS = ("e0", "e1")


def next_token(prefix: list[int]) -> int:
    return (sum(prefix) * 2654435761 + len(prefix) * 40503) % 2000


def sse_event(sse_id: str, tok: int, *, first_prompt: list[int] | None, finish: bool) -> bytes:
    ev = {
        "id": sse_id,
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": f" w{tok}",
                "logprobs": None,
                "finish_reason": "length" if finish else None,
                "stop_reason": None,
                "prompt_token_ids": first_prompt,
                "token_ids": [tok],
            }
        ],
    }
    return f"data: {encode_json(ev)}\n\n".encode()


def usage_event(sse_id: str, prompt: int, completion: int) -> bytes:
    ev = {
        "id": sse_id,
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        },
        "system_fingerprint": "fp",
    }
    return f"data: {encode_json(ev)}\n\n".encode()


@dataclasses.dataclass
class Job:
    rid: str
    sse_id: str
    prompt: list[int]
    max_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)

    def step(self) -> bytes:
        tok = next_token(self.prompt + self.generated)
        self.generated.append(tok)
        done = len(self.generated) == self.max_tokens
        out = sse_event(
            self.sse_id,
            tok,
            first_prompt=self.prompt if len(self.generated) == 1 else None,
            finish=done,
        )
        if done:
            out += usage_event(self.sse_id, len(self.prompt), len(self.generated)) + DONE
        return out


@dataclasses.dataclass
class Req:
    rid: str
    cls: str
    tenant: str
    arrival: float
    body: dict[str, Any]
    splicer: StreamSplicer
    client: bytes = b""
    first_byte_at: float | None = None
    done_at: float | None = None
    segments: int = 0
    preemptions: int = 0
    endpoint: str | None = None
    started_at: float = 0.0


def prompt_of(rid: str) -> list[int]:
    return [(ord(c) * 7 + i) % 2000 for i, c in enumerate(rid * 3)]


def twin_bytes(req: Req) -> bytes:
    """The client's bytes for an uninterrupted run of the same request."""
    job = Job(req.rid, f"cmpl-{req.rid}-0", list(req.body["prompt"]), req.body["max_tokens"])
    s = StreamSplicer("completions", include_usage=False, return_token_ids=False)
    out = b""
    for _ in range(job.max_tokens):
        out += s.feed(job.step())
    return out + s.finish()


def run_fleet(preemption: bool, scrape_every: int = 1) -> tuple[dict[str, Req], list[str], int]:
    """Run the scenario; engines are scraped every ``scrape_every`` ticks."""
    config = PriorityConfig(preemption_enabled=preemption)
    thresholds = SaturationThresholds()
    scraped: dict[str, tuple[float, int, int]] = {e: (0.0, 0, 0) for e in ENDPOINTS}
    queue: AdmissionQueue[Req] = AdmissionQueue(config)
    reqs: dict[str, Req] = {}
    jobs: dict[str, dict[str, Job]] = {e: {} for e in ENDPOINTS}
    arrivals: list[tuple[float, str, dict[str, str], int]] = []
    for i in range(40):
        tenant = "a" if i < 30 else "b"  # tenant b comes after a's whole flood
        arrivals.append(
            (0.0, f"b{i:02d}", {"x-fleetgate-priority": "batch", "x-fleetgate-tenant": tenant}, 60)
        )
    for i in range(6):
        arrivals.append((1.0 + i * DT, f"c{i}", {"x-fleetgate-priority": "critical"}, 10))
    batch_dispatch_order: list[str] = []
    shed = 0
    now = 0.0
    for tick in range(4000):  # bounded: 200 s of simulated time at most
        # 1. engines step: each running job produces one token
        for endpoint in ENDPOINTS:
            for rid, job in list(jobs[endpoint].items()):
                req = reqs[rid]
                out = req.splicer.feed(job.step())
                if out and req.first_byte_at is None:
                    req.first_byte_at = now
                req.client += out
                if len(job.generated) == job.max_tokens:
                    del jobs[endpoint][rid]
                    req.client += req.splicer.finish()
                    req.done_at = now
        # 2. arrivals
        for t, rid, headers, max_tokens in [a for a in arrivals if a[0] <= now + 1e-9]:
            arrivals.remove((t, rid, headers, max_tokens))
            cls = resolve_class(config, headers, {})
            body = {
                "model": "m",
                "prompt": prompt_of(rid),
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            req = Req(
                rid,
                cls.name,
                resolve_tenant(headers),
                now,
                body,
                StreamSplicer("completions", include_usage=False, return_token_ids=False),
            )
            reqs[rid] = req
            got = queue.offer(rid, cls, req.tenant, now, req)
            assert not isinstance(got, Shed)
        # 3. one drain step on the latest scrape, corrected by the router's count
        if tick % scrape_every == 0:
            scraped = {e: (now, len(jobs[e]), len(jobs[e])) for e in ENDPOINTS}
        views = [
            SaturationView(
                e,
                kv_usage=scraped[e][1] / SLOTS * 0.5,
                waiting=0,
                running=scraped[e][1],
                in_flight=len(jobs[e]),
                scrape_age_s=now - scraped[e][0],
                max_running=SLOTS,
                in_flight_at_scrape=scraped[e][2],
            )
            for e in ENDPOINTS
        ]
        in_flight = [
            InFlight(
                rid,
                e,
                reqs[rid].cls,
                config.get(reqs[rid].cls).level,
                prompt_tokens=len(reqs[rid].body["prompt"]),
                generated_tokens=reqs[rid].splicer.tokens,
                preemptions=reqs[rid].preemptions,
                started_at=reqs[rid].started_at,
            )
            for e in ENDPOINTS
            for rid in jobs[e]
        ]

        def views_for(
            item: QueueItem[Req], views: list[SaturationView] = views
        ) -> list[SaturationView]:
            return views

        def pick(item: QueueItem[Req], available: tuple[str, ...]) -> str:
            return min(available, key=lambda ep: (len(jobs[ep]), ep))

        for action in drain(
            queue,
            now,
            config=config,
            thresholds=thresholds,
            views_for=views_for,
            pick=pick,
            in_flight=in_flight,
        ):
            if isinstance(action, Shed):
                shed += 1
            elif isinstance(action, Preempt):
                victim = reqs[action.victim.request_id]
                del jobs[action.victim.endpoint][victim.rid]  # cancel upstream
                victim.preemptions += 1
                queue.park(
                    victim.rid, config.get(victim.cls), victim.tenant, victim.arrival, now, victim
                )
            else:
                assert isinstance(action, Dispatch)
                req = action.item.payload
                if req.cls == "batch" and req.segments == 0:
                    batch_dispatch_order.append(req.rid)
                if action.item.parked:
                    plan = build_continuation(
                        req.body,
                        "completions",
                        req.splicer.delivered(),
                        accepts_token_ids=True,
                        return_token_ids=True,
                    )
                    req.splicer.begin_continuation(plan.mode)
                    body = plan.body
                else:
                    body = upstream_body(req.body, return_token_ids=True)
                job = Job(
                    req.rid,
                    f"cmpl-{req.rid}-{req.segments}",
                    list(body["prompt"]),
                    body["max_tokens"],
                )
                req.segments += 1
                req.started_at = now
                jobs[action.endpoint][req.rid] = job
        if not arrivals and len(queue) == 0 and not any(jobs.values()):
            break
        now = round(now + DT, 9)
    return reqs, batch_dispatch_order, shed


@pytest.mark.parametrize("scrape_every", [1, 4], ids=["fresh-metrics", "scrape-every-200ms"])
@pytest.mark.parametrize("preemption", [True, False], ids=["preemption-on", "preemption-off"])
def test_critical_burst_over_batch_flood(preemption: bool, scrape_every: int) -> None:
    reqs, batch_order, shed = run_fleet(preemption, scrape_every)
    assert shed == 0
    assert all(r.done_at is not None for r in reqs.values()), "every request finished"
    critical = [r for r in reqs.values() if r.cls == "critical"]
    batch = [r for r in reqs.values() if r.cls == "batch"]
    ttft = [r.first_byte_at - r.arrival for r in critical if r.first_byte_at is not None]
    assert len(ttft) == len(critical) == 6
    objective = PriorityConfig().get("critical").ttft_objective_s
    preempted = [r for r in batch if r.preemptions]
    if preemption:
        assert max(ttft) <= objective, ttft
        assert len(preempted) >= 1
        assert all(r.preemptions <= 3 for r in batch)
    else:
        # the burst waits for a batch request to finish (60 tokens x 50 ms)
        assert min(ttft) > objective, ttft
        assert not preempted
    for r in reqs.values():
        assert r.client == twin_bytes(r), f"{r.rid} differs from its uninterrupted twin"
        assert r.client.count(b"data: [DONE]") == 1
        assert r.splicer.tokens == r.body["max_tokens"]
    # WFQ: tenant b arrived behind a's 30-request flood, yet shares the first dispatches
    first_wave = batch_order[: 2 * SLOTS]
    assert sum(1 for rid in first_wave if int(rid[1:]) >= 30) >= 3, first_wave
    texts = [
        json.loads(line[6:])["choices"][0]["text"]
        for r in preempted
        for line in r.client.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert all(t.startswith(" w") for t in texts)
