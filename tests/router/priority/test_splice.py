"""Stream splicing, byte for byte against real vLLM 0.32 recordings.

Each case takes a real vLLM 0.32 recording (``tests/recordings.py``), cuts it
where a preemption or an engine death would, builds the continuation body,
fakes the continuation's stream in vLLM's own shape (the recorded remaining
events re-identified as a new request), and checks that the client's bytes
equal an uninterrupted recording with the client's own options.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from recordings import VLLM_032

from fleetgate.engines import get_adapter
from fleetgate.router.priority.continuation import COMPLETIONS_PATH, Kind, build_continuation
from fleetgate.router.priority.splice import StreamSplicer
from fleetgate.router.priority.wire import DONE, encode_json, sse

FIX = VLLM_032


def _rec(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIX / name).read_text())
    return data


def _chunks(name: str) -> list[bytes]:
    resp = _rec(name)["response"]
    if "http_chunks" in resp:
        return [c.encode() for c in resp["http_chunks"]]
    return [part.encode() + b"\n\n" for part in resp["body"].split("\n\n") if part]


def _events(chunks: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(c[6:]) for c in chunks if c != DONE]


def _id(chunks: list[bytes]) -> str:
    ident: str = _events(chunks)[0]["id"]
    return ident


def _reid(chunks: list[bytes], new_id: str) -> bytes:
    return b"".join(chunks).replace(_id(chunks).encode(), new_id.encode())


def _body(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(_rec(name)["request"]["body"])
    return body


def _splicer(kind: Kind, **options: Any) -> StreamSplicer:
    """A splicer as the router sets it up for a vLLM endpoint (fast path on)."""
    s = StreamSplicer(kind, **options)
    s.use_token_events(get_adapter("vllm").token_events)
    return s


def _run(splicer: StreamSplicer, chunks: list[bytes]) -> bytes:
    out = b"".join(splicer.feed(c) for c in chunks)
    return out + splicer.finish()


# -- one segment: the splicer is transparent --------------------------------


@pytest.mark.parametrize(
    ("name", "kind", "usage"),
    [
        pytest.param("completions_stream.json", "completions", False, id="completions"),
        pytest.param("completions_stream_usage.json", "completions", True, id="completions-usage"),
        pytest.param("chat_stream.json", "chat", False, id="chat"),
        pytest.param("chat_stream_usage.json", "chat", True, id="chat-usage"),
        pytest.param(
            "completions_stream_per_request_metrics.json", "completions", True, id="usage-metrics"
        ),
    ],
)
def test_single_segment_is_byte_identical(name: str, kind: Any, usage: bool) -> None:
    chunks = _chunks(name)
    s = _splicer(kind, include_usage=usage, return_token_ids=False)
    assert _run(s, chunks) == b"".join(chunks)
    assert s.finished and s.finish() == b""


@pytest.mark.parametrize(
    ("upstream", "client_view", "kind"),
    [
        pytest.param(
            "completions_stream_usage.json",
            "completions_stream.json",
            "completions",
            id="router-added-usage-hidden",
        ),
        pytest.param(
            "completions_stream_return_token_ids.json",
            "completions_stream.json",
            "completions",
            id="router-added-token-ids-hidden",
        ),
        pytest.param(
            "chat_stream_usage.json", "chat_stream.json", "chat", id="chat-router-added-usage"
        ),
    ],
)
def test_router_added_fields_are_hidden_exactly_as_vllm_renders(
    upstream: str, client_view: str, kind: Any
) -> None:
    up = _chunks(upstream)
    s = _splicer(kind, include_usage=False, return_token_ids=False)
    assert _run(s, up) == _reid(_chunks(client_view), _id(up))


def test_chunking_does_not_matter() -> None:
    chunks = _chunks("completions_stream_usage.json")
    whole = b"".join(chunks)
    s = _splicer("completions", include_usage=True, return_token_ids=False)
    out = b"".join(s.feed(whole[i : i + 1]) for i in range(len(whole))) + s.finish()
    assert out == whole


def test_crlf_events_and_keepalives() -> None:
    chunks = _chunks("completions_stream.json")
    noisy = [b": keep-alive\r\n\r\n"] + [c.replace(b"\n", b"\r\n") for c in chunks]
    s = _splicer("completions", include_usage=False, return_token_ids=False)
    assert _run(s, noisy) == b"".join(chunks)


# -- preempted and resumed ---------------------------------------------------


def _cont_events(
    events: list[dict[str, Any]], *, new_id: str, prompt_ids: list[int] | None
) -> list[bytes]:
    """The events a continuation request would stream, in vLLM's shape."""
    out = []
    for n, ev in enumerate(events):
        ev = json.loads(json.dumps(ev))
        ev["id"] = new_id
        ev["created"] = ev["created"] + 7
        if ev["choices"] and "prompt_token_ids" in ev["choices"][0]:
            ev["choices"][0]["prompt_token_ids"] = prompt_ids if n == 0 else None
        out.append(("data: " + encode_json(ev) + "\n\n").encode())
    return out


def _usage_event(kind_obj: str, ident: str, prompt: int, completion: int) -> bytes:
    ev = {
        "id": ident,
        "object": kind_obj,
        "created": 1795961603,
        "model": "tiny-llama",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        },
        "system_fingerprint": "vllm-0.32.0-16f8247a",
    }
    return ("data: " + encode_json(ev) + "\n\n").encode()


@pytest.mark.parametrize("cut", [1, 3, 7])
@pytest.mark.parametrize("client_usage", [True, False])
def test_completions_preempted_resumed_from_token_ids(cut: int, client_usage: bool) -> None:
    up = _chunks("completions_stream_return_token_ids.json")
    events = _events(up)
    original = _body("completions_stream_usage.json")
    if not client_usage:
        del original["stream_options"]
    s = _splicer("completions", include_usage=client_usage, return_token_ids=False)
    out = b"".join(s.feed(c) for c in up[:cut])
    out += s.feed(up[cut][:37])  # the engine was cancelled mid-event
    assert not s.finished
    delivered = s.delivered()
    assert delivered.tokens == cut
    assert delivered.token_ids == tuple(
        t for e in events[:cut] for t in e["choices"][0]["token_ids"]
    )
    prompt_ids = events[0]["choices"][0]["prompt_token_ids"]
    assert delivered.prompt_token_ids == tuple(prompt_ids)

    plan = build_continuation(
        original, "completions", delivered, accepts_token_ids=True, return_token_ids=True
    )
    assert plan.mode == "token-ids" and plan.path == COMPLETIONS_PATH
    assert plan.body["prompt"] == [*prompt_ids, *delivered.token_ids]
    assert plan.body["max_tokens"] == 8 - cut == plan.remaining_tokens
    assert plan.body["stream"] is True and plan.body["stream_options"]["include_usage"] is True
    assert plan.body["return_token_ids"] is True

    s.begin_continuation(plan.mode)
    cont = _cont_events(events[cut:], new_id="cmpl-cont", prompt_ids=plan.body["prompt"])
    cont.append(_usage_event("text_completion", "cmpl-cont", len(plan.body["prompt"]), 8 - cut))
    cont.append(DONE)
    out += _run(s, cont)

    expected_name = "completions_stream_usage.json" if client_usage else "completions_stream.json"
    assert out == _reid(_chunks(expected_name), _id(up))
    assert out.count(b"[DONE]") == 1
    assert s.tokens == 8 and s.prompt_tokens == 8


def _chat_upstream_with_ids() -> tuple[list[bytes], list[int], list[int]]:
    """chat_stream_usage as the router receives it with return_token_ids on."""
    nonstream = json.loads(_rec("chat_return_token_ids.json")["response"]["body"])
    gen_ids = nonstream["choices"][0]["token_ids"]
    prompt_ids = nonstream["prompt_token_ids"]
    out = []
    for n, ev in enumerate(_events(_chunks("chat_stream_usage.json"))):
        if n == 0:
            ev["prompt_token_ids"] = prompt_ids
        elif ev["choices"]:
            ev["choices"][0]["token_ids"] = [gen_ids[n - 1]]
        out.append(("data: " + encode_json(ev) + "\n\n").encode())
    return [*out, DONE], prompt_ids, gen_ids


@pytest.mark.parametrize("cut_tokens", [1, 3, 7])
def test_chat_resumed_through_completions_token_ids(cut_tokens: int) -> None:
    up, prompt_ids, gen_ids = _chat_upstream_with_ids()
    s = _splicer("chat", include_usage=True, return_token_ids=False)
    out = b"".join(s.feed(c) for c in up[: 1 + cut_tokens])
    delivered = s.delivered()
    assert delivered.prompt_token_ids == tuple(prompt_ids)
    assert delivered.token_ids == tuple(gen_ids[:cut_tokens])

    original = _body("chat_stream_usage.json")
    plan = build_continuation(
        original, "chat", delivered, accepts_token_ids=True, return_token_ids=True
    )
    assert plan.mode == "chat-token-ids" and plan.path == COMPLETIONS_PATH
    assert plan.body == {
        "model": "tiny-llama",
        "temperature": 0,
        "prompt": [*prompt_ids, *gen_ids[:cut_tokens]],
        "max_tokens": 8 - cut_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    # the engine answers the completions continuation with text_completion events
    s.begin_continuation(plan.mode)
    cont = []
    for n, ev in enumerate(_events(up[1 + cut_tokens : -2])):
        choice = ev["choices"][0]
        c: dict[str, Any] = {
            "index": 0,
            "text": choice["delta"]["content"],
            "logprobs": None,
            "finish_reason": choice["finish_reason"],
            "stop_reason": choice.get("stop_reason"),
            "prompt_token_ids": plan.body["prompt"] if n == 0 else None,
            "token_ids": choice["token_ids"],
        }
        cont.append(
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "created": 5,
                "model": "tiny-llama",
                "choices": [c],
            }
        )
    chunks = [("data: " + encode_json(e) + "\n\n").encode() for e in cont]
    chunks += [_usage_event("text_completion", "cmpl-x", len(plan.body["prompt"]), 8 - cut_tokens)]
    out += _run(s, [*chunks, DONE])
    expected = _chunks("chat_stream_usage.json")
    assert out == _reid(expected, _id(up))


def test_chat_resumed_by_assistant_prefix_does_not_repeat_role() -> None:
    up = _chunks("chat_stream_usage.json")
    s = _splicer("chat", include_usage=True, return_token_ids=False)
    out = b"".join(s.feed(c) for c in up[:4])  # role + 3 tokens
    delivered = s.delivered()
    assert delivered.token_ids is None and delivered.tokens == 3
    original = _body("chat_stream_usage.json")
    plan = build_continuation(
        original, "chat", delivered, accepts_token_ids=False, return_token_ids=False
    )
    assert plan.mode == "chat-assistant-prefix"
    assert plan.body["messages"][-1] == {"role": "assistant", "content": delivered.text}
    assert plan.body["continue_final_message"] is True
    assert plan.body["add_generation_prompt"] is False
    assert plan.body["max_tokens"] == 5
    s.begin_continuation(plan.mode)
    events = _events(up)
    cont = _cont_events([events[0], *events[4:-1]], new_id="chatcmpl-2", prompt_ids=None)
    cont += [_usage_event("chat.completion.chunk", "chatcmpl-2", 12, 5), DONE]
    out += _run(s, cont)
    assert out == b"".join(up)
    assert out.count(b'"role"') == 1


def test_preempted_before_first_token_restarts_transparently() -> None:
    up = _chunks("completions_stream_usage.json")
    s = _splicer("completions", include_usage=True, return_token_ids=False)
    assert s.feed(up[0][:20]) == b""
    delivered = s.delivered()
    plan = build_continuation(
        _body("completions_stream_usage.json"),
        "completions",
        delivered,
        accepts_token_ids=True,
        return_token_ids=True,
    )
    assert plan.mode == "restart"
    s.begin_continuation(plan.mode)
    assert _run(s, up) == b"".join(up)


def test_engine_error_event_is_not_forwarded_and_resume_follows() -> None:
    up = _chunks("completions_stream_usage.json")
    s = _splicer("completions", include_usage=True, return_token_ids=False)
    out = s.feed(up[0]) + s.feed(up[1])
    err = b'data: {"error":{"message":"engine dead","type":"InternalServerError","code":500}}\n\n'
    assert s.feed(err) == b""
    assert s.upstream_error is not None and not s.finished
    plan = build_continuation(
        _body("completions_stream_usage.json"),
        "completions",
        s.delivered(),
        accepts_token_ids=True,
        return_token_ids=True,
    )
    assert plan.mode == "text"  # no token ids came back: text fallback
    assert plan.body["prompt"] == "The prefix cache is warm. 3 375"
    s.begin_continuation(plan.mode)
    assert s.upstream_error is None
    events = _events(up)
    cont = _cont_events(events[2:-1], new_id="cmpl-z", prompt_ids=None)
    cont += [_usage_event("text_completion", "cmpl-z", 10, 6), DONE]
    out += _run(s, cont)
    assert out == b"".join(up)
    assert s.prompt_tokens == 8  # from the continuation's usage minus what it was given


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(b'data: {"object":"error","message":"boom","code":500}\n\n', id="flat-error"),
        pytest.param(b"data: {not json\n\n", id="malformed"),
        pytest.param(b"data: [1, 2]\n\n", id="not-an-object"),
    ],
)
def test_other_error_shapes_are_upstream_errors(event: bytes) -> None:
    up = _chunks("completions_stream.json")
    s = _splicer("completions", include_usage=False, return_token_ids=False)
    first = s.feed(up[0])
    assert first == up[0]
    assert s.feed(event) == b""
    assert s.upstream_error is not None and not s.finished
    assert s.tokens == 1


def test_finish_is_once_and_nothing_follows_the_finish() -> None:
    up = _chunks("completions_stream.json")
    s = _splicer("completions", include_usage=False, return_token_ids=False)
    body = b"".join(s.feed(c) for c in up[:-1])  # upstream died right before [DONE]
    assert s.finished
    with pytest.raises(RuntimeError, match="finished"):
        s.begin_continuation("token-ids")
    assert s.feed(up[-2]) == b""  # a duplicate finishing event is swallowed
    tail = s.finish()
    assert body + tail == b"".join(up)
    assert s.finish() == b"" and s.done_sent


def test_usage_when_engine_never_sent_one() -> None:
    up = _chunks("completions_stream.json")
    s = _splicer("completions", include_usage=True, return_token_ids=False, prompt_tokens=8)
    out = _run(s, up)
    events = out.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    last = [json.loads(events[-3][6:])]
    assert last[0]["choices"] == []
    assert last[0]["usage"] == {"prompt_tokens": 8, "total_tokens": 16, "completion_tokens": 8}
    assert last[0]["id"] == _id(up)
    assert out.endswith(DONE) and out.count(b"[DONE]") == 1


def test_client_asked_token_ids_keeps_them_and_hides_continuation_prompt_ids() -> None:
    up = _chunks("completions_stream_return_token_ids.json")
    events = _events(up)
    s = _splicer("completions", include_usage=False, return_token_ids=True)
    out = b"".join(s.feed(c) for c in up[:2])
    plan = build_continuation(
        _body("completions_stream_return_token_ids.json"),
        "completions",
        s.delivered(),
        accepts_token_ids=True,
        return_token_ids=True,
    )
    s.begin_continuation(plan.mode)
    out += _run(s, [*_cont_events(events[2:], new_id="c2", prompt_ids=plan.body["prompt"]), DONE])
    assert out == b"".join(up)


def test_role_is_stripped_from_a_continuation_delta_that_carries_content() -> None:
    up = _chunks("chat_stream.json")
    s = _splicer("chat", include_usage=False, return_token_ids=False)
    out = s.feed(up[0]) + s.feed(up[1])
    s.begin_continuation("chat-assistant-prefix")
    ev = _events(up)[2]
    ev["id"] = "chatcmpl-other"
    ev["choices"][0]["delta"] = {
        "role": "assistant",
        "content": ev["choices"][0]["delta"]["content"],
    }
    out += s.feed(("data: " + encode_json(ev) + "\n\n").encode())
    out += _run(s, _cont_events(_events(up)[3:], new_id="chatcmpl-other", prompt_ids=None))
    assert out == b"".join(up)


# The first event after a seam as the real vLLM 0.32 server sent it when the
# token-id prompt's tail decoded to U+FFFD (tests/router/priority/test_realvllm_resume.py).
_LEAK_PROMPT = "Preemption test: the quick brown fox jumps over the lazy dog."
_LEAK_DELIVERED = " 40091 994\ufffdquest1808 923"


@pytest.mark.parametrize(
    ("seam_prefix", "first_text", "expected"),
    [
        pytest.param(
            _LEAK_PROMPT, _LEAK_PROMPT + _LEAK_DELIVERED + "\ufffd290", "\ufffd290", id="leak-exact"
        ),
        pytest.param(_LEAK_PROMPT, "\ufffd290", "\ufffd290", id="no-leak"),
        pytest.param(
            None, "<|user|>\nhi\n" + _LEAK_DELIVERED + "\ufffd290", "\ufffd290", id="chat-leak"
        ),
        pytest.param(None, "\ufffd290", "\ufffd290", id="chat-no-leak"),
        pytest.param(
            None, "x" + _LEAK_DELIVERED + "y", "x" + _LEAK_DELIVERED + "y", id="too-short"
        ),
    ],
)
def test_seam_repair_of_vllm_detokenizer_leak(
    seam_prefix: str | None, first_text: str, expected: str
) -> None:
    s = _splicer("completions", include_usage=False, return_token_ids=False)
    first = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": _LEAK_DELIVERED,
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    }
    s.feed(sse(first))
    s.begin_continuation("token-ids", seam_prefix=seam_prefix)
    second = json.loads(json.dumps(first))
    second["id"] = "cmpl-2"
    second["choices"][0]["text"] = first_text
    out = s.feed(sse(second))
    assert json.loads(out[6:])["choices"][0]["text"] == expected
    assert s.text == _LEAK_DELIVERED + expected
    third = json.loads(json.dumps(second))
    third["choices"][0]["text"] = _LEAK_PROMPT  # only the first event after a seam is repaired
    assert json.loads(s.feed(sse(third))[6:])["choices"][0]["text"] == _LEAK_PROMPT


def test_continuation_cache_hits_are_capped_at_the_original_prompt() -> None:
    up = _chunks("completions_stream_return_token_ids.json")
    s = _splicer("completions", include_usage=True, return_token_ids=False)
    for c in up[:3]:
        s.feed(c)
    s.begin_continuation("token-ids")
    events = _events(up)
    cont = _cont_events(events[3:], new_id="c", prompt_ids=None)
    usage = json.loads(_usage_event("text_completion", "c", 11, 5)[6:])
    usage["usage"]["prompt_tokens_details"] = {"cached_tokens": 11}
    out = _run(s, [*cont, sse(usage), DONE])
    final = json.loads(out.split(b"\n\n")[-3][6:])
    assert final["usage"] == {
        "prompt_tokens": 8,
        "total_tokens": 16,
        "completion_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
