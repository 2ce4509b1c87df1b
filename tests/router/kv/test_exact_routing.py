"""The exact prefix view end to end: chat requests become the engine's token ids (the
emulator's tokenizer), the engines publish KV events, the router indexes them and
routes on them, and an evicted prefix stops attracting requests.

Two emulated vLLM engines (in-process, real ZeroMQ, real HTTP), one router app with
``scheduling.tokenizers: {MODEL: {kind: emulator}}`` and each backend's ``kv_events``.
"""

from __future__ import annotations

from typing import Any

import httpx

from fleetgate.router.app import build_router
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.state import Fleet
from fleetgate.sim.core import tokenizer as sim_tokenizer
from fleetgate.sim.fleet import run_fleet

from .test_kvfeed import BS, config, metric, until, vllm_spec, zmq_backend

SYSTEM = "You are a careful assistant for the fleet handbook. " * 12  # ~100 tokens


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def sched_config(engines: list[Any]) -> Any:
    cfg = config([zmq_backend(e) for e in engines])
    model = engines[0].model
    doc = cfg.model_dump(mode="json", exclude_none=True)
    doc["scheduling"]["tokenizers"] = {model: {"kind": "emulator"}}
    return type(cfg).model_validate(doc)


async def ask(c: httpx.AsyncClient, model: str, messages: list[dict[str, str]]) -> str:
    r = await c.post(
        "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    return r.headers["x-fleetgate-endpoint"]


def shared_keys(system: str) -> PromptKeys:
    """The token ids every question with this system prompt starts with."""
    return PromptKeys(sim_tokenizer.encode_chat(chat(system, "")[:1], add_generation_prompt=False))


async def test_routes_on_resident_blocks_and_an_evicted_prefix_stops_attracting() -> None:
    # 40 blocks of 16 tokens each: the ~100-token system prompt (6 blocks) and a few
    # questions fit; 12 unrelated long prompts evict it.
    spec = vllm_spec(num_gpu_blocks=40, max_model_len=512)
    async with run_fleet([spec, spec], time_scale=0) as sim:
        app = build_router(sched_config(list(sim.engines)))
        fleet: Fleet = app.state.router.fleet
        metrics = app.state.router.metrics
        model = sim.engines[0].model
        async with app.router.lifespan_context(app):
            await until(lambda: all(e.kv_feed.state == "live" for e in fleet), "feeds live")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://router", timeout=30
            ) as c:
                first = await ask(c, model, chat(SYSTEM, "What is a pool?"))
                keys = shared_keys(SYSTEM)
                blocks = len(keys.keys(BS))
                assert blocks >= 5
                await until(
                    lambda: fleet.kv_index.match(first, keys.keys(BS)) == blocks,  # type: ignore[arg-type]
                    "the system prompt's blocks indexed on the first engine",
                )
                # Questions sharing the system prompt follow its resident blocks.
                for q in ("What is a replica?", "How do I drain?", "What is a class?"):
                    assert await ask(c, model, chat(SYSTEM, q)) == first
                hits = metric(metrics, "fleetgate_decisions_total", reason="affinity-hit",
                              source="events")  # fmt: skip
                assert hits >= 3
                # The closed loop: the engine's own cached_tokens agree with the prediction.
                predicted = metric(metrics, "fleetgate_predicted_cached_tokens_total",
                                   source="events")  # fmt: skip
                actual = metric(metrics, "fleetgate_actual_cached_tokens_total", source="events")
                assert actual > 0 and abs(predicted - actual) <= 0.05 * predicted

                # Evict it: long unrelated prompts straight to that engine (not through
                # the router, so the router's own guesses cannot know).
                engine = next(e for e in sim.engines if e.url == fleet.endpoints[first].url)  # type: ignore[index]
                async with httpx.AsyncClient(base_url=engine.url, timeout=30) as direct:
                    for i in range(12):
                        other = chat(f"Unrelated manual number {i}. " * 25, "Go on.")
                        r = await direct.post(
                            "/v1/chat/completions",
                            json={"model": model, "messages": other, "max_tokens": 2},
                        )
                        assert r.status_code == 200, r.text
                await until(
                    lambda: fleet.kv_index.match(first, keys.keys(BS)) == 0,  # type: ignore[arg-type]
                    "the evicted system prompt left the index",
                )
                cold_before = metric(metrics, "fleetgate_decisions_total", reason="cold")
                await ask(c, model, chat(SYSTEM, "Is it still cached?"))
                # No engine holds the prefix now: the decision is a cold placement, not
                # an affinity hit on the engine that used to hold it.
                assert metric(metrics, "fleetgate_decisions_total", reason="cold") == (
                    cold_before + 1
                )
