"""REAL vLLM 0.32 (CPU): a stream cut and resumed from token ids equals the uninterrupted one.

The real server of tests/realvllm.py (tiny random-weight Llama, greedy decoding,
``ignore_eos`` so every answer has its full length). For each cut point the
client-side splicer reads the upstream stream, the connection is closed after
``cut`` tokens (exactly what preemption does: vLLM aborts the request and
frees its blocks), the continuation body from
:func:`~fleetgate.router.priority.continuation.build_continuation` is sent,
and the client's bytes must equal those of an uninterrupted run (the response
``id`` and ``created`` differ by nature and are normalised).

Seen on this server: vLLM's incremental detokenizer leaks the whole decoded
prompt into the first event after a token-id prompt whose tail decodes to
``\ufffd`` (13 of 39 cuts before
:func:`~fleetgate.router.priority.continuation.repair_seam`; none after). The
splicers read vLLM's plain token events through its adapter's shapes, as the
router does. The last test measures whether outputs stay identical when the
resumed request shares its batch with other requests (batch composition changes the CPU
kernels' reduction shapes); it prints what it saw and asserts only the
structural invariants, because bit-for-bit equality there is a property of the
engine, not of fleetgate.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from fleetgate.engines import get_adapter
from fleetgate.router.priority.continuation import (
    build_continuation,
    request_kind,
    upstream_body,
)
from fleetgate.router.priority.splice import StreamSplicer

pytestmark = [pytest.mark.realvllm, pytest.mark.slow, pytest.mark.timeout(1500)]

_IDENT = re.compile(rb'"id":"[^"]*","object":"([^"]*)","created":\d+')


def _norm(data: bytes) -> bytes:
    return _IDENT.sub(rb'"id":"X","object":"\1","created":0', data)


def _stream(
    client: httpx.Client,
    base: str,
    path: str,
    body: dict[str, Any],
    s: StreamSplicer,
    cut: int | None,
) -> bytes:
    """Feed one upstream stream into ``s``; stop after ``cut`` tokens (closing the socket)."""
    s.use_token_events(get_adapter("vllm").token_events)
    out = b""
    with client.stream("POST", base + path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            out += s.feed(chunk)
            if cut is not None and s.tokens >= cut:
                break
    return out


def _run(
    client: httpx.Client, base: str, path: str, original: dict[str, Any], cut: int | None
) -> tuple[bytes, StreamSplicer, str | None]:
    kind = request_kind(path)
    s = StreamSplicer(
        kind,
        include_usage=bool((original.get("stream_options") or {}).get("include_usage")),
        return_token_ids=False,
    )
    out = _stream(client, base, path, upstream_body(original, return_token_ids=True), s, cut)
    mode = None
    if not s.finished:
        plan = build_continuation(
            original, kind, s.delivered(), accepts_token_ids=True, return_token_ids=True
        )
        mode = plan.mode
        s.begin_continuation(plan.mode, seam_prefix=plan.seam_prefix)
        out += _stream(client, base, plan.path, plan.body, s, None)
    return out + s.finish(), s, mode


COMPLETION = {
    "model": "tiny-llama",
    "prompt": "Preemption test: the quick brown fox jumps over the lazy dog.",
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
CHAT = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "Tell me about preemption."}],
    "max_tokens": 32,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.mark.parametrize(
    ("path", "original", "mode"),
    [
        pytest.param("/v1/completions", COMPLETION, "token-ids", id="completions"),
        pytest.param("/v1/chat/completions", CHAT, "chat-token-ids", id="chat"),
    ],
)
def test_resume_at_every_cut_equals_uninterrupted(
    real_vllm: Any, path: str, original: dict[str, Any], mode: str
) -> None:
    """Cut after every possible token; text and token ids must equal the whole run.

    Raw bytes are compared too and only reported: event boundaries can differ
    while the text is equal, because (a) vLLM's output collector merges two
    tokens into one event when the reader lags, and (b) this random-weight
    model emits invalid UTF-8, and where the detokenizer groups those bytes into
    U+FFFD depends on the window it was primed with (seen: the same total text,
    one event shifted, e.g. ``""`` then ``"\ufffdswer"`` vs the reverse).
    """
    n = int(original["max_tokens"])
    byte_diffs = []
    with httpx.Client(timeout=120.0) as client:
        base = real_vllm.base_url
        whole, ws, _ = _run(client, base, path, original, None)
        assert ws.tokens == n and ws.token_ids is not None
        for cut in range(1, n):
            resumed, rs, got_mode = _run(client, base, path, original, cut)
            assert got_mode == mode
            assert rs.tokens == n, cut
            assert rs.token_ids == ws.token_ids, f"token ids differ after a cut at {cut}"
            assert rs.text == ws.text, f"text differs after a cut at {cut}"
            assert resumed.count(b"data: [DONE]") == 1
            if original.get("stream_options"):
                usage = json.loads(resumed.split(b"\n\n")[-3][6:])["usage"]
                assert usage["prompt_tokens"] == ws.prompt_tokens
                assert usage["completion_tokens"] == n
                assert usage["total_tokens"] == n + usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                assert details.get("cached_tokens", 0) <= usage["prompt_tokens"]
            if "messages" in original:
                assert resumed.count(b'"role":"assistant"') == 1
            if _norm(resumed) != _norm(whole):
                byte_diffs.append(cut)
    print(f"\n{path}: {n - 1} cuts, text+ids equal at all; event bytes differ at {byte_diffs}")


def test_resume_under_concurrent_load_measured(real_vllm: Any) -> None:
    """Resumed while 3 other requests share the batch: report differences, if any."""
    base = real_vllm.base_url
    with httpx.Client(timeout=120.0) as client:
        whole, ws, _ = _run(client, base, "/v1/completions", COMPLETION, None)
    results: list[tuple[int, StreamSplicer]] = []
    errors: list[BaseException] = []

    def load(n: int) -> None:
        try:
            body = {**COMPLETION, "prompt": f"Background load {n}: " + "lorem ipsum " * 20}
            body.pop("stream_options")
            with httpx.Client(timeout=120.0) as c:
                s = StreamSplicer("completions", include_usage=False, return_token_ids=False)
                _stream(c, base, "/v1/completions", body, s, None)
        except BaseException as e:  # reported below
            errors.append(e)

    for cut in (5, 20):
        threads = [threading.Thread(target=load, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        try:
            with httpx.Client(timeout=120.0) as client:
                _, rs, mode = _run(client, base, "/v1/completions", COMPLETION, cut)
        finally:
            for t in threads:
                t.join(timeout=300)
        assert mode == "token-ids"
        results.append((cut, rs))
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    for cut, rs in results:
        assert rs.tokens == 40 and rs.finished
        ref = ws.token_ids or []
        got = rs.token_ids or []
        diff = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        print(f"\nresume at {cut} under load: first differing token index = {diff}")
