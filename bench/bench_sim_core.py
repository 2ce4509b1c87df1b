"""CPU cost of the emulator's pure engine models: microseconds of ``step()`` per generated token.

Runs 64 concurrent requests (512-token prompts sharing a 256-token prefix,
256 output tokens each, ignore_eos) through each engine model on the
calibrated H100 profiles and prints, per engine: steps, generated tokens,
CPU time spent inside ``step()`` (``time.process_time``), microseconds per
generated token, and the *modelled* throughput for comparison; plus the
shared tokenizer's encode/decode cost per token.

    .venv/bin/python bench/bench_sim_core.py [--requests 64] [--rounds 3]

Bounded: a fixed number of requests and rounds; no servers, no sockets.
"""

from __future__ import annotations

import argparse
import time

from fleetgate.sim.core import tokenizer
from fleetgate.sim.core.api import SimRequest
from fleetgate.sim.core.timing import build_engine_model

PROFILES = {"vllm": "vllm-llama8b-h100", "trtllm": "trtllm-llama8b-h100"}


def one_round(
    kind: str, requests: int, prompt_len: int, output_len: int
) -> tuple[int, int, float, float]:
    engine = build_engine_model(kind, PROFILES[kind], seed=1)
    shared = tokenizer.encode(" ".join(f"alpha{i} beta" for i in range(200)))[: prompt_len // 2]
    for i in range(requests):
        unique = [tokenizer.CHUNK_BASE + (i * 7919 + j * 31) % 18000 for j in range(prompt_len)]
        engine.add_request(
            SimRequest(
                request_id=f"b{i}",
                prompt_token_ids=(shared + unique)[:prompt_len],
                max_tokens=output_len,
                arrival_time=0.0,
                ignore_eos=True,
                seed=i,
            )
        )
    steps = tokens = 0
    modelled = 0.0
    cpu = 0.0
    now = 0.0
    while engine.has_work() and steps < 100_000:
        t0 = time.process_time()
        result = engine.step(now)
        cpu += time.process_time() - t0
        now += result.duration
        modelled += result.duration
        steps += 1
        tokens += sum(len(e.token_ids) for e in result.events)
    return steps, tokens, cpu, modelled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{args.requests} concurrent requests, prompt {args.prompt_len}, output {args.output_len},"
        f" best of {args.rounds} rounds"
    )
    text = " ".join(f"word{i} alpha beta, the model serves request {i}." for i in range(160))
    ids = tokenizer.encode(text)
    t0 = time.process_time()
    for _ in range(50):
        tokenizer.encode(text)
    encode_us = (time.process_time() - t0) / 50 / len(ids) * 1e6
    t0 = time.process_time()
    for _ in range(50):
        tokenizer.decode(ids)
    decode_us = (time.process_time() - t0) / 50 / len(ids) * 1e6
    print(
        f"tokenizer: {len(ids)} tokens, encode {encode_us:.2f} us/token,"
        f" decode {decode_us:.2f} us/token"
    )
    print(
        f"{'engine':8} {'steps':>6} {'tokens':>7} {'cpu_s':>7} {'us/token':>9} {'model tok/s':>12}"
    )
    for kind in PROFILES:
        best = min(
            (
                one_round(kind, args.requests, args.prompt_len, args.output_len)
                for _ in range(args.rounds)
            ),
            key=lambda r: r[2],
        )
        steps, tokens, cpu, modelled = best
        print(
            f"{kind:8} {steps:6d} {tokens:7d} {cpu:7.3f} {cpu / tokens * 1e6:9.2f}"
            f" {tokens / modelled:12.0f}"
        )


if __name__ == "__main__":
    main()
