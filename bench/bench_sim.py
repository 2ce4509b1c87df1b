"""Emulator benchmarks: CPU per generated token, and the largest fleet one process drives.

Plain script (speed targets live here, never in timed tests)::

    .venv/bin/python bench/bench_sim.py [--quick]

The fleet runs as ``python -m fleetgate sim`` in a subprocess (exactly what
users and the conformance suite start) on 127.0.0.1; its CPU time is read from
``/proc/<pid>/stat``, so the load generator's own CPU is not counted. The load
generator is a lean raw-socket HTTP/1.1 client (one connection per request,
``Connection: close``) that counts SSE events.

A) CPU per token: one vLLM engine, ``test`` profile, ``--time-scale 0`` (no
   modelled sleeping: the engine runs as fast as the process can), 64 concurrent
   streaming requests of 128 tokens (``ignore_eos``), repeated; and the same
   non-streaming.
B) Fleet size: N vLLM engines (``vllm-llama8b-h100`` profile, real time), 64
   concurrent streams per engine, 64 tokens each. The process "keeps up" while its
   CPU stays under 85 % of one core (one event loop) and the batch takes at most
   1.5x as long as with one engine. N doubles until it does not keep up.
C) 16 engines x 64 streams (8B profile): the smallest ``--time-scale`` (model
   slowed down) at which the one process keeps up.
Everything is bounded in request count and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

HOST = "127.0.0.1"
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


@contextlib.contextmanager
def fleet(args: list[str]) -> Iterator[tuple[int, list[str]]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetgate", "sim", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        urls = []
        n = sum(int(args[i + 1]) for i, a in enumerate(args) if a in ("--vllm", "--trtllm"))
        deadline = time.monotonic() + 60
        while len(urls) < n and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"sim exited: {proc.stderr.read() if proc.stderr else ''}")
            urls.append(line.split()[1].removeprefix("url="))
        yield proc.pid, urls
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


async def request(url: str, body: dict[str, object], limit_s: float) -> int:
    """Send one completion; return the number of SSE data events (or 1 if not streamed)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )
    count = 0
    try:
        async with asyncio.timeout(limit_s):
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                count += data.count(b"data: ")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return count if body.get("stream") else 1


async def batch(urls: list[str], per_engine: int, body: dict[str, object], limit_s: float) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(request(u, body, limit_s) for u in urls for _ in range(per_engine)))
    return time.perf_counter() - t0


def scrape_tokens(urls: list[str]) -> float:
    import httpx

    total = 0.0
    for u in urls:
        text = httpx.get(u + "/metrics", timeout=10).text
        m = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
        total += float(m.group(1)) if m else 0.0
    return total


def bench_cpu_per_token(rounds: int) -> None:
    print("A) CPU per generated token (1 vLLM engine, profile test, --time-scale 0)")
    with fleet(["--vllm", "1", "--time-scale", "0", "--profile", "test"]) as (pid, urls):
        for stream in (True, False):
            body = {
                "prompt": "bench " * 20,
                "max_tokens": 128,
                "ignore_eos": True,
                "stream": stream,
            }
            tok0, cpu0, t0 = scrape_tokens(urls), cpu_seconds(pid), time.perf_counter()
            for _ in range(rounds):
                asyncio.run(batch(urls, 64, body, 60))
            wall = time.perf_counter() - t0
            cpu, tok = cpu_seconds(pid) - cpu0, scrape_tokens(urls) - tok0
            kind = "stream" if stream else "non-stream"
            print(
                f"   {kind:10s}: {tok:8.0f} tokens  server CPU {cpu:6.2f} s  "
                f"=> {1e6 * cpu / tok:6.1f} us CPU/token, {tok / wall:8.0f} tokens/s wall"
            )


def run_batch(n: int, profile: str, scale: float) -> tuple[float, float, float]:
    """(batch wall s, server and load-generator CPU shares of one core), n x 64 streams.

    Two batches per fleet; the faster one counts (the machine is shared, so a
    stall elsewhere must not be read as the emulator falling behind).
    """
    body = {"prompt": "fleet bench " * 30, "max_tokens": 64, "ignore_eos": True, "stream": True}
    args = ["--vllm", str(n), "--profile", profile, "--time-scale", str(scale)]
    best: tuple[float, float, float] | None = None
    with fleet(args) as (pid, urls):
        asyncio.run(batch(urls, 2, body, 120))  # warm up
        for _ in range(2):
            cpu0, t0, c0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
            wall = asyncio.run(batch(urls, 64, body, 300))
            elapsed = time.perf_counter() - t0
            util = (cpu_seconds(pid) - cpu0) / elapsed
            client = (time.process_time() - c0) / elapsed
            if best is None or wall < best[0]:
                best = (wall, util, client)
    assert best is not None
    return best


def bench_fleet_size(max_engines: int, profile: str) -> None:
    print(f"B) Largest fleet at 64 concurrent streams/engine ({profile}, real time)")
    base_wall = None
    n = 1
    best = 0
    while n <= max_engines:
        wall, util, client = run_batch(n, profile, 1.0)
        base_wall = base_wall or wall
        keeps_up = util < 0.85 and wall <= 1.5 * base_wall
        print(
            f"   engines={n:2d} streams={64 * n:5d}  batch wall {wall:6.2f} s "
            f"(x{wall / base_wall:4.2f} of 1 engine)  CPU server {100 * util:5.1f}%"
            f" client {100 * client:5.1f}%"
            f"  {'keeps up' if keeps_up else 'SATURATED'}"
        )
        if not keeps_up:
            break
        best = n
        n *= 2
    print(f"   => largest fleet that keeps up: {best} engines x 64 streams")


def bench_sixteen(profile: str) -> None:
    print(f"C) 16 engines x 64 streams ({profile}): slowest-down time scale that keeps up")
    for scale in (2.0, 4.0, 8.0, 16.0):
        one, _, _ = run_batch(1, profile, scale)
        wall, util, client = run_batch(16, profile, scale)
        ok = util < 0.85 and wall <= 1.5 * one
        print(
            f"   --time-scale {scale:4.1f}: 1 engine {one:6.2f} s, 16 engines {wall:6.2f} s "
            f"(x{wall / one:4.2f}), CPU server {100 * util:5.1f}% client {100 * client:5.1f}%  "
            f"{'keeps up' if ok else 'SATURATED'}"
        )
        if ok:
            break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, at most 4 engines")
    args = parser.parse_args()
    bench_cpu_per_token(2 if args.quick else 5)
    for profile in ("vllm-llama8b-h100", "vllm-llama70b-4xh100"):
        bench_fleet_size(4 if args.quick else 32, profile)
    if not args.quick:
        bench_sixteen("vllm-llama8b-h100")


if __name__ == "__main__":
    main()
