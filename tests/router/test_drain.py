"""SIGTERM drains the router: no request fails (fleetgate/router/cli.py ``--drain-timeout``).

The router runs as a process (``fleetgate router``) in front of an emulated vLLM
whose streams last a few seconds.

* Under streaming load, SIGTERM closes the listener (new connections are refused at
  once), every stream already in flight runs to ``[DONE]`` with all its tokens, and
  the process exits 0 well within its drain timeout.
* A rolling restart as Kubernetes does it with the chart's preStop hook (the pod
  leaves the Service's endpoints, then gets SIGTERM; a new pod joins): two routers
  behind a client-side endpoint list, each restarted in turn under continuous
  streaming load, and not one request fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 60
#: the emulator's "test" profile at this time scale: ~20 ms per token, so a stream
#: lasts ~1.2 s (plus queueing)
TIME_SCALE = "20"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fleetgate", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "FLEETGATE_TEST_MODE": "1"},
        )


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, path: str = "/health") -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} did not come up: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "sim.log"
    proc = start(
        ["sim", "--vllm", "1", "--profile", "test", "--port", str(port), "--model", "m",
         "--time-scale", TIME_SCALE, "--max-num-seqs", "64", "--num-gpu-blocks", "2048"],
        log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, log)
        yield url
    finally:
        stop(proc)


def start_router(engine: str, tmp_path: Path, name: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    log = tmp_path / f"{name}.log"
    proc = start(
        ["router", "--port", str(port), "--backend", f"vllm={engine}", "--drain-timeout", "15"],
        log,
    )
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, log, "/metrics")
    return url, proc


async def stream(client: httpx.AsyncClient, url: str, first: asyncio.Event | None = None) -> int:
    """One streamed completion; returns its token count, raises on any failure."""
    body = {
        "model": "m",
        "prompt": "drain me",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            assert '"error"' not in line, line
            tokens += 1
            if first is not None:
                first.set()
    assert done, "stream ended without [DONE]"
    return tokens


async def test_sigterm_finishes_in_flight_streams_and_exits_0(engine: str, tmp_path: Path) -> None:
    url, proc = start_router(engine, tmp_path, "router")
    try:
        # a fresh connection per stream: what separate clients would have
        async with httpx.AsyncClient(
            timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
        ) as client:
            firsts = [asyncio.Event() for _ in range(24)]
            tasks = [asyncio.create_task(stream(client, url, f)) for f in firsts]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 20)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.ConnectError):  # the listener is closed at once
                await client.get(url + "/health")
            results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [r for r in results if not isinstance(r, int) or r < MAX_TOKENS]
        assert failed == [], failed
        rc = await asyncio.to_thread(proc.wait, 20)
        took = time.monotonic() - sent
    finally:
        stop(proc)
    assert rc == 0, (tmp_path / "router.log").read_text()
    assert took < 15, f"drain took {took:.1f} s"


async def test_rolling_restart_under_streaming_load_fails_no_request(
    engine: str, tmp_path: Path
) -> None:
    endpoints: list[str] = []
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("a", "b"):
        url, proc = start_router(engine, tmp_path, name)
        endpoints.append(url)
        procs[url] = proc
    done: list[int] = []
    errors: list[BaseException] = []
    stopping = asyncio.Event()

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            n = i
            while not stopping.is_set():
                n += 1
                try:
                    done.append(await stream(client, endpoints[n % len(endpoints)]))
                except BaseException as e:  # collected and reported, never swallowed
                    errors.append(e)

    loops = [asyncio.create_task(client_loop(i)) for i in range(8)]
    try:
        await asyncio.sleep(1.5)
        for generation in range(2):
            for old in list(endpoints):
                # the preStop window: the pod leaves the endpoints before its SIGTERM
                endpoints.remove(old)
                new, proc = await asyncio.to_thread(
                    start_router, engine, tmp_path, f"gen{generation}-{len(procs)}"
                )
                endpoints.append(new)
                procs[new] = proc
                await asyncio.sleep(0.5)
                old_proc = procs[old]
                old_proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(old_proc.wait, 20) == 0
                await asyncio.sleep(1.0)
    finally:
        stopping.set()
        await asyncio.gather(*loops)
        for proc in procs.values():
            stop(proc)
    assert errors == [], errors[:3]
    assert len(done) >= 16 and all(t == MAX_TOKENS for t in done), done


async def test_sigterm_ends_a_pending_held_long_poll(engine: str, tmp_path: Path) -> None:
    """An autoscaler's ``GET /held?wait=30`` in flight does not hold the drain up for
    its 30 s: SIGTERM answers it and the router exits 0 at once."""
    url, proc = start_router(engine, tmp_path, "router")
    try:
        async with httpx.AsyncClient(timeout=40) as client:
            poll = asyncio.create_task(client.get(url + "/held", params={"after": 0, "wait": 30}))
            await asyncio.sleep(0.3)
            assert not poll.done()
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            answer = await poll
            rc = await asyncio.to_thread(proc.wait, 20)
            took = time.monotonic() - sent
    finally:
        stop(proc)
    assert answer.status_code == 200 and answer.json() == {"generation": 0, "held": {}}
    assert rc == 0, (tmp_path / "router.log").read_text()
    assert took < 5, f"drain took {took:.1f} s with a /held poll open"
