"""Bounded soak of the router: mixed traffic with a fault every minute (issue 14, section 4).

    FLEETGATE_TEST_MODE=1 python bench/bench_soak.py [--duration 1800] [--fault-every 60]
        [--engines 3] [--concurrency 8] [--json OUT.json]

Everything runs on 127.0.0.1 as separate processes: ``fleetgate sim`` engines (one
process each, so they can be stopped and killed) and ``fleetgate router`` (with the
default priority classes, ``timeouts.stream_idle_s`` at its defaults). Well-formed
clients send a mix of streamed and whole completions and chats in every class;
every ``--fault-every`` seconds the next fault of this cycle is injected:

1. an engine is SIGKILLed and restarted on its port 5 s later;
2. an engine is frozen (SIGSTOP) for 20 s, then continued (SIGCONT);
3. 50 clients disconnect mid-stream;
4. 200 malformed / hostile requests (bad JSON, wrong types, huge numbers, 1 MB of
   headers, text/plain) and 100 slow-loris connections.

Reported (stdout, and ``--json``): requests by outcome, well-formed requests that
failed (goal: 0 that a retry or resume could save: anything but 429 sheds and the
503s while every engine serving a model was down), the router's RSS every 10 s
(goal: flat) and its CPU seconds. A benchmark, not a test: docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

MODEL = "m"
HOST = "127.0.0.1"
CLASSES = ["critical", "standard", "standard", "batch", "sheddable"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLEETGATE_TEST_MODE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "fleetgate", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def engine(port: int) -> subprocess.Popen[bytes]:
    return spawn(["sim", "--vllm", "1", "--port", str(port), "--model", MODEL, "--profile",
                  "test", "--time-scale", "1"])  # fmt: skip


def proc_stats(pid: int) -> tuple[float, float]:
    """(RSS MiB, user+system CPU seconds) from /proc."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return rss, (int(fields[11]) + int(fields[12])) / tick


async def wait_http(url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=2) as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ports = [free_port() for _ in range(args.engines)]
        self.engines: list[subprocess.Popen[bytes]] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.outcomes: Counter[str] = Counter()
        self.failures: list[dict[str, Any]] = []
        self.samples: list[dict[str, float]] = []
        self.faults: list[dict[str, Any]] = []
        self.down_until = 0.0
        self.stop = asyncio.Event()
        self.rng = random.Random(args.seed)

    async def start(self, workdir: Path) -> None:
        self.engines = [engine(p) for p in self.ports]
        for p in self.ports:
            await wait_http(f"http://{HOST}:{p}/health")
        cfg = workdir / "router.yaml"
        backends = ", ".join(
            f'{{engine: vllm, url: "http://{HOST}:{p}", capacity: 8}}' for p in self.ports
        )
        cfg.write_text(
            f"test_mode: true\npools: [{{name: default, backends: [{backends}]}}]\npriority: {{}}\n"
        )
        port = free_port()
        self.router = spawn(["router", "--port", str(port), "--config", str(cfg)])
        self.url = f"http://{HOST}:{port}"
        await wait_http(self.url + "/ready")

    def close(self) -> None:
        for p in [*self.engines, *([self.router] if self.router else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.terminate()
        for p in [*self.engines, *([self.router] if self.router else [])]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    # -- traffic ------------------------------------------------------------------

    async def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        async with httpx.AsyncClient(timeout=120) as c:
            while not self.stop.is_set():
                stream = rng.random() < 0.6
                chat = rng.random() < 0.5
                cls = rng.choice(CLASSES)
                doc: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(4, 64),
                                       "stream": stream}  # fmt: skip
                text = f"client {i} question {rng.randint(0, 50)}: " + "context " * rng.randint(
                    1, 60
                )
                if chat:
                    doc["messages"] = [{"role": "user", "content": text}]
                else:
                    doc["prompt"] = text
                path = "/v1/chat/completions" if chat else "/v1/completions"
                t0 = time.monotonic()
                try:
                    r = await c.post(self.url + path, json=doc,
                                     headers={"x-fleetgate-priority": cls})  # fmt: skip
                    ok = r.status_code == 200 and (not stream or r.content.endswith(b"[DONE]\n\n"))
                    ok = ok and b'"error"' not in r.content[-400:]
                    key = "ok" if ok else f"status_{r.status_code}"
                    detail = r.text[-200:]
                except httpx.HTTPError as e:
                    key, detail = f"error_{type(e).__name__}", repr(e)
                self.outcomes[key] += 1
                if key != "ok":
                    excused = key == "status_429" or (
                        key == "status_503" and time.monotonic() < self.down_until
                    )
                    self.failures.append({"t": round(t0 - self.t0, 1), "class": cls,
                                          "stream": stream, "outcome": key,
                                          "excused": excused, "detail": detail[:200]})  # fmt: skip
                await asyncio.sleep(rng.uniform(0, 0.2))

    # -- faults ---------------------------------------------------------------------

    async def faults_loop(self) -> None:
        n = 0
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.args.fault_every)
            if self.stop.is_set():
                return
            kind = ["kill-restart", "freeze", "disconnects", "hostile"][n % 4]
            at = round(time.monotonic() - self.t0, 1)
            self.faults.append({"t": at, "fault": kind})
            print(f"[{at:7.1f}s] fault: {kind}", flush=True)
            n += 1
            victim = self.rng.randrange(len(self.engines))
            if kind == "kill-restart":
                self.engines[victim].kill()
                self.engines[victim].wait(10)
                await asyncio.sleep(5)
                self.engines[victim] = engine(self.ports[victim])
            elif kind == "freeze":
                os.kill(self.engines[victim].pid, signal.SIGSTOP)
                await asyncio.sleep(20)
                os.kill(self.engines[victim].pid, signal.SIGCONT)
            elif kind == "disconnects":
                await asyncio.gather(*(self.disconnect() for _ in range(50)))
            else:
                await self.hostile()

    async def disconnect(self) -> None:
        doc = {"model": MODEL, "prompt": "leave early " * 10, "max_tokens": 200, "stream": True}
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            async with httpx.AsyncClient(timeout=30) as c:
                async with c.stream("POST", self.url + "/v1/completions", json=doc) as r:
                    async for _ in r.aiter_raw():
                        break

    async def hostile(self) -> None:
        bad: list[tuple[bytes, dict[str, str]]] = [
            (b"{not json", {}),
            (b'{"model": "m", "max_tokens": 1' + b"0" * 400 + b"}", {}),
            (b'{"model": "m", "prompt": "\\ud800"}', {}),
            (b"[" * 100_000, {}),
            (b'{"model": "m", "stream_options": [1]}', {}),
            (b'{"model": "m", "prompt": "x"}', {"content-type": "text/plain"}),
            (b'{"model": "m", "prompt": "x"}', {"x-fleetgate-priority": "z" * 60_000}),
            (b'{"model": "m", "prompt": "x"}', {"x-big": "v" * 1_000_000}),
        ]
        async with httpx.AsyncClient(timeout=30) as c:
            for k in range(200):
                raw, h = bad[k % len(bad)]
                with contextlib.suppress(httpx.HTTPError):
                    r = await c.post(self.url + "/v1/completions", content=raw,
                                     headers={"content-type": "application/json", **h})  # fmt: skip
                    self.outcomes[f"hostile_{r.status_code}"] += 1
        host, port = self.url.removeprefix("http://").split(":")
        conns = []
        for _ in range(100):
            with contextlib.suppress(OSError):
                _, w = await asyncio.open_connection(host, int(port))
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                conns.append(w)
        await asyncio.sleep(15)  # the router's header timeout closes them
        for w in conns:
            w.close()

    # -- measuring -------------------------------------------------------------------

    async def sample_loop(self) -> None:
        assert self.router is not None
        while not self.stop.is_set():
            rss, cpu = proc_stats(self.router.pid)
            self.samples.append(
                {
                    "t": round(time.monotonic() - self.t0, 1),
                    "rss_mib": round(rss, 1),
                    "cpu_s": round(cpu, 2),
                }  # fmt: skip
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 10)

    async def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        tasks = [asyncio.ensure_future(self.client(i)) for i in range(self.args.concurrency)]
        tasks += [asyncio.ensure_future(self.faults_loop()),
                  asyncio.ensure_future(self.sample_loop())]  # fmt: skip
        await asyncio.sleep(self.args.duration)
        self.stop.set()
        await asyncio.wait(tasks, timeout=180)
        assert self.router is not None
        rss, cpu = proc_stats(self.router.pid)
        self.samples.append({"t": round(time.monotonic() - self.t0, 1), "rss_mib": round(rss, 1),
                             "cpu_s": round(cpu, 2)})  # fmt: skip
        unexcused = [f for f in self.failures if not f["excused"]]
        rss_series = [s["rss_mib"] for s in self.samples]
        half = rss_series[len(rss_series) // 2 :]
        return {
            "duration_s": self.args.duration,
            "engines": self.args.engines,
            "concurrency": self.args.concurrency,
            "outcomes": dict(self.outcomes),
            "well_formed_failed": len(self.failures),
            "well_formed_failed_unexcused": len(unexcused),
            "failures_sample": self.failures[:50],
            "faults": self.faults,
            "router_rss_mib": {
                "first": rss_series[0],
                "max": max(rss_series),
                "last": rss_series[-1],
                "second_half_growth": round(half[-1] - half[0], 1),
            },  # fmt: skip
            "router_cpu_s": self.samples[-1]["cpu_s"],
            "samples": self.samples,
        }


async def amain(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    soak = Soak(args)
    try:
        await soak.start(workdir)
        return await soak.run()
    finally:
        soak.close()


def main() -> int:
    if os.environ.get("FLEETGATE_TEST_MODE") != "1":
        print("set FLEETGATE_TEST_MODE=1 (everything runs on 127.0.0.1)", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (1800)")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8, help="well-formed clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the full report (with RSS/CPU samples) here")
    args = p.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = asyncio.run(amain(args, Path(tmp)))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
