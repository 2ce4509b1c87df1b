"""The engine exchange's transport: the :class:`Upstream` Protocol, its errors, and httpx.

The request path talks to engines through :class:`Upstream`; ``send`` returns
once the response headers are in. Two implementations:

* ``rawhttp.RawUpstream`` (the default): a lean keep-alive HTTP/1.1 client; httpx
  costs about 1 ms of CPU per proxied request (see that module);
* :class:`HttpxUpstream` wraps an ``httpx.AsyncClient`` so tests can replace
  the network with ``httpx.MockTransport``.

Errors are translated at this one boundary into :class:`UpstreamError`
subclasses whose ``cause`` the proxy and metrics use:
``connect`` (nothing reached the engine, or the connection died before any
response byte), ``timeout`` (no response headers in time), ``stream_broken``
(the body stopped early). Closing a response that is not complete closes its
connection, which is how the engine learns the client went away.

Test mode: both refuse non-loopback hosts before any socket is opened.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import httpx

Headers = list[tuple[bytes, bytes]]


class UpstreamError(Exception):
    cause = "connect"


class UpstreamConnectError(UpstreamError):
    cause = "connect"


class UpstreamTimeout(UpstreamError):
    cause = "timeout"


class UpstreamBroken(UpstreamError):
    cause = "stream_broken"


class NonLoopbackUpstream(UpstreamConnectError):
    """Test mode refused a backend outside 127.0.0.0/8 (or ::1)."""


class UpstreamResponse(Protocol):
    status: int
    headers: Headers

    def content_type(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; raises UpstreamBroken / UpstreamTimeout."""
        ...

    async def read(self) -> bytes: ...

    async def aclose(self) -> None:
        """Release: keep-alive reuse when complete, else close the connection."""
        ...


class Upstream(Protocol):
    async def send(self, base: str, path: str, body: bytes, headers: Headers) -> UpstreamResponse:
        """Send a POST; return once the response headers are in."""
        ...

    async def aclose(self) -> None: ...


class _HttpxResponse:
    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.status = resp.status_code
        self.headers: Headers = list(resp.headers.raw)

    def content_type(self) -> bytes:
        return str(self.resp.headers.get("content-type", "")).encode()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            content = self.resp.content  # already read (MockTransport builds such responses)
        except httpx.ResponseNotRead:
            pass
        else:
            if content:
                yield content
            return
        try:
            async for chunk in self.resp.aiter_raw():
                yield chunk
        except httpx.TimeoutException:
            raise UpstreamBroken("upstream body timed out") from None
        except httpx.TransportError as e:
            raise UpstreamBroken(f"upstream body broke: {type(e).__name__}") from None

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def aclose(self) -> None:
        await self.resp.aclose()


class HttpxUpstream:
    """The request path over an ``httpx.AsyncClient`` (tests: ``MockTransport``)."""

    def __init__(self, client: httpx.AsyncClient, timeout: httpx.Timeout) -> None:
        self.client = client
        self.timeout = timeout

    async def send(self, base: str, path: str, body: bytes, headers: Headers) -> UpstreamResponse:
        req = self.client.build_request(
            "POST", base + path, content=body, headers=headers, timeout=self.timeout
        )
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.ConnectTimeout:
            raise UpstreamConnectError("connect timed out") from None
        except httpx.TimeoutException:
            raise UpstreamTimeout("no response headers in time") from None
        except httpx.TransportError as e:
            raise UpstreamConnectError(f"{type(e).__name__}: {e}") from None
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        return None
