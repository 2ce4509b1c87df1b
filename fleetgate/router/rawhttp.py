"""A lean HTTP/1.1 client for the request path and the poller: :class:`RawUpstream`.

A minimal client on asyncio protocols and the ``httptools`` C parser (the one
uvicorn uses), with a keep-alive pool per endpoint. It exists because
httpx/httpcore/anyio/h11 cost ~1 ms of CPU per proxied request in profiles
(bench/bench_router_overhead.py ``--profile``), several times the rest of the
router. Sockets get ``TCP_NODELAY``; a response body arrives as the chunks the
engine wrote.

The body idle timeout (no byte for ``idle_timeout`` while the reader waits) is
one timer per response that re-arms itself, not an ``asyncio.timeout`` per
chunk: a streamed token costs no timer set-up and tear-down (measured ~10 us of
CPU per chunk in profiles of streams).

It implements ``upstream.Upstream`` and raises the ``upstream`` errors. Test mode:
a non-loopback host is refused before any socket is opened.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

from fleetgate.router.config import is_loopback_host
from fleetgate.router.upstream import (
    Headers,
    NonLoopbackUpstream,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)

_MAX_BUFFER = 1 << 20


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: Headers = []
        self.head: asyncio.Future[None] | None = None
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.wait_since = 0.0
        """Loop time at which the reader began waiting on ``waiter``."""
        self.complete = False
        self.received = False
        self.error: UpstreamError | None = None
        self.paused = False
        self.keep_alive = False
        self.eof_ends_body = False
        """GET only: a body without Content-Length or chunked framing ends at EOF."""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; same interface.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamBroken(f"bad HTTP from upstream: {e}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.status and self.eof_ends_body and exc is None:
            # a close-delimited body (HTTP/1.0 style) is complete at EOF
            names = {k.lower() for k, _ in self.headers}
            if not names & {b"content-length", b"transfer-encoding"}:
                self.complete = True
                self._wake()
                return
        if not self.complete:
            err: UpstreamError = (
                UpstreamBroken("upstream closed the connection mid-response")
                if self.status
                else UpstreamConnectError("upstream closed the connection before answering")
            )
            self._fail(err)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # Ask now: after the message completes llhttp's flags are reset for the next one.
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _MAX_BUFFER and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        if self.error is None:
            self.error = err
        if self.head is not None and not self.head.done():
            self.head.set_exception(err)
        self._wake()

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
            and self.keep_alive
        )


class _IdleTimeout(Exception):
    """The body idle watchdog fired (internal to :meth:`_RawResponse.chunks`)."""


class _RawResponse:
    def __init__(self, pool: RawUpstream, conn: _Conn, idle_s: float) -> None:
        self.pool = pool
        self.conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self.idle_s = idle_s
        self.released = False

    def content_type(self) -> bytes:
        for k, v in self.headers:
            if k.lower() == b"content-type":
                return v
        return b""

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self.conn
        loop = asyncio.get_running_loop()
        idle_s = self.idle_s
        watchdog: asyncio.TimerHandle | None = None

        def watch() -> None:
            # Fires at most once per idle_s; exact: a wait never outlives its deadline.
            nonlocal watchdog
            watchdog = None
            if self.released:  # the response was closed: nothing to watch any more
                return
            now = loop.time()
            waiter = conn.waiter
            if waiter is not None and not waiter.done():
                deadline = conn.wait_since + idle_s
                if now >= deadline:
                    waiter.set_exception(_IdleTimeout())
                    return
                watchdog = loop.call_at(deadline, watch)
            else:  # not waiting: any later wait ends after now + idle_s
                watchdog = loop.call_at(now + idle_s, watch)

        try:
            while True:
                if conn.body:
                    chunk = conn.body.popleft()
                    conn.buffered -= len(chunk)
                    if conn.paused and conn.buffered < _MAX_BUFFER // 2 and conn.transport:
                        conn.paused = False
                        conn.transport.resume_reading()
                    yield chunk
                    continue
                if conn.complete:
                    return
                if conn.error is not None:
                    raise conn.error
                conn.waiter = loop.create_future()
                conn.wait_since = loop.time()
                if watchdog is None:
                    watchdog = loop.call_at(conn.wait_since + idle_s, watch)
                try:
                    await conn.waiter
                except _IdleTimeout:
                    raise UpstreamBroken(f"no body bytes for {idle_s}s") from None
                finally:
                    conn.waiter = None
        finally:
            if watchdog is not None:
                watchdog.cancel()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def aclose(self) -> None:
        if self.released:
            return
        self.released = True
        self.pool.release(self.conn)


class RawUpstream:
    """Keep-alive pools per (host, port); ``max_idle`` idle connections kept per endpoint."""

    def __init__(
        self,
        *,
        test_mode: bool,
        connect_timeout: float,
        first_byte_timeout: float,
        idle_timeout: float,
        max_idle: int = 512,
    ) -> None:
        self.test_mode = test_mode
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._keys: dict[str, tuple[str, int, bytes]] = {}

    def _key(self, base: str) -> tuple[str, int, bytes]:
        key = self._keys.get(base)
        if key is None:
            parts = urlsplit(base)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamConnectError(f"only http:// backends are supported: {base!r}")
            host = parts.hostname
            port = parts.port or 80
            if self.test_mode and not is_loopback_host(host):
                raise NonLoopbackUpstream(f"test mode: refusing non-loopback backend {host!r}")
            netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            key = self._keys[base] = (host, port, netloc.encode())
        return key

    async def _connect(self, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, proto = await loop.create_connection(lambda: _Conn((host, port)), host, port)
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {host}:{port} timed out") from None
        except OSError as e:
            raise UpstreamConnectError(f"connect to {host}:{port}: {e.strerror or e}") from None
        return proto

    async def send(self, base: str, path: str, body: bytes, headers: Headers) -> UpstreamResponse:
        host, port, netloc = self._key(base)
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nhost: ", netloc, b"\r\n"]
        for k, v in headers:
            head += [k, b": ", v, b"\r\n"]
        head += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        return await self._request(host, port, b"".join(head))

    async def get(self, url: str, within_s: float) -> tuple[int, bytes]:
        """``GET url`` (``http://host:port/path``): status and the whole body within
        ``within_s`` seconds. For the poller's scrapes and probes: ~0.1 ms of CPU where
        httpx spends ~1 ms (module docstring)."""
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        host, port, netloc = self._key(base)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        payload = b"".join((b"GET ", path.encode(), b" HTTP/1.1\r\nhost: ", netloc, b"\r\n\r\n"))
        try:
            async with asyncio.timeout(within_s):
                resp = await self._request(host, port, payload, eof_ends_body=True)
                try:
                    return resp.status, await resp.read()
                finally:
                    await resp.aclose()
        except TimeoutError:
            raise UpstreamTimeout(f"GET {url}: no complete answer in {within_s}s") from None

    async def _request(
        self, host: str, port: int, payload: bytes, *, eof_ends_body: bool = False
    ) -> UpstreamResponse:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            try:
                return await self._exchange(conn, payload, eof_ends_body)
            except UpstreamConnectError:
                continue  # a stale keep-alive connection: nothing was answered, try afresh
        conn = await self._connect(host, port)
        return await self._exchange(conn, payload, eof_ends_body)

    async def _exchange(
        self, conn: _Conn, payload: bytes, eof_ends_body: bool = False
    ) -> UpstreamResponse:
        conn._reset()
        conn.eof_ends_body = eof_ends_body
        conn.parser = httptools.HttpResponseParser(conn)
        head = conn.head = asyncio.get_running_loop().create_future()
        assert conn.transport is not None
        conn.transport.write(payload)
        try:
            async with asyncio.timeout(self.first_byte_timeout):
                await head
        except TimeoutError:
            conn.transport.close()
            raise UpstreamTimeout(f"no response headers in {self.first_byte_timeout}s") from None
        except BaseException:
            conn.transport.close()
            raise
        return _RawResponse(self, conn, self.idle_timeout)

    def idle_connections(self) -> int:
        """Keep-alive connections waiting in the pools (for tests and metrics)."""
        return sum(len(conns) for conns in self._idle.values())

    def release(self, conn: _Conn) -> None:
        if conn.reusable:
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
                return
        if conn.transport is not None:
            conn.transport.close()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
