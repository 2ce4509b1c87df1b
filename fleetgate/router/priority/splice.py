"""One seamless answer out of an original stream and its continuations.

Every upstream stream of a request flows through one :class:`StreamSplicer`
(even when nothing is ever preempted): it tracks what the client has received
(:meth:`StreamSplicer.delivered`, the input of
:func:`~fleetgate.router.priority.continuation.build_continuation`) and
rewrites events so the client sees exactly one vLLM-shaped stream:

* every event keeps the *first* segment's ``id``, ``created`` and ``model``;
* a chat continuation's ``role`` delta is not repeated; a ``chat-token-ids``
  continuation's ``text_completion`` events become ``chat.completion.chunk``
  deltas;
* fields the router added upstream and the client did not ask for are hidden:
  ``token_ids`` / ``prompt_token_ids`` become ``null`` (exactly how vLLM renders
  them without ``return_token_ids``), and engine usage events are swallowed;
* only complete SSE events are forwarded, so a stream cut mid-event (engine
  died) never leaks half an event; the incomplete tail is dropped on
  :meth:`StreamSplicer.begin_continuation`;
* the finishing token event is held until the stream ends so that, when the
  client did not ask for usage, it carries ``system_fingerprint`` as vLLM puts
  it there (fixtures completions_stream vs completions_stream_usage);
* exactly one usage event (only when the client asked ``include_usage``) whose
  ``completion_tokens`` is what the client received and ``prompt_tokens`` the
  original prompt, then exactly one ``data: [DONE]``.

Token counting: exact from ``token_ids`` when the engine returns them; else one
token per choice event (vLLM emits one event per generated token without
speculative decoding; fixtures completions_stream / chat_stream). The original
prompt size comes from the first segment's ``prompt_token_ids`` or usage, or is
derived from the first continuation's usage minus the tokens it was given.

JSON is re-serialized compactly with raw UTF-8 (``separators=(",", ":")``,
``ensure_ascii=False``), which reproduces vLLM's bytes; events that need no
change are forwarded byte for byte.

Fast path (the CPU per streamed token): a plain token event (one choice, no
role, no finish, no usage, nothing to repair) of a known engine shape
(:data:`_CHAT_SHAPES`, :data:`_COMPLETIONS_SHAPES`: vLLM 0.32 and the
TensorRT-LLM shapes) whose bytes start with this answer's identity prefix
(``data: {"id":..,"object":..,"created":..,"model":..,"choices":[`` exactly as
:func:`encode_json` renders the adopted identity) is handled by one anchored
regex match instead of ``json.loads`` + re-encoding: the text and token ids are
taken from the bytes and the event is forwarded as is, or with its
``"token_ids":[..]`` bytes replaced by ``null`` when the client did not ask for
them. The output is the slow path's byte for byte: the prefix is the encoding
of the identity, the rest of the shape is fixed literals, and a text holding an
escape is forwarded only when :func:`encode_json` renders it the same. Anything
else (first event, role, finish, usage, error, a continuation's events, an
unknown shape) takes the JSON path. ``fast_path=False`` turns it off (tests
compare both). :meth:`StreamSplicer.assemble_response`
builds the non-streaming body in vLLM 0.32's shape (fixtures
completions_nonstream / chat_nonstream); :func:`merge_responses` merges two
non-streaming bodies.

Pure and synchronous: bytes in, bytes out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from json.encoder import encode_basestring
from typing import Any

from fleetgate.router.priority.continuation import Delivered, Kind, Mode

DONE = b"data: [DONE]\n\n"

# A JSON string body without control characters, escapes complete; a token-id list.
_STR = rb'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*'
_INT = rb"(?:0|[1-9][0-9]{0,18})"
_IDS = rb"\[" + _INT + rb"(?:," + _INT + rb")*\]"

#: Plain token events after the identity prefix, matched to the end of the event.
_CHAT_SHAPES = (
    # vLLM 0.32 (token_ids: null without return_token_ids) and the TensorRT-LLM shape
    re.compile(
        rb'\{"index":0,"delta":\{"content":"(?P<text>' + _STR + rb')"\}'
        rb'(?:,"logprobs":null,"finish_reason":null)?'
        rb'(?:,"token_ids":(?P<ids>null|' + _IDS + rb"))?\}\]\}\n\n"
    ),
)
_COMPLETIONS_SHAPES = (
    # vLLM 0.32
    re.compile(
        rb'\{"index":0,"text":"(?P<text>' + _STR + rb')","logprobs":null,"finish_reason":null,'
        rb'"stop_reason":null(?:,"prompt_token_ids":null)?'
        rb'(?:,"token_ids":(?P<ids>null|' + _IDS + rb"))?\}\]\}\n\n"
    ),
    # TensorRT-LLM
    re.compile(
        rb'\{"index":0,"text":"(?P<text>' + _STR + rb')","token_ids":(?P<ids>null),'
        rb'"logprobs":null,"finish_reason":null,"stop_reason":null\}\],"usage":null\}\n\n'
    ),
)


def encode_json(obj: Any) -> str:
    """vLLM's compact JSON rendering."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _encode_scalar(value: Any) -> str:
    """:func:`encode_json` of one value; strings and ints without ``json.dumps``'s set-up
    (the identity prefix is built once per answer, also for one-token answers)."""
    if type(value) is str:
        return encode_basestring(value)
    if type(value) is int:
        return str(value)
    return encode_json(value)


def sse(obj: Any) -> bytes:
    return f"data: {encode_json(obj)}\n\n".encode()


class StreamSplicer:
    """Tracks one answer across upstream segments and renders the client's stream.

    Only for requests :func:`~.continuation.resumability` accepts (one choice,
    index 0); proxy any other request untouched and never preempt it.
    ``include_usage`` / ``return_token_ids`` are what the *client* asked for.
    Use: :meth:`feed` upstream bytes (returns client bytes); on preemption or
    engine death call :meth:`begin_continuation` and feed the new upstream;
    when :attr:`finished` and the upstream ended, call :meth:`finish` once.
    """

    def __init__(
        self,
        kind: Kind,
        *,
        include_usage: bool,
        return_token_ids: bool,
        prompt_tokens: int | None = None,
        fast_path: bool = True,
    ) -> None:
        self.kind: Kind = kind
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self._buffer = b""
        self._segment = 0
        self._mode: Mode = "restart"
        self._seg_tokens_before = 0
        self._seg_prompt_derived = False
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.system_fingerprint: str | None = None
        self._text_parts: list[str] = [""]
        self.token_ids: list[int] | None = []
        self.prompt_token_ids: list[int] | None = None
        self.prompt_tokens = prompt_tokens
        self.tokens = 0
        self.role_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.upstream_error: dict[str, Any] | None = None
        self._held: dict[str, Any] | None = None
        self._usage_template: dict[str, Any] | None = None
        self.upstream_usage: dict[str, Any] | None = None
        """The last ``usage`` an upstream segment reported (the router's cache closed loop)."""
        self._done_sent = False
        self._seam_pending = False
        self._seam_prefix: str | None = None
        self._fast_path = fast_path
        self._prefix: bytes | None = None
        """``data: {"id":..,"object":..,"created":..,"model":..,"choices":[`` of the adopted
        identity (fast path; None until adopted)."""
        self._shapes = _CHAT_SHAPES if kind == "chat" else _COMPLETIONS_SHAPES

    # -- state -----------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The answer is complete (a finish_reason reached the client's copy)."""
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The answer's text the client has received (joined on demand)."""
        parts = self._text_parts
        if len(parts) != 1:
            parts[:] = ["".join(parts)]
        return parts[0]

    @property
    def done_sent(self) -> bool:
        return self._done_sent

    def delivered(self) -> Delivered:
        return Delivered(
            text=self.text,
            tokens=self.tokens,
            token_ids=tuple(self.token_ids) if self.token_ids is not None else None,
            prompt_token_ids=(
                tuple(self.prompt_token_ids) if self.prompt_token_ids is not None else None
            ),
        )

    # -- input -----------------------------------------------------------

    def begin_continuation(self, mode: Mode, *, seam_prefix: str | None = None) -> None:
        """The next :meth:`feed` bytes come from a continuation sent in ``mode``.

        ``seam_prefix`` is ``ContinuationPlan.seam_prefix`` (see :meth:`_repair_seam`).
        """
        if self.finished:
            raise RuntimeError("answer already finished: nothing to continue")
        self._seam_pending = mode != "restart"
        self._seam_prefix = seam_prefix
        self._buffer = b""
        self._segment += 1
        self._mode = mode
        self._seg_tokens_before = self.tokens
        self._seg_prompt_derived = False
        self.upstream_error = None

    def feed(self, data: bytes) -> bytes:
        """Consume upstream SSE bytes (any chunking); return bytes for the client."""
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        buffer = self._buffer + data if self._buffer else data
        end = buffer.find(b"\n\n")
        if end >= 0 and end == len(buffer) - 2:  # the usual case: one chunk, one event
            self._buffer = b""
            return self._event(buffer)
        out = bytearray()
        start = 0
        while end >= 0:
            out += self._event(buffer[start : end + 2])
            start = end + 2
            end = buffer.find(b"\n\n", start)
        self._buffer = buffer[start:]
        return bytes(out)

    def finish(self) -> bytes:
        """The tail: held final event, the one usage event (if asked), ``[DONE]``. Idempotent."""
        if self._done_sent:
            return b""
        self._done_sent = True
        out = bytearray()
        if self._held is not None:
            held = self._held
            self._held = None
            if self.include_usage:
                held.pop("system_fingerprint", None)
            elif self.system_fingerprint is not None:
                held["system_fingerprint"] = self.system_fingerprint
            out += sse(held)
        if self.include_usage:
            out += sse(self._usage_event())
        out += DONE
        return bytes(out)

    # -- events ----------------------------------------------------------

    def _fast_event(self, raw: bytes) -> bytes | None:
        """A plain token event of a known shape, from its bytes (module docstring);
        None: take the JSON path."""
        prefix = self._prefix
        if (
            prefix is None
            or self.finish_reason is not None
            or self._seam_pending
            or not raw.startswith(prefix)
        ):
            return None
        for shape in self._shapes:
            m = shape.fullmatch(raw, len(prefix))
            if m is not None:
                break
        else:
            return None
        quoted = m["text"]
        escaped = b"\\" in quoted
        try:
            text: str = json.loads(b'"' + quoted + b'"') if escaped else quoted.decode()
        except ValueError:  # not UTF-8: the JSON path decides what it is
            return None
        ids = m["ids"]
        out = raw
        if ids is not None and ids != b"null":
            if not self.return_token_ids:
                if escaped and encode_json(text).encode() != b'"' + quoted + b'"':
                    return None  # the JSON path would re-render this text differently
                start, end = m.span("ids")
                out = b"".join((raw[:start], b"null", raw[end:]))
            if self.token_ids is not None:
                self.token_ids.extend(map(int, ids[1:-1].split(b",")))
            self.tokens += ids.count(b",") + 1
        else:
            self.token_ids = None
            self.tokens += 1
        self._text_parts.append(text)
        return out

    def _event(self, raw: bytes) -> bytes:
        if self._fast_path:
            fast = self._fast_event(raw)
            if fast is not None:
                return fast
        payload = b"\n".join(
            line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")
        )
        if not payload or payload == b"[DONE]":
            # keep-alives carry nothing; the single [DONE] comes from finish()
            return b""
        try:
            obj = json.loads(payload)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or (
            "choices" not in obj and ("error" in obj or obj.get("object") == "error")
        ):
            # an engine error event (or garbage): never shown to the client; the
            # router resumes the answer elsewhere unless it is finished
            self.upstream_error = (
                obj if isinstance(obj, dict) else {"error": {"message": "malformed event"}}
            )
            return b""
        self._adopt_identity(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.upstream_usage = usage
        if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
            self._learn_prompt_tokens(int(usage["prompt_tokens"]))
        if not obj.get("choices"):
            if isinstance(usage, dict):
                self._usage_template = obj
                if obj.get("system_fingerprint") is not None:
                    self.system_fingerprint = obj["system_fingerprint"]
            return b""
        if self.finished:
            return b""  # nothing may follow the finish (defensive)
        out = self._to_client_shape(obj)
        if out is None:
            return b""
        if out["choices"][0].get("finish_reason") is not None:
            if out.get("system_fingerprint") is not None:
                self.system_fingerprint = out["system_fingerprint"]
            self._held = out
            return b""
        return raw if out == obj else sse(out)

    def _adopt_identity(self, obj: Mapping[str, Any]) -> None:
        if self.id is None:  # first segment, or a restart before any byte went out
            self.id = obj.get("id")
            self.created = obj.get("created")
            self.model = obj.get("model")
            ident, kind, created, model = map(
                _encode_scalar, (self.id, obj.get("object"), self.created, self.model)
            )
            head = f'data: {{"id":{ident},"object":{kind},"created":{created},"model":{model},'
            head += '"choices":['
            try:
                self._prefix = head.encode()
            except UnicodeEncodeError:  # a lone surrogate: no fast path for this answer
                self._prefix = None

    @property
    def _fresh(self) -> bool:
        """This segment's prompt is the client's prompt (first segment or a restart)."""
        return self._segment == 0 or self._mode == "restart"

    def _learn_prompt_tokens(self, seen: int) -> None:
        if self._fresh:
            if self.prompt_tokens is None:
                self.prompt_tokens = seen
        elif self.prompt_tokens is None and not self._seg_prompt_derived:
            self.prompt_tokens = max(0, seen - self._seg_tokens_before)
            self._seg_prompt_derived = True

    def _to_client_shape(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Record the event's tokens and rewrite it as the client must see it."""
        choice = dict(obj["choices"][0])
        from_completions = "text" in choice
        if from_completions:
            text = choice.get("text") or ""
        else:
            delta = dict(choice.get("delta") or {})
            text = delta.get("content") or ""
        ids = choice.get("token_ids")
        if self._fresh:
            prompt_ids = choice.get("prompt_token_ids") or obj.get("prompt_token_ids")
            if prompt_ids and self.prompt_token_ids is None:
                self.prompt_token_ids = list(prompt_ids)
                if self.prompt_tokens is None:
                    self.prompt_tokens = len(prompt_ids)
        if not from_completions:
            delta = dict(choice.get("delta") or {})
            if "role" in delta:
                if not self.role_sent:
                    self.role_sent = True  # the one role delta the client sees
                    return self._hide_ids(obj, choice)
                delta.pop("role")
                if not delta.get("content") and choice.get("finish_reason") is None:
                    return None
            choice["delta"] = delta
        if self._seam_pending and (text or choice.get("finish_reason") is not None):
            self._seam_pending = False
            repaired = self._repair_seam(text)
            if repaired != text:
                text = repaired
                if from_completions:
                    choice["text"] = text
                else:
                    choice["delta"] = {**choice["delta"], "content": text}
        # count what the client receives
        if isinstance(ids, list):
            if self.token_ids is not None:
                self.token_ids.extend(int(t) for t in ids)
            self.tokens += len(ids)
        else:
            self.token_ids = None
            self.tokens += 1
        self._text_parts.append(text)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
        if self.kind == "chat" and from_completions:
            return self._completion_to_chat(obj, choice, text, ids)
        if not self.return_token_ids:
            if "token_ids" in choice:
                choice["token_ids"] = None
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
        elif not self._fresh and "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
        out = self._with_identity(obj)
        out["choices"] = [choice]
        if not self.return_token_ids or not self._fresh:
            if out.get("prompt_token_ids") is not None:
                out["prompt_token_ids"] = None
        if isinstance(out.get("usage"), dict):
            out["usage"] = self._usage_counts(out["usage"])
        return out

    def _repair_seam(self, text: str) -> str:
        """Undo vLLM's detokenizer leak on the first text after a seam.

        vLLM's incremental detokenizer primes itself on the last few prompt
        tokens; when every candidate suffix decodes to an incomplete or invalid
        UTF-8 tail (a ``\ufffd``), it primes on the whole prompt and the first
        output event then carries the *entire* decoded prompt (original prompt +
        already delivered text) before the new text. Seen on the real vLLM 0.32
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
        delivered = self.text
        if self._seam_prefix is not None:
            leak = self._seam_prefix + delivered
            if leak and text.startswith(leak):
                return text[len(leak) :]
            return text
        if not delivered:
            return text
        at = text.rfind(delivered)
        if at >= 8:
            return text[at + len(delivered) :]
        return text

    def _hide_ids(self, obj: Mapping[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        """An event unchanged but for token-id fields the client did not ask for."""
        out = self._with_identity(obj)
        out["choices"] = [choice]
        if not self.return_token_ids and out.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = None
        return out

    def _with_identity(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(obj)
        out["id"] = self.id
        out["created"] = self.created
        out["model"] = self.model
        return out

    def _completion_to_chat(
        self, obj: Mapping[str, Any], choice: Mapping[str, Any], text: str, ids: Any
    ) -> dict[str, Any]:
        new_choice: dict[str, Any] = {
            "index": choice.get("index", 0),
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
        }
        if choice.get("finish_reason") is not None:
            new_choice["stop_reason"] = choice.get("stop_reason")
        new_choice["token_ids"] = ids if self.return_token_ids else None
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [new_choice],
        }
        if isinstance(obj.get("usage"), dict):
            out["usage"] = self._usage_counts(obj["usage"])
        if obj.get("system_fingerprint") is not None:
            out["system_fingerprint"] = obj["system_fingerprint"]
        return out

    # -- usage -----------------------------------------------------------

    def _usage_counts(self, usage: Mapping[str, Any]) -> dict[str, Any]:
        """``usage`` with the client's counts; a continuation's cache hits (which
        include re-fed generated tokens) are capped at the original prompt."""
        out = dict(usage)
        prompt = self.prompt_tokens or 0
        out["prompt_tokens"] = prompt
        out["total_tokens"] = prompt + self.tokens
        out["completion_tokens"] = self.tokens
        details = out.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt),
            }
        return out

    def _usage_event(self) -> dict[str, Any]:
        template = self._usage_template or {
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "choices": [],
            "usage": {},
        }
        out = self._with_identity(template)
        if self.kind == "chat":
            out["object"] = "chat.completion.chunk"
        out["usage"] = self._usage_counts(
            {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
            | {k: v for k, v in (template.get("usage") or {}).items()}
        )
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        return out

    # -- non-streaming clients -----------------------------------------

    def assemble_response(self) -> dict[str, Any]:
        """The non-streaming JSON body of the whole answer (vLLM 0.32 shape)."""
        ids = list(self.token_ids) if self.return_token_ids and self.token_ids is not None else None
        prompt_ids = (
            list(self.prompt_token_ids)
            if self.return_token_ids and self.prompt_token_ids is not None
            else None
        )
        prompt = self.prompt_tokens or 0
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + self.tokens,
            "completion_tokens": self.tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        head = {"id": self.id}
        if self.kind == "completions":
            return {
                **head,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": self.text,
                        "logprobs": None,
                        "finish_reason": self.finish_reason,
                        "stop_reason": self.stop_reason,
                        "token_ids": ids,
                        "prompt_logprobs": None,
                        "prompt_token_ids": prompt_ids,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": usage,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return {
            **head,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": self.text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                    "stop_reason": self.stop_reason,
                    "token_ids": ids,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self.system_fingerprint,
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

    ``first`` is the client-shaped body of what was delivered (e.g. from
    :meth:`StreamSplicer.assemble_response` at the cut); ``continuation`` may be
    a completions body even for a chat answer (``chat-token-ids`` mode).
    ``generated_before`` is the completion tokens ``first`` holds.
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
