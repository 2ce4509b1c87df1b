"""Two router replicas that share nothing agree on where a prefix lives, because both
read the same engines' KV events: a prefix cached through replica 1 attracts replica 2's
requests to the same engine (decision source ``events``), though replica 2 never saw
the first request.

Two emulated vLLM engines (in-process, real ZeroMQ, real HTTP), two router apps built
independently (``build_router`` twice) with the emulator's tokenizer.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import httpx

from fleetgate.router.app import build_router
from fleetgate.router.state import Fleet
from fleetgate.sim.fleet import run_fleet

from .test_exact_routing import SYSTEM, ask, chat, sched_config, shared_keys
from .test_kvfeed import BS, metric, until, vllm_spec


async def test_a_prefix_cached_through_one_replica_attracts_the_other() -> None:
    spec = vllm_spec(num_gpu_blocks=200, max_model_len=512)
    async with run_fleet([spec, spec], time_scale=0) as sim, AsyncExitStack() as stack:
        model = sim.engines[0].model
        apps = [build_router(sched_config(list(sim.engines))) for _ in range(2)]
        clients = []
        for app in apps:
            await stack.enter_async_context(app.router.lifespan_context(app))
            clients.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(
                        transport=httpx.ASGITransport(app=app), base_url="http://r", timeout=30
                    )
                )
            )
        fleets: list[Fleet] = [app.state.router.fleet for app in apps]
        await until(lambda: all(e.kv_feed.state == "live" for f in fleets for e in f),
                    "every replica's feeds live")  # fmt: skip
        one, two = clients
        metrics_two = apps[1].state.router.metrics

        first = await ask(one, model, chat(SYSTEM, "What is a pool?"))
        keys = shared_keys(SYSTEM).keys(BS)
        assert len(keys) >= 5
        # Replica 2 learns of the blocks from the engine, not from replica 1.
        await until(
            lambda: fleets[1].kv_index.match(first, keys) == len(keys),  # type: ignore[arg-type]
            "replica 2 indexed the prefix on the first engine",
        )
        other = next(eid for eid in fleets[1].endpoints if eid != first)
        assert fleets[1].kv_index.match(other, keys) == 0
        # Replica 2 has routed nothing yet: its own approximate guesses know nothing.
        assert metric(metrics_two, "fleetgate_decisions_total") == 0

        questions = ("What is a replica?", "How do I drain?", "What is a class?")
        for q in questions:
            assert await ask(two, model, chat(SYSTEM, q)) == first
        hits = metric(metrics_two, "fleetgate_decisions_total", reason="affinity-hit",
                      source="events")  # fmt: skip
        assert hits == len(questions)
        # The engine's own count agrees: replica 2's requests found the prefix cached.
        actual = metric(metrics_two, "fleetgate_actual_cached_tokens_total", source="events")
        assert actual >= len(questions) * (len(keys) - 1) * BS
