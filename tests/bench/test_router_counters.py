"""The router counters a priority benchmark reads: preemptions, resumes, wasted work."""

from __future__ import annotations

import httpx

from fleetgate.bench.runner import router_counters

EXPOSITION = """\
# HELP fleetgate_preemptions_total In-flight requests cancelled to make room.
# TYPE fleetgate_preemptions_total counter
fleetgate_preemptions_total{class="batch",model="m"} 3.0
fleetgate_preemptions_total{class="standard",model="m"} 1.0
# TYPE fleetgate_resumes_total counter
fleetgate_resumes_total{cause="preempted",class="batch",model="m"} 4.0
# TYPE fleetgate_resume_refed_tokens_total counter
fleetgate_resume_refed_tokens_total{class="batch",model="m"} 250.0
fleetgate_resume_refed_tokens_total{class="standard",model="m"} 50.0
fleetgate_resume_refed_tokens_created{class="batch",model="m"} 1.7e9
"""


async def _counters(text: str) -> dict[str, float]:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))
    async with httpx.AsyncClient(transport=transport) as client:
        return await router_counters(client, "http://127.0.0.1:1")


async def test_sums_every_label_set_of_each_counter() -> None:
    got = await _counters(EXPOSITION)
    assert got == {"preemptions": 4.0, "resumes": 4.0, "resume_refed_tokens": 300.0}


async def test_declared_counter_without_samples_is_zero_and_absent_one_is_missing() -> None:
    text = "# TYPE fleetgate_preemptions_total counter\n"
    assert await _counters(text) == {"preemptions": 0.0}
    assert await _counters("# a peer router's metrics\nsome_other_total 5\n") == {}
