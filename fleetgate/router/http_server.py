"""The router's HTTP/1.1 server: uvicorn's httptools protocol with client limits.

uvicorn parses a request's head before the app sees it and sets no bound on it:
a connection that never completes its headers stays open for ever (slow-loris),
and a client may send megabytes of header fields, all buffered. The protocol
returned by :func:`guarded_protocol` closes both holes, per connection, before
any ASGI code runs:

* ``timeouts.client_header_s``: from a new connection (or the first byte of the
  next request on a keep-alive one) to the end of the request head. Past it the
  client gets ``408`` and the connection is closed.
* ``limits.max_header_bytes`` (request line and fields, counted as the bytes
  arrive) and ``limits.max_headers``: past either, ``431`` and close.

The body read timeout, and the same header limits on what reaches the app (for
servers built without this protocol, e.g. tests), are in
:mod:`fleetgate.router.asgi`. The answers are the router's JSON errors.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fleetgate.router.config import RouterConfig
from fleetgate.router.errors import error_body

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def guarded_protocol(config: RouterConfig) -> type[asyncio.Protocol]:
    """An ``HttpToolsProtocol`` subclass bound to this config's client limits."""
    header_s = config.timeouts.client_header_s
    max_bytes = config.limits.max_header_bytes
    max_count = config.limits.max_headers

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _head_count = 0
        _in_head = True
        _head_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._begin_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # drained and dropped until the close (the answer is already out)
            if self._in_head and self._head_timer is None:
                self._begin_head()  # first byte of the next request on a keep-alive connection
            was_in_head = self._in_head
            super().data_received(data)
            if was_in_head and self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > max_bytes:
                    self._refuse(431, f"request headers over {max_bytes} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._head_bytes = self._head_count = 0
            if self._head_timer is None:
                self._begin_head()

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_count += 1
            if self._refused:
                return
            if self._head_count > max_count:
                self._refuse(431, f"more than {max_count} request header fields")
                return
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._stop_timer()
            if self._refused or self.transport.is_closing():
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not (self._refused or self.transport.is_closing()):
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not (self._refused or self.transport.is_closing()):
                super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._in_head = True  # the keep-alive timer runs until the next byte

        # -- helpers -------------------------------------------------------------

        def _begin_head(self) -> None:
            self._stop_timer()
            self._head_timer = self.loop.call_later(header_s, self._head_timeout)

        def _stop_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._in_head:
                self._refuse(408, f"request headers not received within {header_s}s")

        def _refuse(self, status: int, message: str) -> None:
            """Answer and close. The write side is shut first and what the client still
            sends is read and dropped for a moment: closing a socket with unread input
            resets it, and the reset can destroy the answer before the client reads it."""
            if self._refused or self.transport.is_closing():
                return
            self._refused = True
            self._stop_timer()
            body = error_body(status, message)
            head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
            self.transport.write(
                head
                + b"content-type: application/json\r\n"
                + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
                + body
            )
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(1.0, self.transport.close)
            else:
                self.transport.close()

        def on_url(self, url: bytes) -> None:
            if not self._refused:
                super().on_url(url)

    return GuardedHttpToolsProtocol
