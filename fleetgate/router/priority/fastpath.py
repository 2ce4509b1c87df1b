"""The splicer's fast path: plain token events read from their bytes.

The CPU per streamed token. A plain token event (one choice, no role, no finish,
no usage) whose bytes start with the answer's identity prefix
(``data: {"id":..,"object":..,"created":..,"model":..,"choices":[`` as
:func:`~.wire.encode_json` renders the adopted identity: :func:`identity_prefix`)
and whose rest matches one of the shapes the segment's engine declares
(:class:`~fleetgate.engines.base.TokenEventShapes`, compiled for the answer's kind
by :func:`plain_shapes`) is read by :class:`~.splice.StreamSplicer` from its bytes
instead of ``json.loads`` + re-encoding, and forwarded as is (``"token_ids":[..]``
replaced by ``null`` when the client did not ask for them). The output is the JSON
path's byte for byte: shapes match only compact plain events, and a text holding
an escape is forwarded only when :func:`~.wire.encode_json` renders it the same
(:func:`renders_same`); shapes decide only which events skip the parse. Everything
else (first event, role, finish, usage, error, a pending seam, a continuation under
its own id, no shapes given) takes the JSON path.

The shapes themselves are the engines' (``fleetgate/engines/*``, the adapter's
``token_events``); nothing here knows an engine. Pure: bytes and strings only.
"""

from __future__ import annotations

import re
from typing import Any

from fleetgate.engines.base import TokenEventShapes
from fleetgate.router.priority.continuation import Kind
from fleetgate.router.priority.wire import encode_json, encode_scalar

PlainShape = tuple[re.Pattern[bytes], int, int]
"""A compiled shape with the group numbers of ``text`` and ``ids`` (0: no ``ids``)."""


def plain_shapes(shapes: TokenEventShapes, kind: Kind) -> tuple[PlainShape, ...]:
    """The patterns of ``shapes`` for events of ``kind``, with their group numbers."""
    return tuple(
        (p, p.groupindex["text"], p.groupindex.get("ids", 0)) for p in shapes.for_kind(kind)
    )


def identity_prefix(ident: Any, obj_kind: Any, created: Any, model: Any) -> bytes | None:
    """``data: {"id":..,"object":..,"created":..,"model":..,"choices":[`` as
    :func:`~.wire.encode_json` renders these values; None when they cannot be bytes
    (a lone surrogate: no fast path for this answer)."""
    i, k, c, m = map(encode_scalar, (ident, obj_kind, created, model))
    head = f'data: {{"id":{i},"object":{k},"created":{c},"model":{m},'
    head += '"choices":['
    try:
        return head.encode()
    except UnicodeEncodeError:
        return None


def renders_same(text: str, quoted: bytes) -> bool:
    """A text read with its escapes (``quoted``: the JSON string, quotes included) is
    what :func:`~.wire.encode_json` writes for it, so it may be forwarded as is."""
    return encode_json(text).encode() == quoted
