"""The splicer's byte-level fast path: same bytes and same state as the JSON path.

A splicer never told an engine's token-event shapes sends every event through
``json.loads`` and re-encoding (the reference); one given the shapes with
``use_token_events`` (as the exchange does) reads plain token events from their
bytes. Every case feeds both the same upstream bytes and compares the client's
bytes and everything a resume reads (``delivered()``, tokens, usage). Streams:
recordings of a real vLLM 0.32 server, the emulator's vLLM and TensorRT-LLM
shapes, and seeded random texts (escapes, quotes, non-ASCII, several ids per
event) under random chunking; also every engine's shapes on the other engine's
streams (shapes decide only what skips the parse, never the output).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from recordings import VLLM_032

from fleetgate.engines import get_adapter
from fleetgate.router.priority import splice
from fleetgate.router.priority.continuation import build_continuation
from fleetgate.router.priority.splice import StreamSplicer
from fleetgate.router.priority.wire import DONE, encode_json

FIX = VLLM_032
STREAMS = [
    ("completions_stream.json", "completions"),
    ("completions_stream_usage.json", "completions"),
    ("completions_stream_return_token_ids.json", "completions"),
    ("completions_stream_per_request_metrics.json", "completions"),
    ("chat_stream.json", "chat"),
    ("chat_stream_usage.json", "chat"),
]
OPTIONS = [(u, t) for u in (False, True) for t in (False, True)]


def _chunks(name: str) -> list[bytes]:
    resp = json.loads((FIX / name).read_text())["response"]
    if "http_chunks" in resp:
        return [c.encode() for c in resp["http_chunks"]]
    return [part.encode() + b"\n\n" for part in resp["body"].split("\n\n") if part]


ENGINES = ("vllm", "trtllm")


def _pair(
    kind: Any, usage: bool, ids: bool, engine: str = "vllm"
) -> tuple[StreamSplicer, StreamSplicer]:
    """(fast path with ``engine``'s shapes, JSON path only)."""
    fast = StreamSplicer(kind, include_usage=usage, return_token_ids=ids)
    fast.use_token_events(get_adapter(engine).token_events)
    return fast, StreamSplicer(kind, include_usage=usage, return_token_ids=ids)


def _state(s: StreamSplicer) -> tuple[Any, ...]:
    return (
        s.delivered(),
        s.tokens,
        s.prompt_tokens,
        s.finish_reason,
        s.upstream_usage,
        s.upstream_error,
        s.system_fingerprint,
        s.assemble_response(),
    )


def _feed_both(fast: StreamSplicer, slow: StreamSplicer, chunks: list[bytes]) -> bytes:
    out_fast = b"".join(fast.feed(c) for c in chunks)
    out_slow = b"".join(slow.feed(c) for c in chunks)
    assert out_fast == out_slow
    assert _state(fast) == _state(slow)
    return out_fast


class _CountingLoads:
    """``json.loads`` as the splicer module sees it, counting the JSON-path events."""

    def __init__(self) -> None:
        self.calls = 0
        self.loads = json.loads

    def __call__(self, data: Any) -> Any:
        self.calls += 1
        return self.loads(data)


@pytest.mark.parametrize(("name", "kind"), STREAMS)
@pytest.mark.parametrize(("usage", "ids"), OPTIONS)
def test_recorded_vllm_streams_same_bytes_and_state(
    name: str, kind: Any, usage: bool, ids: bool
) -> None:
    chunks = _chunks(name)
    fast, slow = _pair(kind, usage, ids)
    out = _feed_both(fast, slow, chunks)
    assert out + fast.finish() == out + slow.finish()


def test_fast_path_takes_the_plain_token_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first, the finishing and the usage event go through ``json.loads``."""
    chunks = _chunks("completions_stream_return_token_ids.json")
    events = [c for c in chunks if c != DONE]
    counting = _CountingLoads()
    monkeypatch.setattr(splice.json, "loads", counting)
    s, _ = _pair("completions", False, False)
    out = b"".join(s.feed(c) for c in chunks)
    assert counting.calls == 2  # first event (identity, prompt ids) and the finish
    assert len(events) == 8
    # what a client without return_token_ids gets: the ids hidden, nothing else changed
    for raw in events[1:-1]:
        doc = json.loads(raw[6:])
        doc["choices"][0]["token_ids"] = None
        assert ("data: " + encode_json(doc) + "\n\n").encode() in out
    assert s.tokens == 8
    assert s.delivered().token_ids == tuple(
        t for c in events for t in json.loads(c[6:])["choices"][0]["token_ids"]
    )


# -- emulator (vLLM shape) and TensorRT-LLM shapes, synthetic texts ------------------

IDENT = {"id": "chatcmpl-8c344cdbd2924c4a", "created": 1795975001, "model": "m"}


def _vllm_chat(texts: list[str], ids: list[list[int]] | None, fin: str = "length") -> list[bytes]:
    head = {**IDENT, "object": "chat.completion.chunk"}
    head = {k: head[k] for k in ("id", "object", "created", "model")}
    role = {
        **head,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": [1, 2, 3],
        "prompt_text": None,
    }
    out = [role]
    for n, text in enumerate(texts):
        last = n == len(texts) - 1
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": fin if last else None,
        }
        if last:
            choice["stop_reason"] = None
        choice["token_ids"] = ids[n] if ids is not None else None
        out.append({**head, "choices": [choice]})
    usage = {"prompt_tokens": 3, "total_tokens": 3 + len(texts), "completion_tokens": len(texts)}
    out.append({**head, "choices": [], "usage": usage, "system_fingerprint": "fp"})
    return [("data: " + encode_json(ev) + "\n\n").encode() for ev in out] + [DONE]


def _trt_completions(texts: list[str]) -> list[bytes]:
    head = {**IDENT, "id": "cmpl-de55df4068754d02", "object": "text_completion"}
    head = {k: head[k] for k in ("id", "object", "created", "model")}
    out = []
    for n, text in enumerate(texts):
        choice = {
            "index": 0,
            "text": text,
            "token_ids": None,
            "logprobs": None,
            "finish_reason": "length" if n == len(texts) - 1 else None,
            "stop_reason": None,
        }
        out.append({**head, "choices": [choice], "usage": None})
    usage = {"prompt_tokens": 2, "total_tokens": 2 + len(texts), "completion_tokens": len(texts)}
    out.append({**head, "choices": [], "usage": usage})
    return [("data: " + encode_json(ev) + "\n\n").encode() for ev in out] + [DONE]


def _trt_chat(texts: list[str]) -> list[bytes]:
    head = {**IDENT, "id": "chatcmpl-de55df4068754d02", "object": "chat.completion.chunk"}
    head = {k: head[k] for k in ("id", "object", "created", "model")}
    out: list[dict[str, Any]] = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    ]
    for n, text in enumerate(texts):
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
        if n == len(texts) - 1:
            choice["finish_reason"] = "length"
        out.append({**head, "choices": [choice]})
    usage = {"prompt_tokens": 2, "total_tokens": 2 + len(texts), "completion_tokens": len(texts)}
    out.append({**head, "choices": [], "usage": usage})
    return [("data: " + encode_json(ev) + "\n\n").encode() for ev in out] + [DONE]


_ALPHABET = ["a", " ", "é", "日", "😀", '"', "\\", "\n", "\t", "\x01", "/", "\u2028", "x"]


def _texts(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 4))) for _ in range(n)]


def _rechunk(rng: random.Random, chunks: list[bytes]) -> list[bytes]:
    data = b"".join(chunks)
    out, i = [], 0
    while i < len(data):
        step = rng.choice((1, 7, 50, 400, 5000))
        out.append(data[i : i + step])
        i += step
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("usage", "ids"), OPTIONS)
def test_random_texts_and_chunking_same_bytes_and_state(seed: int, usage: bool, ids: bool) -> None:
    rng = random.Random(seed)
    texts = _texts(rng, 40)
    token_ids = [[rng.randint(0, 99999) for _ in range(rng.choice((1, 1, 1, 3)))] for _ in texts]
    for chunks in (
        _vllm_chat(texts, token_ids),
        _vllm_chat(texts, None),
    ):
        for pieces in (chunks, _rechunk(rng, chunks)):
            fast, slow = _pair("chat", usage, ids)
            _feed_both(fast, slow, pieces)
            assert fast.finish() == slow.finish()
            assert fast.text == "".join(texts)
    for kind, trt in (("completions", _trt_completions(texts)), ("chat", _trt_chat(texts))):
        for pieces in (trt, _rechunk(rng, trt)):
            fast, slow = _pair(kind, usage, ids, "trtllm")
            _feed_both(fast, slow, pieces)
            assert fast.finish() == slow.finish()
            assert fast.tokens == len(texts) and fast.delivered().token_ids is None


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_each_engine_shape_takes_its_plain_events(
    engine: str, kind: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each engine's shapes cover its own plain token events: only the role (chat),
    the finishing and the usage events are parsed."""
    texts = ["a", " b", "\u00e9", "c", "d"]  # no escapes (their text goes through json.loads)
    build = {
        ("vllm", "chat"): lambda: _vllm_chat(texts, None),
        ("vllm", "completions"): lambda: _chunks("completions_stream.json"),
        ("trtllm", "chat"): lambda: _trt_chat(texts),
        ("trtllm", "completions"): lambda: _trt_completions(texts),
    }
    chunks = build[(engine, kind)]()
    counting = _CountingLoads()
    monkeypatch.setattr(splice.json, "loads", counting)
    fast, _ = _pair(kind, True, False, engine)
    for c in chunks:
        fast.feed(c)
    # chat: the role event (it sets the identity), the finish and the usage event;
    # completions: the first token event (identity), the finish and the usage event
    # (the vLLM recording has none)
    parsed = 2 if (engine, kind) == ("vllm", "completions") else 3
    assert counting.calls == parsed


@pytest.mark.parametrize(("shapes", "stream"), [("vllm", "trtllm"), ("trtllm", "vllm")])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_another_engines_shapes_change_nothing(shapes: str, stream: str, kind: Any) -> None:
    rng = random.Random(7)
    texts = _texts(rng, 30)
    if stream == "vllm":
        chunks = (
            _vllm_chat(texts, [[n] for n in range(30)])
            if kind == "chat"
            else _chunks("completions_stream_return_token_ids.json")
        )
    else:
        chunks = _trt_chat(texts) if kind == "chat" else _trt_completions(texts)
    for usage, ids in OPTIONS:
        fast, slow = _pair(kind, usage, ids, shapes)
        _feed_both(fast, slow, chunks)
        assert fast.finish() == slow.finish()


def test_escapes_an_engine_renders_differently_fall_back_to_the_json_path() -> None:
    """``\\u00e9`` where Python writes ``é``: hiding the ids re-renders the event, as before."""
    chunks = _vllm_chat(["é", "plain", "end"], [[5], [6], [7]])
    chunks[1] = chunks[1].replace("é".encode(), b"\\u00e9")
    fast, slow = _pair("chat", False, False)
    out = _feed_both(fast, slow, chunks)
    assert "é".encode() in out and b"\\u00e9" not in out
    fast, slow = _pair("chat", False, True)  # ids kept: the event goes out as the engine wrote it
    out = _feed_both(fast, slow, chunks)
    assert b"\\u00e9" in out


@pytest.mark.parametrize(
    "event",
    [
        b'{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null,"token_ids":[01]}]}',
        b'{"index":0,"delta":{"content":"a\\q"},"logprobs":null,"finish_reason":null}]}',
        b'{"index":0,"delta":{"content":"a\xff"},"logprobs":null,"finish_reason":null}]}',
        b'{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]',
        b'{"index":1,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}',
        b'{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}],"usage":{}}',
        b'{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null,"token_ids":[]}]}',
    ],
)
def test_odd_events_behave_as_on_the_json_path(event: bytes) -> None:
    good = _vllm_chat(["a", "b"], [[1], [2]])
    prefix = good[1][: good[1].index(b'"choices":[') + len(b'"choices":[')]
    chunks = [good[0], good[1], prefix + event + b"\n\n", *good[2:]]
    fast, slow = _pair("chat", False, False)
    out = _feed_both(fast, slow, chunks)
    assert fast.finish() == slow.finish()
    assert out.startswith(b"data: ")


@pytest.mark.parametrize("cut", [1, 2, 5])
@pytest.mark.parametrize("ids", [False, True])
def test_resume_after_fast_path_splices_as_the_json_path(cut: int, ids: bool) -> None:
    """Preempted after fast-path events: the continuation (token ids) and the client's
    stream are exactly the JSON path's, and the answer reads as one stream."""
    rng = random.Random(cut)
    texts = _texts(rng, 8)
    token_ids = [[100 + n] for n in range(8)]
    up = _vllm_chat(texts, token_ids)
    original = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    original |= {"stream": True, "stream_options": {"include_usage": True}}
    fast, slow = _pair("chat", True, ids)
    out = _feed_both(fast, slow, [*up[: 1 + cut], up[1 + cut][:40]])
    plans = [
        build_continuation(
            original, "chat", s.delivered(), accepts_token_ids=True, return_token_ids=True
        )
        for s in (fast, slow)
    ]
    assert plans[0] == plans[1]
    plan = plans[0]
    assert fast.delivered().token_ids == tuple(100 + n for n in range(cut))
    for s in (fast, slow):
        s.begin_continuation(plan.mode, seam_prefix=plan.seam_prefix)
    # the continuation's stream: a new request id, the remaining tokens
    rest = [
        c.replace(IDENT["id"].encode(), b"chatcmpl-cont")
        for c in _vllm_chat(texts[cut:], token_ids[cut:])
    ]
    out += _feed_both(fast, slow, rest)  # a chat continuation starts with a role event again
    tail = fast.finish()
    assert tail == slow.finish()
    out += tail
    whole = StreamSplicer("chat", include_usage=True, return_token_ids=ids)
    uninterrupted = b"".join(whole.feed(c) for c in up) + whole.finish()
    assert out == uninterrupted
    assert fast.text == "".join(texts) and fast.tokens == 8


def test_continuation_with_the_original_id_still_repairs_the_seam() -> None:
    """A continuation whose events carry the original identity (same prefix bytes) and
    whose first text holds vLLM's detokenizer leak: repaired exactly as on the JSON path."""
    up = _chunks("completions_stream_return_token_ids.json")
    fast, slow = _pair("completions", False, False)
    out = _feed_both(fast, slow, up[:3])
    delivered = fast.text
    for s in (fast, slow):
        s.begin_continuation("token-ids", seam_prefix="The prefix cache is warm.")
    seam = "The prefix cache is warm." + delivered
    leak = up[3].replace(b'"text":" 883"', b'"text":"' + seam.encode() + b' 883"')
    assert leak != up[3] and json.loads(leak[6:])["choices"][0]["text"] == seam + " 883"
    out += _feed_both(fast, slow, [leak, *up[4:]])
    assert fast.finish() == slow.finish()
    assert fast.text == delivered + " 883" + "".join(
        json.loads(c[6:])["choices"][0]["text"] for c in up[4:] if c != DONE
    )
    assert b"The prefix cache is warm." not in out


@pytest.mark.parametrize(
    "ident",
    [
        {"id": 'cmpl-"quoted"\\é\u2028', "created": 1795975001, "model": "m/é"},
        {"id": "cmpl-1", "created": 1795975001.5, "model": None},
        {"id": "cmpl-2", "created": True, "model": "m"},
    ],
)
def test_unusual_identities_same_bytes(
    ident: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identity prefix renders exactly as ``encode_json`` would (escapes, floats,
    null, booleans), so the fast path still takes the plain events and changes nothing."""
    chunks = [
        c.replace(b'"id":"chatcmpl-8c344cdbd2924c4a"', b'"id":' + encode_json(ident["id"]).encode())
        .replace(b'"created":1795975001', b'"created":' + encode_json(ident["created"]).encode())
        .replace(b'"model":"m"', b'"model":' + encode_json(ident["model"]).encode())
        for c in _vllm_chat(["a", "b", "c", "d"], [[1], [2], [3], [4]])
    ]
    fast, slow = _pair("chat", True, False)
    counting = _CountingLoads()
    monkeypatch.setattr(splice.json, "loads", counting)
    _feed_both(fast, slow, chunks)
    assert fast.finish() == slow.finish()
    # slow: 6 events; fast: role, finish, usage -> 3 plain events skipped json.loads
    assert counting.calls == 6 + 3
