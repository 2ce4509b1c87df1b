"""What following every attention-DP rank buys: the engines' prefix-cache hit rate and
TTFT behind the router, on emulated TensorRT-LLM replicas of several ranks each.

    python bench/bench_adp.py [--engines 4] [--ranks 2] [--seeds 0,1,2] [--duration 20]
                              [--rate 30] [--docs 24] [--time-scale 1]

In one process and one event loop: the emulated fleet (``run_fleet``, TensorRT-LLM main,
``attention_dp_ranks`` ranks per replica, each rank 256 blocks of 32 tokens and 16
sequences) and the router app (``build_router``, called through ASGI). Requests: one of
``--docs`` 2048-token documents (Zipf 1.1) + a 64-token question, 32 tokens out,
streamed, Poisson arrivals at ``--rate`` per modelled second for ``--duration`` modelled
seconds. Contenders (the router's view of each replica):

* ``all ranks``: ``kv_events.ranks`` = the replica's ranks (fleetgate since 34767ed);
* ``rank 0``: ``ranks: 1``, one subscriber on the base ports (fleetgate before 34767ed);
* ``approximate``: no events (the router's own placement history).

Each against both engine-side rank choices: ``load`` (TensorRT-LLM's default
``DefaultADPRouter``) and ``cache`` (``enable_kv_cache_aware_routing``; the router scores
the best rank). Hit rate = sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of
prompt tokens; TTFT in modelled seconds (wall / time scale: the loop is shared, so
TTFTs are comparable between contenders of one run, not absolute). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

import httpx

from fleetgate.router.app import build_router
from fleetgate.router.config import parse_config
from fleetgate.sim.fleet import EngineSpec, RunningEngine, run_fleet

DOC_TOKENS = 2048
QUESTION_TOKENS = 64
OUT_TOKENS = 32
RANK_SHAPE = {"num_gpu_blocks": 256, "max_batch_size": 16, "max_model_len": 4096}


def workload(seed: int, docs: int, rate: float, duration: float) -> list[tuple[float, list[int]]]:
    """(arrival in modelled seconds, prompt token ids) per request."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(docs)]
    bodies = [[1000 + d * 7919 + i * 13 for i in range(DOC_TOKENS)] for d in range(docs)]
    out: list[tuple[float, list[int]]] = []
    t = rng.expovariate(rate)
    n = 0
    while t < duration:
        d = rng.choices(range(docs), weights)[0]
        question = [20 + (n * 131 + i * 7) % 900 for i in range(QUESTION_TOKENS)]
        out.append((t, [x % 30000 + 100 for x in bodies[d]] + question))
        t += rng.expovariate(rate)
        n += 1
    return out


def router_config(engines: list[RunningEngine], ranks: int | None, choice: str) -> Any:
    backends: list[dict[str, Any]] = []
    for e in engines:
        b: dict[str, Any] = {"engine": "trtllm", "url": e.url}
        if ranks is not None:
            assert e.kv_events is not None and e.kv_replay is not None
            b["kv_events"] = {
                "port": int(e.kv_events.rsplit(":", 1)[1]),
                "replay_port": int(e.kv_replay.rsplit(":", 1)[1]),
                "topic": "kv-events",
                "ranks": ranks,
                "rank_choice": choice,
            }
        backends.append(b)
    return parse_config({"test_mode": True, "pools": [{"name": "default", "backends": backends}]})


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], time_scale: float
) -> tuple[float, int, int]:
    """(TTFT in modelled seconds, cached prompt tokens, prompt tokens)."""
    start = time.monotonic()
    ttft = None
    cached = prompt_tokens = 0
    body = {"model": model, "prompt": prompt, "max_tokens": OUT_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = (time.monotonic() - start) / time_scale
            usage = chunk.get("usage")
            if usage:
                prompt_tokens = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (ttft if ttft is not None else float("nan")), cached, prompt_tokens


async def one_run(
    args: argparse.Namespace, seed: int, engine_cache: bool, contender: str
) -> dict[str, Any]:
    spec = EngineSpec(
        kind="trtllm",
        profile="trtllm-llama8b-h100",
        kv_events=contender != "approximate",
        overrides={**RANK_SHAPE, "attention_dp_ranks": args.ranks,
                   "adp_cache_routing": engine_cache},
    )  # fmt: skip
    requests = workload(seed, args.docs, args.rate, args.duration)
    async with run_fleet([spec] * args.engines, time_scale=args.time_scale, seed=seed) as sim:
        ranks = {"all ranks": args.ranks, "rank 0": 1, "approximate": None}[contender]
        choice = args.router_rank_choice
        if choice == "engine":
            choice = "cache" if engine_cache else "load"
        app = build_router(router_config(sim.engines, ranks, choice))
        model = sim.engines[0].model
        async with app.router.lifespan_context(app):
            fleet = app.state.router.fleet
            deadline = time.monotonic() + 20
            while ranks is not None and not all(e.kv_feed.state == "live" for e in fleet):
                if time.monotonic() > deadline:
                    raise RuntimeError("feeds not live")
                await asyncio.sleep(0.05)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://router", timeout=120
            ) as client:
                t0 = time.monotonic()

                async def fire(at: float, prompt: list[int]) -> tuple[float, int, int]:
                    await asyncio.sleep(max(0.0, t0 + at * args.time_scale - time.monotonic()))
                    return await one_request(client, model, prompt, args.time_scale)

                results = await asyncio.gather(*(fire(at, p) for at, p in requests))
    ttfts = sorted(r[0] for r in results)
    hit = sum(r[1] for r in results) / max(1, sum(r[2] for r in results))
    return {
        "seed": seed,
        "engine_choice": "cache" if engine_cache else "load",
        "contender": contender,
        "requests": len(results),
        "hit_rate": hit,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    modes = {"both": (False, True), "load": (False,), "cache": (True,)}[args.engine_choice]
    for engine_cache in modes:
        for seed in (int(s) for s in args.seeds.split(",")):
            for contender in args.contenders.split(","):
                row = await one_run(args, seed, engine_cache, contender)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    os.environ.setdefault("FLEETGATE_TEST_MODE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--duration", type=float, default=20.0, help="modelled seconds of arrivals")
    ap.add_argument("--rate", type=float, default=30.0, help="requests per modelled second")
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument(
        "--router-rank-choice",
        choices=("engine", "load", "cache"),
        default="engine",
        help="how the router scores a replica's ranks (engine: as the engine places them)",
    )
    ap.add_argument("--engine-choice", choices=("both", "load", "cache"), default="both")
    ap.add_argument("--contenders", default="all ranks,rank 0,approximate")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print("\n| engine rank choice | router view | hit rate (per seed) | TTFT p90 s (per seed) |")
    print("|---|---|---|---|")
    for choice in ("load", "cache"):
        for contender in ("all ranks", "rank 0", "approximate"):
            sel = [r for r in rows if r["engine_choice"] == choice and r["contender"] == contender]
            hits = " / ".join(f"{100 * r['hit_rate']:.1f}%" for r in sel)
            p90 = " / ".join(f"{r['ttft_p90']:.3f}" for r in sel)
            print(f"| {choice} | {contender} | {hits} | {p90} |")


if __name__ == "__main__":
    main()
