"""What the router renders from an answer's totals rather than from an upstream event.

* :func:`client_usage`: a ``usage`` object with the client's counts (what it
  received, the original prompt), whatever segment the engine counted;
* :func:`usage_event`: the one usage event closing a stream;
* :func:`stream_tail`: a stream's last bytes (the held finishing event, that usage
  event when the client asked for it, ``[DONE]``);
* :func:`assemble_response`: the body of a non-streaming client. An answer that may
  be cut short (preempted, engine died) is still served from a stream; the splicer
  collects it across segments and this renders the body a non-streaming vLLM 0.32
  request would have returned (same keys in the same order, ``null`` where vLLM
  writes ``null``);
* :func:`merge_responses`: two non-streaming bodies of one answer joined.

Pure: dicts in, dicts out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from fleetgate.router.priority.continuation import Kind
from fleetgate.router.priority.wire import DONE, encode_json, sse


class Answer(Protocol):
    """What a body is made of (a :class:`~.splice.StreamSplicer` provides it)."""

    @property
    def kind(self) -> Kind: ...
    @property
    def return_token_ids(self) -> bool: ...
    @property
    def id(self) -> str | None: ...
    @property
    def created(self) -> int | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def system_fingerprint(self) -> str | None: ...
    @property
    def text(self) -> str: ...
    @property
    def tokens(self) -> int: ...
    @property
    def token_ids(self) -> list[int] | None: ...
    @property
    def prompt_token_ids(self) -> list[int] | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> Any: ...


def client_usage(usage: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    """``usage`` with the client's counts; a continuation's cache hits (which
    include re-fed generated tokens) are capped at the original prompt."""
    out = dict(usage)
    prompt = answer.prompt_tokens or 0
    out["prompt_tokens"] = prompt
    out["total_tokens"] = prompt + answer.tokens
    out["completion_tokens"] = answer.tokens
    details = out.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {
            **details,
            "cached_tokens": min(details["cached_tokens"], prompt),
        }
    return out


def usage_event(answer: Answer, template: Mapping[str, Any] | None) -> dict[str, Any]:
    """The stream's usage event, shaped like the engine's last one (``template``)."""
    a = answer
    template = template or {
        "object": "chat.completion.chunk" if a.kind == "chat" else "text_completion",
        "choices": [],
        "usage": {},
    }
    out = dict(template)
    out["id"] = a.id
    out["created"] = a.created
    out["model"] = a.model
    if a.kind == "chat":
        out["object"] = "chat.completion.chunk"
    out["usage"] = client_usage(
        {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
        | {k: v for k, v in (template.get("usage") or {}).items()},
        a,
    )
    if a.system_fingerprint is not None:
        out["system_fingerprint"] = a.system_fingerprint
    return out


def stream_tail(
    answer: Answer,
    held: dict[str, Any] | None,
    *,
    include_usage: bool,
    usage_template: Mapping[str, Any] | None,
) -> bytes:
    """The finishing event ``held`` back, the usage event (only with ``include_usage``),
    ``[DONE]``. ``system_fingerprint`` goes where vLLM puts it: on the usage event
    when there is one, else on the finishing event."""
    out = bytearray()
    if held is not None:
        if include_usage:
            held.pop("system_fingerprint", None)
        elif answer.system_fingerprint is not None:
            held["system_fingerprint"] = answer.system_fingerprint
        out += sse(held)
    if include_usage:
        out += sse(usage_event(answer, usage_template))
    out += DONE
    return bytes(out)


def assemble_response(answer: Answer) -> dict[str, Any]:
    """The non-streaming JSON body of the whole answer (vLLM 0.32 shape).

    Token ids (generated and prompt) only when the client asked ``return_token_ids``.
    """
    a = answer
    ids = list(a.token_ids) if a.return_token_ids and a.token_ids is not None else None
    prompt_ids = (
        list(a.prompt_token_ids) if a.return_token_ids and a.prompt_token_ids is not None else None
    )
    prompt = a.prompt_tokens or 0
    usage = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + a.tokens,
        "completion_tokens": a.tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    head = {"id": a.id}
    if a.kind == "completions":
        return {
            **head,
            "object": "text_completion",
            "created": a.created,
            "model": a.model,
            "choices": [
                {
                    "index": 0,
                    "text": a.text,
                    "logprobs": None,
                    "finish_reason": a.finish_reason,
                    "stop_reason": a.stop_reason,
                    "token_ids": ids,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt_ids,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": a.system_fingerprint,
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    return {
        **head,
        "object": "chat.completion",
        "created": a.created,
        "model": a.model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": a.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": a.finish_reason,
                "stop_reason": a.stop_reason,
                "token_ids": ids,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": a.system_fingerprint,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def merge_responses(
    first: Mapping[str, Any], continuation: Mapping[str, Any], *, generated_before: int
) -> dict[str, Any]:
    """Merge two non-streaming bodies of one answer (``first`` cut, ``continuation`` done).

    ``first`` is the client-shaped body of what was delivered (e.g.
    :func:`assemble_response` at the cut); ``continuation`` may be a completions
    body even for a chat answer (``chat-token-ids`` mode). ``generated_before`` is
    the completion tokens ``first`` holds.
    """
    out = json.loads(encode_json(first))
    choice = out["choices"][0]
    cont_choice = continuation["choices"][0]
    if "message" in cont_choice:
        cont_text = cont_choice["message"].get("content") or ""
    else:
        cont_text = cont_choice.get("text") or ""
    if "message" in choice:
        choice["message"]["content"] = (choice["message"].get("content") or "") + cont_text
    else:
        choice["text"] = (choice.get("text") or "") + cont_text
    if choice.get("token_ids") is not None and cont_choice.get("token_ids") is not None:
        choice["token_ids"] = [*choice["token_ids"], *cont_choice["token_ids"]]
    choice["finish_reason"] = cont_choice.get("finish_reason")
    choice["stop_reason"] = cont_choice.get("stop_reason")
    cont_usage = continuation.get("usage") or {}
    produced = generated_before + int(cont_usage.get("completion_tokens") or 0)
    usage = dict(out.get("usage") or {})
    prompt = int(usage.get("prompt_tokens") or 0)
    usage.update(prompt_tokens=prompt, total_tokens=prompt + produced, completion_tokens=produced)
    out["usage"] = usage
    if continuation.get("system_fingerprint") is not None:
        out["system_fingerprint"] = continuation["system_fingerprint"]
    return dict(out)
