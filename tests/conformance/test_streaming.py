"""SSE framing and the usage chunk, checked on the raw chunked-transfer bytes.

Real vLLM 0.32 (fixture README section 2 and quirk 4): one SSE event per HTTP
chunk, each exactly ``data: <json>\\n\\n`` (LF only, no ``event:``/``id:``
lines), then ``data: [DONE]\\n\\n`` as its own
chunk. Usually one event per token, but when the client reads slower than the
engine generates, vLLM's output collector merges several tokens into one event
(seen on the real server: 5-7 events for 8 tokens), so the checks only require
1..max_tokens token events whose text concatenates to the non-streamed text.
``stream_options.include_usage`` adds a ``choices: []`` usage event
before ``[DONE]``; non-final events carry no ``usage`` key, and
``system_fingerprint`` appears only on the final event.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .backends import Backend
from .wire import RawResponse, raw_request, sse_events

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


async def _stream(backend: Backend, path: str, include_usage: bool) -> RawResponse:
    payload: dict[str, Any] = {
        "model": backend.model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if path == "/v1/completions":
        payload["prompt"] = "The prefix cache is warm."
    else:
        payload["messages"] = [{"role": "user", "content": "hello world"}]
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    return await raw_request(backend.base_url, "POST", path, json.dumps(payload).encode())


def _check_framing(resp: RawResponse) -> list[dict[str, Any]]:
    assert resp.status == 200
    assert resp.header("content-type") == "text/event-stream; charset=utf-8"
    assert resp.header("transfer-encoding") == "chunked"
    assert resp.header("content-length") is None
    names = {k for k, _ in resp.headers}
    assert names == {"date", "server", "content-type", "transfer-encoding", "vary"}
    assert resp.chunks is not None
    # One SSE event per HTTP chunk, each a single ``data:`` line ending in LF LF.
    for chunk in resp.chunks:
        assert len(sse_events(chunk)) == 1, chunk
    events = sse_events(resp.body)
    assert len(events) == len(resp.chunks)
    assert events[-1] == "[DONE]"
    assert resp.chunks[-1] == b"data: [DONE]\n\n"
    parsed = [json.loads(e) for e in events[:-1]]
    assert len({p["id"] for p in parsed}) == 1, "all events of a stream share one id"
    return parsed


async def _plain_text(backend: Backend, path: str) -> str:
    payload: dict[str, Any] = {
        "model": backend.model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    if path == "/v1/completions":
        payload["prompt"] = "The prefix cache is warm."
    else:
        payload["messages"] = [{"role": "user", "content": "hello world"}]
    resp = await raw_request(backend.base_url, "POST", path, json.dumps(payload).encode())
    choice = resp.json()["choices"][0]
    text: str = choice["text"] if "text" in choice else choice["message"]["content"]
    return text


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
async def test_completion_stream(backend: Backend, include_usage: bool) -> None:
    parsed = _check_framing(await _stream(backend, "/v1/completions", include_usage))
    assert all(p["object"] == "text_completion" for p in parsed)
    assert parsed[0]["id"].startswith("cmpl-")
    tokens = [p for p in parsed if p["choices"]]
    assert 1 <= len(tokens) <= MAX_TOKENS
    finish = [t["choices"][0]["finish_reason"] for t in tokens]
    assert finish == [None] * (len(tokens) - 1) + ["length"]
    assert all("usage" not in t for t in tokens)
    text = "".join(t["choices"][0]["text"] for t in tokens)
    assert text == await _plain_text(backend, "/v1/completions"), "greedy stream != plain"
    final = parsed[-1]
    assert [p for p in parsed if "system_fingerprint" in p] == [final]
    if include_usage:
        assert final["choices"] == []
        usage = final["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
        assert usage["prompt_tokens"] > 0
        assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
        assert parsed[-2] is tokens[-1]
    else:
        assert final is tokens[-1]


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
async def test_chat_stream(backend: Backend, include_usage: bool) -> None:
    parsed = _check_framing(await _stream(backend, "/v1/chat/completions", include_usage))
    assert all(p["object"] == "chat.completion.chunk" for p in parsed)
    assert parsed[0]["id"].startswith("chatcmpl-")
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [p for p in parsed[1:] if p["choices"]]
    assert 1 <= len(tokens) <= MAX_TOKENS
    assert all(set(t["choices"][0]["delta"]) == {"content"} for t in tokens)
    text = "".join(t["choices"][0]["delta"]["content"] for t in tokens)
    assert text == await _plain_text(backend, "/v1/chat/completions"), "greedy stream != plain"
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in parsed if p["choices"])
    final = parsed[-1]
    assert [p for p in parsed if "system_fingerprint" in p] == [final]
    if include_usage:
        assert final["choices"] == []
        assert final["usage"]["completion_tokens"] == MAX_TOKENS
    else:
        assert final is tokens[-1]
