"""The one shared upstream HTTP client: keep-alive pools, TCP_NODELAY, loopback guard.

* ``TCP_NODELAY`` is set on every upstream socket through httpcore's
  ``socket_options`` (``httpx.AsyncHTTPTransport(socket_options=...)``), so a
  small SSE event is never held back by Nagle's algorithm waiting for an ACK
  (one peer router adds 30-40 ms to TTFT by missing it).
* HTTP/1.1 keep-alive pools sized for the fleet: ``connections_per_endpoint``
  x endpoints, all of them kept alive.
* Test mode (``FLEETGATE_TEST_MODE=1`` or ``test_mode: true``): the transport
  refuses any request whose host is not a loopback literal, before a socket
  is opened (:class:`NonLoopbackBackendError`).
"""

from __future__ import annotations

import importlib.util
import socket
import sys

import httpx

from fleetgate.router.config import is_loopback_host

NODELAY_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def _cache_missing_sniffio() -> None:
    """Make httpcore's per-request ``import sniffio`` fail fast when it is not installed.

    httpcore 1.0 runs ``import sniffio`` inside ``current_async_library()`` on every
    lock set-up; without sniffio each call is a failed import that scans all of
    ``sys.path`` (measured: ~22% of the router's CPU per request). A ``None`` entry
    in ``sys.modules`` is Python's own negative import cache: the import raises
    ``ImportError`` at once and httpcore falls back to asyncio, as it does now.
    Nothing changes when sniffio is installed.
    """
    if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
        sys.modules["sniffio"] = None  # type: ignore[assignment]


class NonLoopbackBackendError(httpx.ConnectError):
    """Test mode refused a backend outside 127.0.0.0/8 (or ::1)."""


class LoopbackOnlyTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not is_loopback_host(request.url.host):
            raise NonLoopbackBackendError(
                f"test mode: refusing non-loopback backend {request.url.host!r}", request=request
            )
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def make_client(
    *,
    test_mode: bool,
    max_connections: int,
    connect_timeout: float,
    read_timeout: float,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """The router's upstream client. ``transport`` replaces the network (tests)."""
    _cache_missing_sniffio()
    inner = transport or httpx.AsyncHTTPTransport(
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=60.0,
        ),
        http1=True,
        http2=False,
        retries=0,
        socket_options=NODELAY_OPTIONS,
    )
    guarded: httpx.AsyncBaseTransport = LoopbackOnlyTransport(inner) if test_mode else inner
    return httpx.AsyncClient(
        transport=guarded,
        timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=30.0, pool=30.0),
        follow_redirects=False,
        trust_env=False,
    )
