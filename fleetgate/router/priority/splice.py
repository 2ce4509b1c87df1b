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
  client did not ask for usage, it carries ``system_fingerprint`` where vLLM
  puts it (on the finishing event without usage, on the usage event with it);
* exactly one usage event (only when the client asked ``include_usage``) whose
  ``completion_tokens`` is what the client received and ``prompt_tokens`` the
  original prompt, then exactly one ``data: [DONE]``.

Token counting: exact from ``token_ids`` when the engine returns them; else one
token per choice event (vLLM emits one event per generated token without
speculative decoding). The original prompt size comes from the first segment's
``prompt_token_ids`` or usage, or is derived from the first continuation's usage
minus the tokens it was given.

JSON is re-rendered with :func:`~.wire.encode_json`, which reproduces vLLM's
bytes; events that need no change are forwarded byte for byte.

Fast path: a plain token event is read from its bytes (no ``json.loads``, no
re-encoding) when it matches a shape its engine declares; the output is the JSON
path's byte for byte (:mod:`.fastpath` says when and how). Everything else takes
the JSON path, read and rendered by :mod:`.client_events`.

What the router renders from the answer's totals (the stream's tail with its
usage event, a non-streaming client's body) is in :mod:`.assemble`.

Pure and synchronous: bytes in, bytes out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from fleetgate.engines.base import TokenEventShapes
from fleetgate.router.priority.assemble import assemble_response, client_usage, stream_tail
from fleetgate.router.priority.client_events import client_event, read_event, role_event
from fleetgate.router.priority.continuation import Delivered, Kind, Mode, repair_seam
from fleetgate.router.priority.fastpath import (
    PlainShape,
    identity_prefix,
    plain_shapes,
    renders_same,
)
from fleetgate.router.priority.wire import sse


class StreamSplicer:
    """Tracks one answer across upstream segments and renders the client's stream.

    Only for requests :func:`~.continuation.resumability` accepts (one choice,
    index 0); proxy any other request untouched and never preempt it.
    ``include_usage`` / ``return_token_ids`` are what the *client* asked for.
    Use: before each upstream attempt, :meth:`use_token_events` with its engine's
    shapes; :meth:`feed` upstream bytes (returns client bytes); on preemption or
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
        self._token_ids: list[int] | None = []
        self._ids_raw: list[bytes] = []
        """Fast-path token ids not parsed yet (``b"1,2"`` per event, in order): parsed
        only when something reads :attr:`token_ids` (a resume, a body, a test)."""
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
        self._prefix: bytes | None = None
        """``data: {"id":..,"object":..,"created":..,"model":..,"choices":[`` of the adopted
        identity (fast path; None until adopted)."""
        self._rename: tuple[str, str] | None = None
        """(engine's model name, served name) of the current attempt's endpoint."""
        self._shapes: tuple[PlainShape, ...] = ()
        """The fast path's patterns for this answer's kind, each with the group numbers
        of ``text`` and ``ids`` (0: no ``ids`` group; no patterns: JSON path only)."""

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
    def token_ids(self) -> list[int] | None:
        """The generated token ids the client has received (None: not all known)."""
        if self._ids_raw:
            if self._token_ids is not None:
                self._token_ids.extend(map(int, b",".join(self._ids_raw).split(b",")))
            self._ids_raw.clear()
        return self._token_ids

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

    def use_token_events(self, shapes: TokenEventShapes) -> None:
        """The bytes fed next come from an engine writing plain token events in
        ``shapes`` (its adapter's ``token_events``): those skip the JSON parse.

        Holds until called again; any engine's shapes are correct on any stream
        (module docstring), they only decide how much of it takes the fast path.
        """
        self._shapes = plain_shapes(shapes, self.kind)

    def rename_model(self, engine_name: str | None, served_name: str | None) -> None:
        """The next attempt's engine calls the model ``engine_name``; clients know it as
        ``served_name`` (trtllm-serve lists its model path): an answer identity adopted
        from an event naming ``engine_name`` shows ``served_name``. Such events then
        differ from the identity and take the JSON path. None: no renaming."""
        self._rename = (engine_name, served_name) if engine_name and served_name else None

    def begin_continuation(self, mode: Mode, *, seam_prefix: str | None = None) -> None:
        """The next :meth:`feed` bytes come from a continuation sent in ``mode``.

        ``seam_prefix`` is ``ContinuationPlan.seam_prefix`` (see :func:`.continuation.repair_seam`).
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
        """Consume upstream SSE bytes (any chunking); return bytes for the client.

        Plain token events are matched in place in the upstream bytes (no copy per
        event); a run of them goes out as slices of those bytes, joined once per call.
        """
        prefix = self._prefix
        if (  # the usual read: exactly one plain token event
            prefix is not None
            and not self._buffer
            and data.startswith(prefix)
            and data.find(b"\n\n") == len(data) - 2
            and self.finish_reason is None
            and not self._seam_pending
            and b"\r" not in data
        ):
            for shape, text_group, ids_group in self._shapes:
                m = shape.fullmatch(data, len(prefix))
                if m is not None:
                    out: list[bytes] = []
                    taken = self._plain(data, m, text_group, ids_group, out, 0)
                    if taken == 0:
                        return data
                    if taken > 0:
                        out.append(data[taken:])
                        return b"".join(out)
                    break
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        buffer = self._buffer + data if self._buffer else data
        end = buffer.find(b"\n\n")
        if end < 0:
            self._buffer = buffer
            return b""
        out = []
        start = pos = 0  # this event's start; the first byte not yet in ``out``
        shapes = self._shapes
        prefix = prefix if shapes else None
        while end >= 0:
            end += 2
            taken = -1
            if (
                prefix is not None
                and buffer.startswith(prefix, start)
                and self.finish_reason is None
                and not self._seam_pending
            ):
                for shape, text_group, ids_group in shapes:
                    m = shape.fullmatch(buffer, start + len(prefix), end)
                    if m is not None:
                        taken = self._plain(buffer, m, text_group, ids_group, out, pos)
                        break
            if taken >= 0:
                pos = taken
            else:
                if pos < start:
                    out.append(buffer[pos:start])
                out.append(self._event(buffer[start:end]))
                pos = end
                if shapes:
                    prefix = self._prefix
            start = end
            end = buffer.find(b"\n\n", start)
        if pos == 0 and start == len(buffer):
            self._buffer = b""
            return buffer  # every event plain and forwarded as is (the usual chunk)
        if pos < start:
            out.append(buffer[pos:start])
        self._buffer = buffer[start:]
        return out[0] if len(out) == 1 else b"".join(out)

    def finish(self) -> bytes:
        """The tail: held final event, the one usage event (if asked), ``[DONE]``. Idempotent."""
        if self._done_sent:
            return b""
        self._done_sent = True
        held, self._held = self._held, None
        return stream_tail(
            self, held, include_usage=self.include_usage, usage_template=self._usage_template
        )

    # -- events ----------------------------------------------------------

    def _plain(
        self,
        buffer: bytes,
        m: re.Match[bytes],
        text_group: int,
        ids_group: int,
        out: list[bytes],
        pos: int,
    ) -> int:
        """Record a plain token event matched in ``buffer`` (module docstring); its token
        ids go to ``out`` as ``null`` when the client did not ask for them. Returns the
        first byte of ``buffer`` not yet in ``out``; -1: take the JSON path (nothing
        recorded)."""
        t0, t1 = m.span(text_group)
        quoted = b""
        try:
            if buffer.find(b"\\", t0, t1) < 0:
                text = buffer[t0:t1].decode()
            else:  # escapes: rare, decoded as JSON
                quoted = b'"' + buffer[t0:t1] + b'"'
                text = json.loads(quoted)
        except ValueError:  # not UTF-8: the JSON path decides what it is
            return -1
        i0, i1 = m.span(ids_group) if ids_group else (-1, -1)
        if i0 >= 0 and buffer[i0] == 91:  # "[": a list of ids
            if not self.return_token_ids:
                if quoted and not renders_same(text, quoted):
                    return -1  # the JSON path would re-render this text differently
                out.append(buffer[pos:i0])
                out.append(b"null")
                pos = i1
            if self._token_ids is not None:
                self._ids_raw.append(buffer[i0 + 1 : i1 - 1])
            self.tokens += buffer.count(b",", i0, i1) + 1
        else:
            self._token_ids = None
            self._ids_raw.clear()
            self.tokens += 1
        self._text_parts.append(text)
        return pos

    def _event(self, raw: bytes) -> bytes:
        """One complete event the fast path did not take: parsed as JSON."""
        obj, error = read_event(raw)
        if obj is None:
            # an engine error event (or garbage) is never shown to the client: the
            # router resumes the answer elsewhere unless it is finished
            if error is not None:
                self.upstream_error = error
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
            if self._rename is not None and self.model == self._rename[0]:
                self.model = self._rename[1]
            self._prefix = identity_prefix(self.id, obj.get("object"), self.created, self.model)

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
                    return role_event(
                        obj, choice, self._identity, return_token_ids=self.return_token_ids
                    )
                delta.pop("role")
                if not delta.get("content") and choice.get("finish_reason") is None:
                    return None
            choice["delta"] = delta
        if self._seam_pending and (text or choice.get("finish_reason") is not None):
            self._seam_pending = False
            repaired = repair_seam(text, self.text, self._seam_prefix)
            if repaired != text:
                text = repaired
                if from_completions:
                    choice["text"] = text
                else:
                    choice["delta"] = {**choice["delta"], "content": text}
        # count what the client receives
        if isinstance(ids, list):
            if ids and self._token_ids is not None:  # kept as the fast path keeps them
                self._ids_raw.append(",".join([str(int(t)) for t in ids]).encode())
            self.tokens += len(ids)
        else:
            self._token_ids = None
            self._ids_raw.clear()
            self.tokens += 1
        self._text_parts.append(text)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
        usage = obj.get("usage")
        usage = client_usage(usage, self) if isinstance(usage, dict) else None
        return client_event(
            obj,
            choice,
            text,
            ids,
            self._identity,
            as_chat=self.kind == "chat" and from_completions,
            return_token_ids=self.return_token_ids,
            fresh=self._fresh,
            usage=usage,
        )

    @property
    def _identity(self) -> tuple[str | None, int | None, str | None]:
        return (self.id, self.created, self.model)

    # -- non-streaming clients -----------------------------------------

    def assemble_response(self) -> dict[str, Any]:
        """The non-streaming JSON body of the whole answer (:func:`.assemble.assemble_response`)."""
        return assemble_response(self)
