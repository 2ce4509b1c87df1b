"""Bodies rendered from an answer's totals: usage, the non-streaming body, merging.

The non-streaming body is checked byte for byte against a recording of a real
vLLM 0.32 server (``FIX``) answering the same request without streaming.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from recordings import VLLM_032

from fleetgate.router.priority.assemble import (
    assemble_response,
    client_usage,
    merge_responses,
    usage_event,
)
from fleetgate.router.priority.continuation import Kind
from fleetgate.router.priority.splice import StreamSplicer
from fleetgate.router.priority.wire import encode_json

FIX = VLLM_032


def _rec(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIX / name).read_text())
    return data


def _chunks(name: str) -> list[bytes]:
    resp = _rec(name)["response"]
    if "http_chunks" in resp:
        return [c.encode() for c in resp["http_chunks"]]
    return [part.encode() + b"\n\n" for part in resp["body"].split("\n\n") if part]


def _fed(kind: Kind, chunks: list[bytes], *, return_token_ids: bool) -> StreamSplicer:
    """A splicer (the :class:`~fleetgate.router.priority.assemble.Answer`) fed ``chunks``."""
    s = StreamSplicer(kind, include_usage=False, return_token_ids=return_token_ids)
    for c in chunks:
        s.feed(c)
    return s


@pytest.mark.parametrize(
    ("stream", "nonstream", "kind"),
    [
        pytest.param(
            "completions_stream_usage.json",
            "completions_nonstream.json",
            "completions",
            id="completions",
        ),
        pytest.param("chat_stream_usage.json", "chat_nonstream.json", "chat", id="chat"),
    ],
)
def test_assembled_body_matches_vllm_nonstream_bytes(
    stream: str, nonstream: str, kind: Any
) -> None:
    up = _chunks(stream)
    s = _fed(kind, up, return_token_ids=False)
    expected = _rec(nonstream)["response"]["body"]
    expected_id = json.loads(expected)["id"]
    assert encode_json(assemble_response(s)) == expected.replace(expected_id, s.id or "")
    assert s.assemble_response() == assemble_response(s)


def test_assembled_body_with_token_ids() -> None:
    up = _chunks("completions_stream_return_token_ids.json")
    got = assemble_response(_fed("completions", up, return_token_ids=True))
    ref = json.loads(_rec("completions_return_token_ids.json")["response"]["body"])
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert got["choices"][0]["prompt_token_ids"] == ref["choices"][0]["prompt_token_ids"]
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"] == ref["usage"]


def test_merge_responses_of_cut_and_continuation() -> None:
    up = _chunks("completions_stream_usage.json")
    s = _fed("completions", up[:3], return_token_ids=False)
    s.prompt_tokens = 8
    first = assemble_response(s)
    assert first["choices"][0]["finish_reason"] is None
    full = json.loads(_rec("completions_nonstream.json")["response"]["body"])
    cont = json.loads(json.dumps(full))
    cont["id"] = "cmpl-other"
    cont["choices"][0]["text"] = full["choices"][0]["text"][len(first["choices"][0]["text"]) :]
    cont["usage"] = {"prompt_tokens": 11, "total_tokens": 16, "completion_tokens": 5}
    merged = merge_responses(first, cont, generated_before=3)
    full["id"] = first["id"]
    assert merged == full


def _answer(kind: Kind = "completions", **state: Any) -> StreamSplicer:
    s = StreamSplicer(kind, include_usage=True, return_token_ids=False)
    s.id, s.created, s.model = "cmpl-1", 7, "m"
    for k, v in state.items():
        setattr(s, k, v)
    return s


def test_client_usage_counts_what_the_client_received() -> None:
    a = _answer(prompt_tokens=8, tokens=5)
    engine = {
        "prompt_tokens": 13,
        "total_tokens": 15,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 12},
    }
    assert client_usage(engine, a) == {
        "prompt_tokens": 8,
        "total_tokens": 13,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 8},  # capped at the original prompt
    }
    assert engine["prompt_tokens"] == 13  # not modified in place
    assert client_usage({}, _answer(tokens=2)) == {
        "prompt_tokens": 0,
        "total_tokens": 2,
        "completion_tokens": 2,
    }


def test_usage_event_takes_the_engine_template_and_the_answer_identity() -> None:
    template = {
        "id": "cmpl-other",
        "object": "text_completion",
        "created": 9,
        "model": "other",
        "choices": [],
        "usage": {"prompt_tokens": 11, "total_tokens": 16, "completion_tokens": 5},
    }
    a = _answer(prompt_tokens=8, tokens=8, system_fingerprint="fp")
    assert encode_json(usage_event(a, template)) == (
        '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[],'
        '"usage":{"prompt_tokens":8,"total_tokens":16,"completion_tokens":8},'
        '"system_fingerprint":"fp"}'
    )


def test_usage_event_without_a_template() -> None:
    """The engine never sent usage: a minimal event, chat or completions."""
    a = _answer("chat", prompt_tokens=3, tokens=2)
    assert usage_event(a, None) == {
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
        "id": "cmpl-1",
        "created": 7,
        "model": "m",
    }
