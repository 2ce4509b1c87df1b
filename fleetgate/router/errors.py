"""OpenAI-style error responses the router itself produces.

Body shape: ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the integer status, as vLLM 0.33 does (``engines.md`` §3). A backend's own
4xx is never rewritten: it passes through byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Send

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
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
