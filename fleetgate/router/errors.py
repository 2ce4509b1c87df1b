"""How the router answers a client: its own error bodies and the tracked ``send``.

Body shape: ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the integer status, as vLLM 0.33 does. A backend's own 4xx is never
rewritten: it passes through byte for byte. :class:`ClientSend` remembers
whether the response has started and ended, so every request gets exactly one
answer: a started stream that cannot be finished ends with an in-band error
event and ``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Message, Send

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    doc: dict[str, Any] = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "InternalServerError" if status >= 500 else "Error"),
            "param": param,
            "code": status,
        }
    }
    return json.dumps(doc).encode()


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw += headers
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    param: str | None = None,
    retry_after: float | None = None,
) -> None:
    extra = (
        [] if retry_after is None else [(b"retry-after", str(max(0, round(retry_after))).encode())]
    )
    await send_bytes(send, status, error_body(status, message, param), headers=extra)


class BufferedSend:
    """``send`` for HTTP/1.0 clients: the whole answer in one Content-Length response.

    An HTTP/1.0 client cannot read chunked framing, which uvicorn uses for every
    response without a Content-Length (a stream). So the answer is held until it
    ends and sent at once; its headers get the real length. An answer that grows
    beyond ``limit`` bytes before it ends is replaced by a 502 (nothing was sent yet).
    """

    __slots__ = ("body", "limit", "over", "send", "start")

    def __init__(self, send: Send, limit: int) -> None:
        self.send = send
        self.limit = limit
        self.start: Message | None = None
        self.body: list[bytes] = []
        self.over = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            return
        if message["type"] != "http.response.body" or self.start is None or self.over:
            return
        self.body.append(message.get("body", b""))
        done = not message.get("more_body", False)
        if sum(map(len, self.body)) > self.limit:
            self.over, self.body = True, []
            await send_error(
                self.send, 502, f"answer over {self.limit} bytes: use HTTP/1.1 to stream it"
            )
            return
        if not done:
            return
        data = b"".join(self.body)
        self.body = []
        headers = [
            (k, v)
            for k, v in self.start.get("headers", [])
            if k.lower() not in (b"content-length", b"transfer-encoding")
        ]
        headers.append((b"content-length", str(len(data)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": data})


class ClientSend:
    """``send`` that remembers whether the response started / ended, and its status."""

    __slots__ = ("ended", "send", "started", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.ended = False
        self.status = 0

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self.send(message)

    async def fail(
        self, sse: bool, status: int, message: str, *, retry_after: float | None = None
    ) -> None:
        """Answer with an error: a JSON error if nothing was sent yet, else finish the
        started response as cleanly as its format allows (once)."""
        if not self.started:
            await send_error(self, status, message, retry_after=retry_after)
        elif not self.ended:
            await self.end_with_error(sse, message)

    async def end_with_error(self, sse: bool, message: str) -> None:
        """The response has started: finish it as cleanly as the format allows."""
        if sse:
            event = json.dumps({"error": {"message": message, "type": "BadGatewayError"}})
            body = f"data: {event}\n\ndata: [DONE]\n\n".encode()
        else:
            body = b""
        self.ended = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
