"""The splicer's JSON path: an engine's event read, and rendered for the client.

:func:`read_event` parses one complete SSE event and tells an engine error (or
garbage) from an answer event. The rest is pure dict -> dict, for
:class:`~.splice.StreamSplicer` once it has recorded what an event delivers:
every event carries the answer's identity (the first segment's ``id``,
``created`` and ``model``); token-id fields the client did not ask for become
``null`` (how vLLM renders them without ``return_token_ids``), and so do a
continuation's prompt ids (its prompt is not the client's); a ``chat-token-ids``
continuation's ``text_completion`` event becomes a ``chat.completion.chunk``
delta. ``usage`` is the client's already (:func:`~.assemble.client_usage`), None
when the event carries none. Which events are dropped, held or counted is the
splicer's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

Identity = tuple[str | None, int | None, str | None]
"""The answer's ``id``, ``created`` and ``model``."""


def read_event(raw: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """One complete SSE event -> ``(its JSON object, None)``; ``(None, error)`` for an
    engine error event or garbage; ``(None, None)`` for one carrying nothing (a
    keep-alive, or ``[DONE]``: the splicer writes the one ``[DONE]`` itself)."""
    if raw.startswith(b"data:") and raw.find(b"\n") == len(raw) - 2:
        payload = raw[5:-2].lstrip(b" ")  # one data line (how engines write events)
    else:
        payload = b"\n".join(
            line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")
        )
    if not payload or payload == b"[DONE]":
        return None, None
    try:
        obj = json.loads(payload)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return None, {"error": {"message": "malformed event"}}
    if "choices" not in obj and ("error" in obj or obj.get("object") == "error"):
        return None, obj
    return obj, None


def with_identity(obj: Mapping[str, Any], identity: Identity) -> dict[str, Any]:
    """A copy of ``obj`` under the answer's identity."""
    out = dict(obj)
    out["id"], out["created"], out["model"] = identity
    return out


def role_event(
    obj: Mapping[str, Any], choice: dict[str, Any], identity: Identity, *, return_token_ids: bool
) -> dict[str, Any]:
    """The one role event: unchanged but for token-id fields the client did not ask for."""
    out = with_identity(obj, identity)
    out["choices"] = [choice]
    if not return_token_ids and out.get("prompt_token_ids") is not None:
        out["prompt_token_ids"] = None
    return out


def client_event(
    obj: Mapping[str, Any],
    choice: dict[str, Any],
    text: str,
    ids: Any,
    identity: Identity,
    *,
    as_chat: bool,
    return_token_ids: bool,
    fresh: bool,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A token or finish event as the client sees it: with ``as_chat`` a completions
    event turned chat chunk (:func:`completion_as_chat`); else of its own kind,
    ``choice`` (rewritten by the splicer) losing its token-id fields as above.
    ``fresh``: this segment's prompt is the client's (first segment or a restart),
    so its prompt ids may show."""
    if as_chat:
        return completion_as_chat(
            obj, choice, text, ids, identity, return_token_ids=return_token_ids, usage=usage
        )
    if not return_token_ids:
        if "token_ids" in choice:
            choice["token_ids"] = None
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
    elif not fresh and "prompt_token_ids" in choice:
        choice["prompt_token_ids"] = None
    out = with_identity(obj, identity)
    out["choices"] = [choice]
    if not return_token_ids or not fresh:
        if out.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = None
    if usage is not None:
        out["usage"] = usage
    return out


def completion_as_chat(
    obj: Mapping[str, Any],
    choice: Mapping[str, Any],
    text: str,
    ids: Any,
    identity: Identity,
    *,
    return_token_ids: bool,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A ``text_completion`` event (a ``chat-token-ids`` continuation's) as the chat
    chunk the client expects, carrying ``text``."""
    new_choice: dict[str, Any] = {
        "index": choice.get("index", 0),
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": choice.get("finish_reason"),
    }
    if choice.get("finish_reason") is not None:
        new_choice["stop_reason"] = choice.get("stop_reason")
    new_choice["token_ids"] = ids if return_token_ids else None
    ident, created, model = identity
    out: dict[str, Any] = {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [new_choice],
    }
    if usage is not None:
        out["usage"] = usage
    if obj.get("system_fingerprint") is not None:
        out["system_fingerprint"] = obj["system_fingerprint"]
    return out
