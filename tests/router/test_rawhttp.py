"""RawUpstream's body idle timeout: one self-re-arming timer per response.

A stream whose chunks come more often than ``idle_timeout`` lives as long as
it streams (the timeout is per wait, not per response); a stall longer than
``idle_timeout`` while the reader waits ends it with ``UpstreamBroken``; a
reader that is slow itself (chunks already buffered) is never timed out.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetgate.router.rawhttp import RawUpstream
from fleetgate.router.upstream import UpstreamBroken

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Engine:
    """Answers every request with ``count`` chunks ``gap_s`` apart, then stalls or ends."""

    def __init__(self, count: int, gap_s: float, stall: bool) -> None:
        self.count, self.gap_s, self.stall = count, gap_s, stall
        self.writers: list[asyncio.StreamWriter] = []
        self.handlers: list[asyncio.Task[object]] = []
        self.stop = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.append(task)
        self.writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)  # the body: {}
        writer.write(HEAD)
        for n in range(self.count):
            writer.write(_chunk(b"data: %d\n\n" % n))
            await writer.drain()
            await asyncio.sleep(self.gap_s)
        if not self.stall:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        else:
            await self.stop.wait()


async def _run(
    engine: _Engine, idle_s: float, read_pause_s: float = 0.0
) -> tuple[list[bytes], float]:
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    up = RawUpstream(test_mode=True, connect_timeout=1, first_byte_timeout=1, idle_timeout=idle_s)
    got: list[bytes] = []
    t0 = time.monotonic()
    try:
        resp = await up.send(base, "/v1/completions", b"{}", [])
        try:
            async for chunk in resp.chunks():
                got.append(chunk)
                if read_pause_s:
                    await asyncio.sleep(read_pause_s)
        finally:
            await resp.aclose()
    finally:
        elapsed = time.monotonic() - t0
        await up.aclose()
        engine.stop.set()
        await asyncio.gather(*engine.handlers, return_exceptions=True)
        for w in engine.writers:
            w.close()
        server.close()
        await server.wait_closed()
    return got, elapsed


async def test_stream_longer_than_the_idle_timeout_is_not_cut() -> None:
    got, elapsed = await _run(_Engine(count=6, gap_s=0.1, stall=False), idle_s=0.3)
    assert b"".join(got) == b"".join(b"data: %d\n\n" % n for n in range(6))
    assert elapsed >= 0.5  # six gaps of 0.1 s: longer than one idle timeout


async def test_stall_ends_the_stream_after_the_idle_timeout() -> None:
    with pytest.raises(UpstreamBroken, match="no body bytes for 0.3s"):
        await _run(_Engine(count=2, gap_s=0.05, stall=True), idle_s=0.3)


async def test_stall_is_detected_on_time() -> None:
    t0 = time.monotonic()
    with pytest.raises(UpstreamBroken):
        await _run(_Engine(count=1, gap_s=0.0, stall=True), idle_s=0.4)
    elapsed = time.monotonic() - t0
    assert 0.4 <= elapsed < 1.5


async def test_a_slow_reader_with_buffered_chunks_is_not_timed_out() -> None:
    """The reader pauses longer than the idle timeout after each chunk; the engine sent
    everything at once, so no wait ever lasts that long."""
    got, _ = await _run(_Engine(count=4, gap_s=0.0, stall=False), idle_s=0.2, read_pause_s=0.3)
    assert len(b"".join(got).split(b"\n\n")) == 5
