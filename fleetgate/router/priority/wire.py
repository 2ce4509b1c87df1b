"""The bytes the router writes itself: compact JSON as vLLM renders it, SSE events.

``separators=(",", ":")`` with raw UTF-8 (``ensure_ascii=False``) reproduces
vLLM's own bytes, so an event the router re-renders reads exactly like one the
engine wrote.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

DONE = b"data: [DONE]\n\n"
"""The one end-of-stream event."""


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""One encoder for every call: ``json.dumps`` with these arguments builds a new one
each time (about a microsecond, several times per stream)."""


def encode_json(obj: Any) -> str:
    """vLLM's compact JSON rendering."""
    return _COMPACT.encode(obj)


def encode_scalar(value: Any) -> str:
    """:func:`encode_json` of one value; strings and ints without ``json.dumps``'s
    set-up (cheap enough to run once per answer, even a one-token answer)."""
    if type(value) is str:
        return encode_basestring(value)
    if type(value) is int:
        return str(value)
    return encode_json(value)


def sse(obj: Any) -> bytes:
    """One SSE event carrying ``obj``."""
    return f"data: {encode_json(obj)}\n\n".encode()
