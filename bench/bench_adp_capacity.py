"""What counting every attention-DP rank's slots buys behind the class queue: TTFT and
refusals on emulated TensorRT-LLM replicas of several ranks each.

    python bench/bench_adp_capacity.py [--engines 2] [--ranks 4] [--slots 4] [--load 0.4]
                                       [--seeds 0,1,2] [--duration 20] [--time-scale 4]

TensorRT-LLM reports one rank's ``maxNumActiveRequests`` and KV blocks (rank 0's) for
a replica with ``enable_attention_dp``. Contenders, each over the same arrivals:

* ``per rank x ranks``: the backend's ``schedulers`` = its ranks (fleetgate since
  3d58e68): a replica holds the reported limit once per rank;
* ``one rank``: ``schedulers: 1``, the reported limit read as the replica's (fleetgate
  before 3d58e68).

In one process and one event loop: the emulated fleet (``run_fleet``, TensorRT-LLM main,
``--ranks`` ranks of ``--slots`` sequences each per replica) and the router app with a
``priority:`` section (its class queue admits a request only while the pool is not
saturated), called through ASGI. Requests: 512 distinct prompt tokens, 64 out, streamed,
Poisson arrivals at ``--load`` x the fleet's slots / the modelled service time of one
request, for ``--duration`` modelled seconds. A request the router refuses (503: it
waited in the class queue past the class's limit, 30 s by default) is counted, not
timed. TTFT in modelled seconds (wall / time
scale; the loop is shared, so compare contenders of one run, not absolute values).
Loopback only.
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

PROMPT_TOKENS = 512
OUT_TOKENS = 64
CONTENDERS = ("per rank x ranks", "one rank")


def arrivals(seed: int, rate: float, duration: float) -> list[tuple[float, list[int]]]:
    """(arrival in modelled seconds, prompt token ids), prompts distinct (no reuse)."""
    rng = random.Random(seed)
    out: list[tuple[float, list[int]]] = []
    t = rng.expovariate(rate)
    while t < duration:
        n = len(out)
        out.append((t, [100 + (n * 7919 + i * 31) % 29000 for i in range(PROMPT_TOKENS)]))
        t += rng.expovariate(rate)
    return out


def router_config(engines: list[RunningEngine], schedulers: int, capacity: int) -> Any:
    """``capacity`` the replica's (as discovery gives it from the InferenceService)."""
    backends = [
        {"engine": "trtllm", "url": e.url, "schedulers": schedulers, "capacity": capacity}
        for e in engines
    ]
    return parse_config(
        {"test_mode": True, "pools": [{"name": "default", "backends": backends}], "priority": {}}
    )


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], time_scale: float
) -> float | None:
    """TTFT in modelled seconds; None when the router refused it with a 503 (its class
    queue's wait limit: ``priority.classes.<class>.max_queue_wait_s``)."""
    start = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": OUT_TOKENS, "stream": True,
            "ignore_eos": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 503:
            await r.aread()
            return None
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        ttft = float("nan")
        async for line in r.aiter_lines():
            if ttft != ttft and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    ttft = (time.monotonic() - start) / time_scale
    return ttft


async def one_run(
    args: argparse.Namespace, seed: int, contender: str, rate: float | None
) -> dict[str, Any]:
    """One contender over seed's arrivals at ``rate`` (None: measured here from one
    request alone, ``--load`` x the slots over its service time)."""
    spec = EngineSpec(
        kind="trtllm",
        profile="trtllm-llama8b-h100",
        overrides={"attention_dp_ranks": args.ranks, "max_batch_size": args.slots,
                   "num_gpu_blocks": 1024, "max_model_len": 4096},
    )  # fmt: skip
    async with run_fleet([spec] * args.engines, time_scale=args.time_scale, seed=seed) as sim:
        schedulers = args.ranks if contender == CONTENDERS[0] else 1
        app = build_router(router_config(sim.engines, schedulers, args.ranks * args.slots))
        model = sim.engines[0].model
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://r", timeout=300) as client,
        ):
            # one request alone: it also makes the engines report their limits (their
            # Prometheus gauges are set when a request completes)
            probe = [7 + i % 900 for i in range(PROMPT_TOKENS)]
            t_probe = time.monotonic()
            for _ in range(args.engines):
                await one_request(client, model, probe, args.time_scale)
            service = (time.monotonic() - t_probe) / args.time_scale / args.engines
            if rate is None:
                rate = args.load * args.engines * args.ranks * args.slots / service
            plan = arrivals(seed, rate, args.duration)
            t0 = time.monotonic()

            async def fire(at: float, prompt: list[int]) -> float | None:
                await asyncio.sleep(max(0.0, t0 + at * args.time_scale - time.monotonic()))
                return await one_request(client, model, prompt, args.time_scale)

            answers = await asyncio.gather(*(fire(at, p) for at, p in plan))
            wall = (time.monotonic() - t0) / args.time_scale
    ttfts = [t for t in answers if t is not None]
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [float("nan")] * 9
    return {
        "seed": seed,
        "contender": contender,
        "requests": len(answers),
        "refused_503": len(answers) - len(ttfts),
        "rate": rate,
        "service_s": service,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": q[8],
        "makespan_s": wall,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for seed in args.seeds:
        rate = None
        for contender in CONTENDERS:
            row = await one_run(args, seed, contender, rate)
            rate = row["rate"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4, help="max_batch_size of each rank")
    parser.add_argument("--load", type=float, default=0.4, help="of the fleet's slots")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")],
                        default=[0, 1, 2])  # fmt: skip
    parser.add_argument("--duration", type=float, default=20.0, help="modelled seconds")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="wall seconds per modelled second (router and emulator share "
                        "one loop: at 1 the loop, not the engines, sets the TTFT)")  # fmt: skip
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    if os.environ.get("FLEETGATE_TEST_MODE") != "1":
        parser.error("export FLEETGATE_TEST_MODE=1 (loopback only)")
    rows = asyncio.run(main_async(args))
    print(
        "\n| contender | TTFT p50 s (per seed) | TTFT p90 s (per seed) | requests | refused (503) |"
    )
    print("|---|---|---|---|---|")
    for contender in CONTENDERS:
        sel = [r for r in rows if r["contender"] == contender]
        p50 = " / ".join(f"{r['ttft_p50']:.3f}" for r in sel)
        p90 = " / ".join(f"{r['ttft_p90']:.3f}" for r in sel)
        n = " / ".join(str(r["requests"]) for r in sel)
        refused = " / ".join(str(r["refused_503"]) for r in sel)
        print(f"| {contender} | {p50} | {p90} | {n} | {refused} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
