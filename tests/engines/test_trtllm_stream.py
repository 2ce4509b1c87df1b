"""TensorRT-LLM's plain streamed token events (``engines/trtllm/stream.py``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleetgate.engines.trtllm import ADAPTER

HEAD = {"id": "cmpl-de55df4068754d02", "created": 1795975001, "model": "m"}


def _rest(event: dict[str, Any]) -> bytes:
    """What follows ``"choices":[`` in the compact rendering of ``event``."""
    raw = (
        "data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n\n"
    ).encode()
    return raw[raw.index(b'"choices":[') + len(b'"choices":[') :]


def _completion(text: str, finish: str | None = None) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "token_ids": None,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }
    return {**HEAD, "object": "text_completion", "choices": [choice], "usage": None}


def _chat(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        **HEAD,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, **extra}],
    }


def _match(kind: Any, rest: bytes) -> dict[str, bytes | None] | None:
    for p in ADAPTER.token_events.for_kind(kind):
        m = p.fullmatch(rest)
        if m is not None:
            return {k: m[k] for k in p.groupindex}
    return None


@pytest.mark.parametrize("text", ["a", " tok", 'q"\\é', "日本\n"])
def test_plain_events_are_matched_with_their_text(text: str) -> None:
    want = json.dumps(text, ensure_ascii=False)[1:-1].encode()
    assert _match("completions", _rest(_completion(text))) == {"text": want, "ids": b"null"}
    assert _match("chat", _rest(_chat({"content": text}))) == {"text": want}


@pytest.mark.parametrize(
    ("kind", "event"),
    [
        pytest.param("completions", _completion("a", "length"), id="finish"),
        pytest.param("chat", _chat({"role": "assistant"}), id="role"),
        pytest.param("chat", _chat({"content": "a"}, finish_reason="stop"), id="chat-finish"),
        pytest.param("chat", _chat({"content": "a", "reasoning_content": ""}), id="more-fields"),
        pytest.param(
            "completions",
            {**HEAD, "object": "text_completion", "choices": [], "usage": {"prompt_tokens": 1}},
            id="usage",
        ),
    ],
)
def test_other_events_are_not_plain(kind: Any, event: dict[str, Any]) -> None:
    assert _match(kind, _rest(event)) is None
