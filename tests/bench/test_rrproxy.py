"""The round-robin front of ``--router-replicas``: alternates connections, passes bytes."""

from __future__ import annotations

import asyncio

import pytest

from fleetgate_tools.bench import rrproxy


def test_round_robin_alternates_upstreams() -> None:
    rr = rrproxy.RoundRobin([("127.0.0.1", 1), ("127.0.0.1", 2)])
    assert [rr.next()[1] for _ in range(5)] == [1, 2, 1, 2, 1]
    with pytest.raises(ValueError, match="at least one"):
        rrproxy.RoundRobin([])


@pytest.mark.parametrize("bad", ["10.0.0.1:80", "example:80", "127.0.0.1", "127.0.0.1:x"])
def test_upstreams_must_be_loopback_host_port(bad: str) -> None:
    with pytest.raises(ValueError):
        rrproxy.parse_upstream(bad)
    assert rrproxy.parse_upstream("127.0.0.1:8000") == ("127.0.0.1", 8000)


def test_connections_alternate_between_two_servers_and_bytes_pass_both_ways() -> None:
    async def scenario() -> list[bytes]:
        async def named(tag: bytes) -> asyncio.Server:
            async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                data = await r.readline()
                w.write(tag + b":" + data)
                await w.drain()
                w.close()

            return await asyncio.start_server(handle, "127.0.0.1", 0)

        a, b = await named(b"A"), await named(b"B")
        rr = rrproxy.RoundRobin([("127.0.0.1", s.sockets[0].getsockname()[1]) for s in (a, b)])
        front = await asyncio.start_server(lambda r, w: rrproxy._handle(rr, r, w), "127.0.0.1", 0)
        port = front.sockets[0].getsockname()[1]
        answers = []
        for i in range(4):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"hello %d\n" % i)
            await w.drain()
            answers.append(await asyncio.wait_for(r.read(), 5.0))
            w.close()
        for s in (front, a, b):
            s.close()
            await s.wait_closed()
        return answers

    assert asyncio.run(scenario()) == [
        b"A:hello 0\n",
        b"B:hello 1\n",
        b"A:hello 2\n",
        b"B:hello 3\n",
    ]
