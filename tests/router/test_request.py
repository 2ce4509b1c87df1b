"""The request record: what parse_request decides once, and the accounting it carries."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pathkit import MODEL, request, services

from fleetgate.router.config import parse_config
from fleetgate.router.request import (
    MAX_TOKENS_LIMIT,
    ParseSettings,
    RequestError,
    parse_request,
)


def ok(_: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={})


def parse(
    body: bytes | dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    models: tuple[str, ...] = (MODEL,),
    priority: dict[str, Any] | None = None,
) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    cfg = parse_config({"priority": priority} if priority is not None else {})
    return parse_request(
        "/v1/completions",
        raw,
        [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
        settings=ParseSettings(priority=cfg.classes),
        known_models=list(models),
        endpoints=[],
        new_id=lambda: "fg-own",
        now=5.0,
    )


def test_a_good_request_is_one_record() -> None:
    req = parse(
        {"model": MODEL, "prompt": "hello " * 100, "max_tokens": 7, "stream": True},
        {"x-request-id": "client-1", "x-fleetgate-tenant": "etl", "authorization": "Bearer x",
         "x-fleetgate-priority": "batch", "connection": "keep-alive"},
    )  # fmt: skip
    assert (req.id, req.client_id, req.label) == ("fg-own", "client-1", "client-1")
    assert (req.model, req.stream, req.cls.name, req.tenant) == (MODEL, True, "batch", "etl")
    assert req.arrival == 5.0 and req.kind == "completions" and req.resumable
    assert req.view.max_tokens == 7 and req.view.priority == req.cls.level == -5
    assert req.chain and req.view.prompt_tokens > 100
    # only end-to-end, non-fleetgate headers go upstream; the router sets its own id
    assert req.headers == [(b"authorization", b"Bearer x")]


def test_class_is_the_same_whatever_the_config() -> None:
    for priority in (None, {}):
        assert parse({"model": MODEL}, priority=priority).cls.name == "standard"
        hdr = {"x-fleetgate-priority": "Critical"}
        assert parse({"model": MODEL}, hdr, priority=priority).cls.name == "critical"
        with pytest.raises(RequestError) as err:
            parse({"model": MODEL}, {"x-fleetgate-priority": "5"}, priority=priority)
        assert err.value.status == 400 and err.value.param == "x-fleetgate-priority"
    mapped = {"body_priority_map": {"5": "critical"}}
    assert parse({"model": MODEL}, {"x-fleetgate-priority": "5"}, priority=mapped).cls.name == (
        "critical"
    )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b"[" * 100_000 + b"]" * 100_000, 400, None),
        (b'{"model": "m", "prompt": "\\ud800"}', 400, None),
        (b'{"prompt": "x"}', 400, "model"),  # two models known: model is required
        (b'{"model": 5}', 400, "model"),
        (b'{"model": "other"}', 404, "model"),
        (b'{"model": "m", "stream": "yes"}', 400, "stream"),
        (f'{{"model": "m", "max_tokens": {MAX_TOKENS_LIMIT + 1}}}'.encode(), 400, "max_tokens"),
        (b'{"model": "m", "max_tokens": 1' + b"0" * 400 + b"}", 400, "max_tokens"),
    ],
    ids=["syntax", "array", "deep", "surrogate", "no-model", "model-type", "unknown-model",
         "stream-type", "max-tokens-int32", "max-tokens-10^400"],
)  # fmt: skip
def test_bad_requests_are_refused_with_a_reason(
    body: bytes, status: int, param: str | None
) -> None:
    with pytest.raises(RequestError) as err:
        parse(body, models=(MODEL, "m2"))
    assert (err.value.status, err.value.param) == (status, param), err.value.message


def test_values_an_engine_judges_are_left_to_it() -> None:
    for value in (0, -3, 1.5, "16"):
        req = parse({"model": MODEL, "max_tokens": value})
        assert req.view.max_tokens == 256  # the router plans with its default


def test_no_models_yet_is_503_with_retry_after_and_echo_is_bounded() -> None:
    with pytest.raises(RequestError) as err:
        parse({"model": MODEL}, models=())
    assert err.value.status == 503 and err.value.retry_after == 1
    with pytest.raises(RequestError) as err:
        parse({"model": MODEL}, {"x-fleetgate-priority": "x" * 60_000})
    assert len(err.value.message) < 400


def test_reserve_and_release_give_back_exactly_what_they_took() -> None:
    s, _, (e, _) = services(ok)
    req = request(s, {"prompt": "a long prompt " * 50, "max_tokens": 10})
    req.reserve(e, cached_tokens=0)
    assert e.counts.in_flight == 1 and e.prefilling == req.prefill > 0
    assert req.holding is e and (req.endpoint, req.engine) == (e.id, "vllm")
    req.prefilled()
    assert e.prefilling == 0 and req.prefill == 0
    req.release()
    req.release()  # idempotent
    assert e.counts.in_flight == 0 and req.holding is None
    # a second reservation releases the first
    other = list(s.fleet)[1]
    req.reserve(e, 0)
    req.reserve(other, 0)
    assert e.counts.in_flight == 0 and other.counts.in_flight == 1
