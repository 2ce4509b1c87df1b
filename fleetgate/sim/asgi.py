"""Bare ASGI plumbing shared by the emulated engines' HTTP apps.

The apps are raw ASGI callables (no framework routing) because the emulator
must reproduce engine wire details exactly and cheaply: FastAPI-style
``{"detail": "Not Found"}`` / ``405`` with ``allow``, header order
``content-length, content-type, vary`` after uvicorn's ``date``/``server``
(fixtures ``*.wire.txt``), and one SSE event per HTTP chunk.

:func:`race_disconnect` is vLLM's ``@with_cancellation``: the handler runs
while a watcher awaits ``http.disconnect``; on disconnect the handler task is
cancelled, which closes the token generator and aborts the request in the
engine model (its KV blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

__all__ = [
    "Receive",
    "Scope",
    "Send",
    "SseWriter",
    "header",
    "race_disconnect",
    "read_body",
    "send_bytes",
    "send_json",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_VARY = (b"vary", b"Origin")


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(receive: Receive, limit: int = 64 * 1024 * 1024) -> bytes | None:
    """The whole request body, or None if the client went away first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise ValueError("request body too large")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes | None,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    headers = [*extra, (b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    headers.append(_VARY)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def dumps(obj: Any) -> bytes:
    """Compact JSON as FastAPI/pydantic write it (no spaces, UTF-8)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def send_json(
    send: Send, status: int, obj: Any, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    await send_bytes(send, status, dumps(obj), b"application/json", extra)


class SseWriter:
    """``text/event-stream`` response; each :meth:`event` is one HTTP chunk."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def start(self) -> None:
        await self._send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), _VARY],
            }
        )
        self.started = True

    async def raw(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def event(self, obj: Any, trailer: bytes = b"\n\n") -> None:
        await self.raw(b"data: " + dumps(obj) + trailer)

    async def done(self) -> None:
        await self.raw(b"data: [DONE]\n\n")
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, handler: Coroutine[Any, Any, None]) -> bool:
    """Run ``handler`` until it ends or the client disconnects; True if it ran to the end."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(handler)
    watcher = loop.create_task(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, OSError):
        await task
    return False
