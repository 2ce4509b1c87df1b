"""trtllm-serve's error bodies: building them (the emulator) and understanding them (the router)."""

from __future__ import annotations

import json
from typing import Any, Literal

from fleetgate.engines._common import check_error_status, error_json, text_message
from fleetgate.engines.base import ErrorInfo

__all__ = ["classify_error", "error_body"]

_QUEUE_FULL = "maximum queue size"


def _message(data: Any, body: bytes, status: int) -> tuple[str, str | None]:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, str):  # request validation: 400 {"error": "<str(exc)>"}
            return error, None
        if isinstance(error, dict):  # nested envelope (vLLM-style), accepted defensively
            return str(error.get("message", "")) or f"HTTP {status}", _str_or_none(
                error.get("type")
            )
        if "message" in data:  # the flat ErrorResponse
            return str(data["message"]) or f"HTTP {status}", _str_or_none(data.get("type"))
        if "detail" in data:  # FastAPI routing errors
            detail = data["detail"]
            return (detail if isinstance(detail, str) else json.dumps(detail)), None
    return text_message(body, status), None


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def error_body(
    status: int, message: str, err_type: str, param: str | None = None
) -> dict[str, Any]:
    """trtllm-serve's flat ``ErrorResponse`` (``serve/openai_protocol.py``)."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": status}


def classify_error(status: int, body: bytes) -> ErrorInfo:
    """Flat, ``{"error": str}``, nested, FastAPI or text bodies.

    ``overload``: the executor's "Maximum queue size ... reached" (it surfaces as a
    400 through trtllm-serve; not verified at runtime) and 429. Other 4xx are
    ``client``; 5xx (e.g. 503 "LLM is unavailable") are ``server``.
    """
    check_error_status(status)
    message, err_type = _message(error_json(body), body, status)
    kind: Literal["overload", "client", "server"]
    if status == 429 or _QUEUE_FULL in message.lower():
        kind = "overload"
    elif status >= 500:
        kind = "server"
    else:
        kind = "client"
    return ErrorInfo(status=status, kind=kind, message=message, type=err_type)
