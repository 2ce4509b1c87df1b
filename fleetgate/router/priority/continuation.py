"""Resuming a preempted or engine-died request as a *continuation*.

When fleetgate preempts a request (or its engine dies mid-answer) the client
has already received part of the answer. The router parks the request and,
when capacity returns, sends the engine a new request that continues exactly
where the client's copy stops. This module builds those request bodies; the
sibling :mod:`.splice` rewrites the continuation's output so that the client
sees one seamless answer. The caller does all I/O.

Upstream shape (:func:`upstream_body`). Whatever the client asked, the router
sends engines ``stream: true`` with ``stream_options.include_usage: true`` and,
where the engine supports it, vLLM's ``return_token_ids: true`` (every streamed
choice then carries its ``token_ids``, the first event the ``prompt_token_ids``): a
cancelled *non-streaming* request returns nothing, so only a streamed upstream
leaves a partial answer to resume from, and token ids make the seam exact. The
splicer hides every field the client did not ask for and assembles the JSON
body of a non-streaming client.

Continuation modes (:func:`build_continuation`), chosen in this order:

``restart``
    Nothing reached the client yet: resend the upstream body unchanged.
``token-ids``
    Completions, engine accepts token-id prompts (``adapter.accepts_token_ids_prompt``),
    prompt ids and generated ids known: ``POST /v1/completions`` with
    ``prompt = prompt_ids + generated_ids``. Exact under greedy decoding: the
    engine sees the same token sequence an uninterrupted run would have had.
``chat-token-ids``
    Chat, same engine capability, the chat template's prompt ids known (from the
    first stream event's top-level ``prompt_token_ids`` under
    ``return_token_ids``, or from ``POST /tokenize`` with ``messages`` and
    ``add_generation_prompt: true``): a
    *completions* request on ``prompt_ids + generated_ids`` carrying the chat
    request's sampling parameters; the splicer turns its ``text_completion``
    events back into ``chat.completion.chunk`` deltas.
``text``
    Completions fallback: ``prompt = original text + delivered text``. The seam
    is re-tokenized, which can differ from the generated ids (documented risk).
``chat-assistant-prefix``
    Chat fallback: the original messages plus an assistant message holding the
    delivered text, with vLLM's ``continue_final_message: true,
    add_generation_prompt: false``. Also re-tokenizes the seam. Only engines
    with ``EngineAdapter.continues_final_message`` (vLLM) honour it, so the
    router never preempts a chat answer that would need this mode (one
    streaming from an engine that returns no token ids, i.e. TensorRT-LLM) and
    sends such an answer, when its engine died, to an engine that continues it.
    fleetgate's emulator ignores ``continue_final_message`` (a fidelity gap,
    docs/emulator-fidelity.md), so there this mode is not exact either.

The seam (:func:`repair_seam`). The first text a continuation streams can carry
the whole decoded prompt before the new text (a vLLM detokenizer leak); the
splicer strips it with :attr:`ContinuationPlan.seam_prefix`.

In every mode ``max_tokens`` (and ``max_completion_tokens``, ``min_tokens``)
shrink by the tokens already delivered. Requests that cannot be spliced
(``n``/``best_of`` > 1, ``echo``, several prompts, stop strings, tools,
structured output, chat logprobs) are refused by :func:`resumability` up front, so the router
never preempts them. Sampled (non-greedy) output resumes *validly* but not
identically unless the engine's sampler is a pure function of (seed, prefix),
as fleetgate's emulator is (``fleetgate/sim/core/api.py``). Requests with stop
strings are refused too (:func:`_stop_strings` says why).

Pure: plain dicts in, plain dicts out.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

Kind = Literal["completions", "chat"]
Mode = Literal["restart", "token-ids", "chat-token-ids", "text", "chat-assistant-prefix"]

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

#: Chat fields that carry over to a completions continuation unchanged
#: (sampling and output controls that both vLLM endpoints accept).
_CHAT_TO_COMPLETIONS_KEYS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "logit_bias",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "user",
    "priority",
    "cache_salt",
)


class ContinuationError(Exception):
    """The request cannot be continued (the router must not preempt it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Delivered:
    """What the client already holds of one answer (from :class:`.splice.StreamSplicer`)."""

    text: str
    tokens: int
    """Completion tokens delivered (exact when ``token_ids`` is known)."""
    token_ids: tuple[int, ...] | None
    """Generated ids when every delivered event carried them, else None."""
    prompt_token_ids: tuple[int, ...] | None
    """The prompt as the engine tokenized it (chat: after the template)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ContinuationPlan:
    path: str
    body: dict[str, Any]
    mode: Mode
    remaining_tokens: int | None
    """Tokens still to generate, or None when the original set no limit."""
    seam_prefix: str | None = None
    """The text the engine decodes the original prompt to, when known (a
    completions text prompt); pass it to ``StreamSplicer.begin_continuation``
    so a vLLM detokenizer leak at the seam is repaired exactly (:func:`repair_seam`)."""


def request_kind(path: str) -> Kind:
    """``completions`` or ``chat`` from the request path."""
    if path.rstrip("/").endswith("/chat/completions"):
        return "chat"
    if path.rstrip("/").endswith("/completions"):
        return "completions"
    raise ContinuationError(f"cannot continue requests to {path}")


def resumability(original: Mapping[str, Any], kind: Kind) -> str | None:
    """Why this request cannot be continued, or None when it can."""
    if int(original.get("n") or 1) != 1:
        return "n > 1"
    if int(original.get("best_of") or 1) != 1:
        return "best_of > 1"
    if original.get("echo"):
        return "echo"
    if _stop_strings(original.get("stop")):
        return "stop strings (a stop string across the seam would go undetected)"
    if (
        original.get("response_format")
        or original.get("guided_json")
        or original.get("structured_outputs")
    ):
        return "structured output"
    if kind == "completions":
        prompt = original.get("prompt")
        if _single_prompt(prompt) is None:
            return "not a single prompt"
        if original.get("logprobs") is not None and not original.get("stream"):
            return "non-streaming logprobs (the assembled body carries none)"
        return None
    if original.get("tools") or original.get("functions"):
        return "tool calling"
    if original.get("logprobs") or original.get("top_logprobs"):
        return "chat logprobs"
    if not isinstance(original.get("messages"), list):
        return "no messages"
    return None


def _stop_strings(stop: Any) -> bool:
    """True when ``stop`` names at least one non-empty stop string.

    Stop *strings* cannot be spliced: the engine checks them only against its own
    output, so one that begins before the seam and ends after it is missed, and
    vLLM streams text up to ``len(stop) - 1`` characters late (it holds back a
    possible stop string's start), so the held-back text of a cancelled segment
    never reaches the client while its token ids are already in the
    continuation's prompt. ``stop_token_ids`` are fine: one token cannot straddle.
    """
    if isinstance(stop, str):
        return bool(stop)
    if isinstance(stop, list):
        return any(isinstance(s, str) and s for s in stop)
    return False


def upstream_body(original: Mapping[str, Any], *, return_token_ids: bool) -> dict[str, Any]:
    """The body the router sends instead of ``original`` (see module docstring).

    A new top-level dict (once per request, so no deep copy): nested values are
    ``original``'s own, and no caller changes them in place (a text continuation
    copies ``messages`` before it appends).
    """
    body = dict(original)
    body["stream"] = True
    options = dict(body.get("stream_options") or {})
    options["include_usage"] = True
    body["stream_options"] = options
    if return_token_ids:
        body["return_token_ids"] = True
    return body


def build_continuation(
    original: Mapping[str, Any],
    kind: Kind,
    delivered: Delivered,
    *,
    accepts_token_ids: bool,
    return_token_ids: bool,
    chat_prompt_token_ids: Sequence[int] | None = None,
) -> ContinuationPlan:
    """The request that continues ``original`` after ``delivered`` (module docstring)."""
    why = resumability(original, kind)
    if why is not None:
        raise ContinuationError(f"request cannot be continued: {why}")
    limit_key = _limit_key(original, kind)
    limit = original.get(limit_key) if limit_key else None
    remaining: int | None = None
    if limit is not None:
        remaining = int(limit) - delivered.tokens
        if remaining <= 0:
            raise ContinuationError(
                f"nothing left to generate ({delivered.tokens} of {limit} tokens delivered)"
            )
    base = upstream_body(original, return_token_ids=return_token_ids)
    path = CHAT_PATH if kind == "chat" else COMPLETIONS_PATH
    if delivered.tokens == 0 and not delivered.text:
        return ContinuationPlan(path, base, "restart", remaining)
    _shrink_limits(base, delivered.tokens, remaining)
    if kind == "completions":
        prompt = _single_prompt(original.get("prompt"))
        ids = delivered.prompt_token_ids
        if ids is None and isinstance(prompt, list):
            ids = tuple(prompt)
        seam = prompt if isinstance(prompt, str) else None
        if accepts_token_ids and ids is not None and delivered.token_ids is not None:
            base["prompt"] = [*ids, *delivered.token_ids]
            return ContinuationPlan(COMPLETIONS_PATH, base, "token-ids", remaining, seam)
        if isinstance(prompt, str):
            base["prompt"] = prompt + delivered.text
            return ContinuationPlan(COMPLETIONS_PATH, base, "text", remaining, seam)
        raise ContinuationError(
            "token-id prompt but the generated token ids are unknown or the engine "
            "does not accept token-id prompts"
        )
    chat_ids = (
        chat_prompt_token_ids if chat_prompt_token_ids is not None else (delivered.prompt_token_ids)
    )
    if accepts_token_ids and chat_ids is not None and delivered.token_ids is not None:
        body: dict[str, Any] = {k: base[k] for k in _CHAT_TO_COMPLETIONS_KEYS if k in base}
        body["prompt"] = [*chat_ids, *delivered.token_ids]
        if remaining is not None:
            body["max_tokens"] = remaining
        if "min_tokens" in base:
            body["min_tokens"] = base["min_tokens"]
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if return_token_ids:
            body["return_token_ids"] = True
        return ContinuationPlan(COMPLETIONS_PATH, body, "chat-token-ids", remaining)
    messages = copy.deepcopy(list(original["messages"]))
    last = messages[-1] if messages else None
    if (
        original.get("continue_final_message")
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        last["content"] = last["content"] + delivered.text
    else:
        messages.append({"role": "assistant", "content": delivered.text})
    base["messages"] = messages
    base["continue_final_message"] = True
    base["add_generation_prompt"] = False
    return ContinuationPlan(CHAT_PATH, base, "chat-assistant-prefix", remaining)


def _single_prompt(prompt: Any) -> str | list[int] | None:
    """The one prompt of a completions request (str or token ids), or None."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if len(prompt) == 1:
            return _single_prompt(prompt[0])
    return None


def _limit_key(original: Mapping[str, Any], kind: Kind) -> str | None:
    if kind == "chat" and original.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens" if original.get("max_tokens") is not None else None


def _shrink_limits(body: dict[str, Any], produced: int, remaining: int | None) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None and remaining is not None:
            body[key] = remaining
    if body.get("min_tokens") is not None:
        body["min_tokens"] = max(0, int(body["min_tokens"]) - produced)


def repair_seam(text: str, delivered: str, seam_prefix: str | None) -> str:
    """The first text a continuation streams, without vLLM's detokenizer leak.

    vLLM's incremental detokenizer primes itself on the last few prompt
    tokens; when every candidate suffix decodes to an incomplete or invalid
    UTF-8 tail (a ``\ufffd``), it primes on the whole prompt and the first
    output event then carries the *entire* decoded prompt (original prompt +
    ``delivered`` text) before the new text. Seen on the real vLLM 0.32
    server in 13 of 39 seams of a random-weight model whose output holds
    ``\ufffd`` (tests/router/priority/test_realvllm_resume.py); real models
    hit it when a seam splits a multi-byte character.

    With ``seam_prefix`` (the decoded original prompt) the repair is exact:
    strip ``seam_prefix + delivered`` when the text starts with it. Without
    it (chat), strip through the last occurrence of the delivered text when
    at least 8 characters precede it (a templated prompt always does; a
    normal one-token event never holds the whole delivered text plus 8
    more characters in practice). Documented heuristic.
    """
    if seam_prefix is not None:
        leak = seam_prefix + delivered
        if leak and text.startswith(leak):
            return text[len(leak) :]
        return text
    if not delivered:
        return text
    at = text.rfind(delivered)
    if at >= 8:
        return text[at + len(delivered) :]
    return text
