"""Router replicas that share nothing agree on where a prefix lives, because both
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
from fleetgate.sim.fleet import EngineSpec, run_fleet

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


async def test_three_replicas_agree_on_every_decision_over_mixed_engine_streams() -> None:
    """Three replicas, three engines: two TensorRT-LLM (its own ZeroMQ stream, line main)
    and one vLLM. Each prefix is cached on a different engine; afterwards every replica
    sends every follow-up of every prefix to the engine that holds it, from the
    engines' events alone (no replica saw the requests that cached them)."""
    trt = EngineSpec(kind="trtllm", kv_events=True,
                     overrides={"tokens_per_block": BS, "num_gpu_blocks": 200,
                                "max_model_len": 512})  # fmt: skip
    specs = [trt, trt, vllm_spec(num_gpu_blocks=200, max_model_len=512)]
    async with run_fleet(specs, time_scale=0) as sim, AsyncExitStack() as stack:
        assert all(e.kv_events is not None for e in sim.engines), "all three stream over ZeroMQ"
        model = sim.engines[0].model
        apps = [build_router(sched_config(list(sim.engines))) for _ in range(3)]
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
        assert {e.engine for e in fleets[0]} == {"trtllm", "vllm"}

        systems = [f"Handbook {n}: you answer questions about part {n} of the fleet. " * 10
                   for n in ("one", "two", "three")]  # fmt: skip
        # Each prefix is cached on its own engine by a request no replica sees (sent to
        # the engine directly): 0 and 1 on the TensorRT-LLM engines, 2 on vLLM.
        owners: dict[str, str] = {}
        for i, (system, eng) in enumerate(zip(systems, sim.engines, strict=True)):
            async with httpx.AsyncClient(base_url=eng.url, timeout=30, trust_env=False) as direct:
                r = await direct.post("/v1/chat/completions", json={
                    "model": model, "messages": chat(system, "Where do I start?"),
                    "max_tokens": 2})  # fmt: skip
                assert r.status_code == 200, r.text
            owner = next(e.id for e in fleets[0] if e.url == eng.url)
            owners[system] = owner
            keys = shared_keys(system).keys(BS)
            assert len(keys) >= 5
            await until(
                lambda: all(f.kv_index.match(owner, keys) == len(keys) for f in fleets),  # noqa: B023
                f"every replica indexed prefix {i} on {owner}",
            )
        assert len(set(owners.values())) == 3
        decided: dict[tuple[int, str], list[str]] = {}
        for system in systems:
            for q in ("What is a replica?", "How do I drain?"):
                decided[(systems.index(system), q)] = [
                    await ask(c, model, chat(system, q)) for c in clients
                ]
        for (i, q), endpoints in decided.items():
            assert endpoints == [owners[systems[i]]] * 3, (i, q, endpoints)
        for n, app in enumerate(apps):
            hits = metric(app.state.router.metrics, "fleetgate_decisions_total",
                          reason="affinity-hit", source="events")  # fmt: skip
            assert hits == len(decided), f"replica {n}: {hits} event-backed affinity hits"
