"""A tiny loopback round-robin TCP front for router replicas (``--router-replicas``).

``python -m fleetgate_tools.bench.rrproxy --port P --upstream 127.0.0.1:A
--upstream 127.0.0.1:B`` listens on 127.0.0.1:P and hands each accepted TCP
connection to the next upstream in turn, then copies bytes both ways until
either side closes. It is protocol-blind (HTTP/1.1 keep-alive and streaming
pass through untouched), so every contender's replicas sit behind the same
front. Balancing is per connection, as a Kubernetes Service (kube-proxy) does:
requests on one kept-alive connection stay on one replica, and the load
generator spreads its requests over many connections. It prints
``rrproxy listening on 127.0.0.1:P`` once ready. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import signal
import sys

BUFFER = 64 * 1024


def parse_upstream(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--upstream {text!r}: expected HOST:PORT")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"--upstream {text!r}: only loopback upstreams")
    return host, int(port)


class RoundRobin:
    """The upstream for each new connection, in turn (pure)."""

    def __init__(self, upstreams: list[tuple[str, int]]) -> None:
        if not upstreams:
            raise ValueError("need at least one upstream")
        self._cycle = itertools.cycle(upstreams)

    def next(self) -> tuple[str, int]:
        return next(self._cycle)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(BUFFER):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


async def _handle(
    rr: RoundRobin, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
) -> None:
    host, port = rr.next()
    try:
        up_r, up_w = await asyncio.open_connection(host, port)
    except OSError:
        client_w.close()
        return
    try:
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
    finally:
        for w in (up_w, client_w):
            w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


async def serve(port: int, upstreams: list[tuple[str, int]]) -> None:
    rr = RoundRobin(upstreams)
    server = await asyncio.start_server(
        lambda r, w: _handle(rr, r, w), "127.0.0.1", port, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        bound = server.sockets[0].getsockname()[1]
        print(f"rrproxy listening on 127.0.0.1:{bound}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rrproxy", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", action="append", required=True, help="HOST:PORT (repeat)")
    args = p.parse_args(argv)
    try:
        upstreams = [parse_upstream(u) for u in args.upstream]
    except ValueError as e:
        print(f"rrproxy: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(args.port, upstreams))
    return 0


if __name__ == "__main__":
    sys.exit(main())
