"""The load generator's deadline accounting."""

from __future__ import annotations

import asyncio
import time

from fleetgate_tools.bench import loadgen
from fleetgate_tools.bench.workloads import Session, Turn


async def test_requests_in_flight_at_the_deadline_count_as_errors() -> None:
    """A server that accepts but never answers: the request must not vanish."""
    accepted: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read(65536)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sessions = [
            Session("a", 0.0, None, (Turn("q", 4),)),
            Session("late", 5.0, None, (Turn("q", 4),)),  # after the deadline: never sent
        ]
        t0 = time.monotonic()
        results = await loadgen.run_sessions(
            f"http://127.0.0.1:{port}", "m", sessions, deadline_s=0.5, send_until_s=0.3
        )
        assert time.monotonic() - t0 < 3.0
    finally:
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()
    assert [(r.session_id, r.error) for r in results] == [("a", "unfinished at deadline")]
    assert not results[0].ok


async def test_send_until_stops_follow_up_turns_but_never_scheduled_first_turns() -> None:
    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
        b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n'
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sessions = [
            Session("chat", 0.0, None, (Turn("q1", 1), Turn("q2", 1, think_s=0.4))),
            Session("late-first", 0.3, None, (Turn("q", 1),)),
        ]
        results = await loadgen.run_sessions(
            f"http://127.0.0.1:{port}", "m", sessions, deadline_s=5.0, send_until_s=0.2
        )
    finally:
        server.close()
        await server.wait_closed()
    got = sorted((r.session_id, r.turn, r.ok, r.output_tokens) for r in results)
    assert got == [("chat", 0, True, 1), ("late-first", 0, True, 1)]
