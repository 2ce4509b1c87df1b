"""Unit-test helpers for the request path's modules (``import pathkit``).

Real ``Services`` over an httpx mock transport (no sockets), a capturing ASGI
``send``, and requests parsed by the real parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
from routerkit import router_config
from starlette.types import Message

from fleetgate.router.app import build_router
from fleetgate.router.errors import ClientSend
from fleetgate.router.request import ParseSettings, Request, parse_request
from fleetgate.router.services import Services
from fleetgate.router.state import Endpoint

MODEL = "m"
URLS = ("http://127.0.0.1:18031", "http://127.0.0.1:18032")

Handler = Callable[[httpx.Request], httpx.Response]


def services(
    handler: Handler, *, n: int = 2, **sections: Any
) -> tuple[Services, Any, list[Endpoint]]:
    """Services of a router over ``n`` healthy vLLM endpoints answered by ``handler``."""
    cfg = router_config([("vllm", u) for u in URLS[:n]], **sections)
    app = build_router(
        cfg, transport=httpx.MockTransport(handler), start_background=False, new_id=_ids()
    )
    s: Services = app.state.router
    endpoints = list(s.fleet)
    for e in endpoints:
        e.healthy, e.models = True, frozenset({MODEL})
    return s, app, endpoints


def _ids() -> Callable[[], str]:
    count = iter(range(1, 1 << 30))
    return lambda: f"fg-test-{next(count)}"


def request(
    s: Services,
    doc: dict[str, Any],
    *,
    path: str = "/v1/completions",
    headers: dict[str, str] | None = None,
) -> Request:
    settings = ParseSettings(priority=s.config.classes)
    return parse_request(
        path,
        json.dumps({"model": MODEL, **doc}).encode(),
        [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
        settings=settings,
        known_models=[MODEL],
        endpoints=list(s.fleet.endpoints),
        new_id=s.new_id,
        now=s.clock(),
    )


class Captured:
    """An ASGI ``send`` that keeps every message (wrap it in ``ClientSend``)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"]) if self.messages else 0

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"]) if self.messages else {}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    def client(self) -> ClientSend:
        return ClientSend(self)


def sse(*events: dict[str, Any], done: bool = True) -> bytes:
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return data + (b"data: [DONE]\n\n" if done else b"")


def token_event(text: str, *, finish: str | None = None, ids: list[int] | None = None) -> Any:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "token_ids": ids}  # fmt: skip
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [choice]}  # fmt: skip
