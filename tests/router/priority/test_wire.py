"""The router's own bytes: compact JSON with raw UTF-8, SSE framing."""

from __future__ import annotations

from typing import Any

import pytest

from fleetgate.router.priority.wire import DONE, encode_json, encode_scalar, sse


def test_encode_json_is_compact_with_raw_utf8() -> None:
    obj = {"text": 'é日😀"\\\n\u2028', "ids": [1, 2], "x": None, "ok": True}
    assert encode_json(obj) == '{"text":"é日😀\\"\\\\\\n\u2028","ids":[1,2],"x":null,"ok":true}'


@pytest.mark.parametrize(
    "value", ["cmpl-1", 'q"\\é\u2028\x01', "", 0, 1795975001, -3, 1.5, None, True, False, "\ud800"]
)
def test_encode_scalar_is_encode_json(value: Any) -> None:
    assert encode_scalar(value) == encode_json(value)


def test_sse_event_and_done() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"
