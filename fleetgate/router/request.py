"""The one record of a request: what the client asked for, and how far it has got.

:func:`parse_request` turns a request body and its headers into a
:class:`Request` or raises :class:`RequestError` (status + message + param,
rendered once by the ASGI layer as the OpenAI error envelope). Everything the
rest of the router needs is decided here, once:

* the model, the stream flag, the priority class and the tenant (the same
  resolution whatever the router config: ``x-fleetgate-priority`` names a class,
  integers only through ``priority.body_priority_map``);
* the router's own request id (unguessable, from the injected ``new_id``); the
  client's ``x-request-id`` is only carried along, for logs and the answer;
* prefix-affinity data (chunk chain, rendezvous order) and the scheduling view;
  the prompt's token ids for the exact view are added afterwards
  (:meth:`Request.set_tokens`, by the ASGI layer: tokenizing may run off the loop);
* whether the answer may be resumed elsewhere (``continuation.resumability``).

The second half of the record is run-time state, written only by the serve
loop, admission and the exchange: the endpoint it holds (with the router's
reservation and prefill accounting, :meth:`Request.reserve` /
:meth:`Request.release`, the one place either is done), its failures,
preemptions and parking.

Pure: no I/O; time comes in as ``now``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetgate.router.identity import OPEN, Grant, IdentityError
from fleetgate.router.priority.config import (
    PRIORITY_HEADER,
    TENANT_HEADER,
    PriorityClass,
    PriorityConfig,
    PriorityError,
    resolve_class,
    resolve_tenant,
)
from fleetgate.router.priority.continuation import Kind, request_kind, resumability
from fleetgate.router.priority.splice import StreamSplicer
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.load import kv_tokens_needed
from fleetgate.router.scheduling.plugins import uncached_tokens
from fleetgate.router.scheduling.prefix import (
    chunk_key,
    chunk_prompt,
    render_prompt,
    rendezvous_order,
)
from fleetgate.router.scheduling.types import CacheSource, EndpointId, RequestView
from fleetgate.router.state import Endpoint

Headers = list[tuple[bytes, bytes]]

#: Headers never forwarded upstream: hop-by-hop, and the router's own request headers.
HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
_NOT_FORWARDED = HOP_HEADERS | {
    PRIORITY_HEADER.encode(),
    TENANT_HEADER.encode(),
    b"x-request-id",
}
_ID_MAX = 256
#: Largest ``max_tokens`` the router accepts: no engine serves more (int32 limits).
MAX_TOKENS_LIMIT = (1 << 31) - 1


class RequestError(Exception):
    """A request the router refuses before placing it: answered with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One client request, from parsing to its last byte (see the module docstring)."""

    # -- what was asked (set by parse_request) --------------------------------
    id: str
    """The router's own id: the key of every internal table, sent upstream."""
    client_id: str | None
    """The client's ``x-request-id`` (carried into logs and the answer, never a key)."""
    path: str
    kind: Kind
    body: bytes
    doc: dict[str, Any]
    headers: Headers
    """Request headers that go upstream (hop-by-hop and fleetgate headers removed)."""
    model: str
    stream: bool
    cls: PriorityClass
    tenant: str
    arrival: float
    chain: tuple[int, ...]
    order: list[EndpointId]
    """Endpoints in rendezvous order of the prompt's first chunk (replicas agree)."""
    view: RequestView
    kv_tokens: int
    resumable: bool
    cache_salt: str | None = None
    """The body's ``cache_salt`` (vLLM hashes it into the sequence's first block): both
    views' keys start from it."""
    prompt: PromptKeys | None = None
    """The prompt as the engine's token ids (:meth:`set_tokens`), when the model has a
    tokenizer or the prompt is token ids: the exact KV view's input. None: only the
    approximate view (``chain``) applies."""

    # -- how far it has got (serve loop, admission, exchange) ------------------
    holding: Endpoint | None = None
    """The endpoint reserved for the current attempt (router accounting held)."""
    prefill: int = 0
    """Uncached prompt tokens of the current attempt counted in ``holding``'s prefill
    backlog; 0 once its first token came (or the attempt ended)."""
    believed: tuple[EndpointId, int, CacheSource] | None = None
    """(endpoint, prompt tokens it was believed to hold, the view that said so) when it
    was last reserved: before this request's own placement became pending there."""
    pending_settle: Callable[[], None] | None = None
    """Ends the current attempt's pending blocks in the exact view (``KvIndex.place``):
    called once, when its prefill is over (:meth:`prefilled`)."""
    generated: int = 0
    failed: set[str] = dataclasses.field(default_factory=set)
    failures: int = 0
    last_cause: str = ""
    resumes: int = 0
    preemptions: int = 0
    dispatched_once: bool = False
    started_at: float = 0.0
    parked_at: float | None = None
    park_cause: str = ""
    needs_final_message: bool = False
    queued: bool = False
    held: bool = False
    """Waiting for its model to scale from zero (no endpoint can serve it yet)."""
    waiter: asyncio.Future[Any] | None = None
    segment: asyncio.Task[Any] | None = None
    sending: bool = False
    preempt_pending: bool = False
    endpoint: str = "none"
    engine: str = "none"
    splicer: StreamSplicer | None = None
    """Renders the client's answer out of every attempt's bytes (resumable answers)."""
    segments: int = 0
    """Upstream attempts sent so far (the first is the request, later ones continuations)."""
    first_token_at: float | None = None
    tokens_at_park: int = 0
    last_send: float = 0.0
    objective_counted: bool = False
    last_response: tuple[int, bytes, Headers, bytes] | None = None
    """The last engine error answer (status, content type, headers, body), passed on
    when no other endpoint can serve the request."""

    @property
    def label(self) -> str:
        """The id shown in logs: the client's when it sent one."""
        return self.client_id or self.id

    # -- the router's accounting on the endpoint it holds (one place) ----------

    def set_tokens(self, token_ids: Sequence[int], *, salt: str | None = None) -> None:
        """The prompt's token ids are known: the exact view applies, and the prompt
        length (prefill and KV estimates) becomes exact. ``salt``: what the engines'
        KV events salt this model's blocks with (a LoRA adapter's name), so its keys
        match its own blocks and never the base model's."""
        self.prompt = PromptKeys(token_ids, salt=salt)
        self.view = dataclasses.replace(self.view, prompt_tokens=len(self.prompt))
        self.kv_tokens = kv_tokens_needed(len(self.prompt), self.view.max_tokens, 1)

    def believed_on(self, endpoint: EndpointId) -> tuple[int, CacheSource] | None:
        """What :attr:`believed` said of ``endpoint`` (None: reserved elsewhere, or not by
        the placer)."""
        b = self.believed
        return (b[1], b[2]) if b is not None and b[0] == endpoint else None

    def reserve(self, e: Endpoint, cached_tokens: int) -> None:
        """Hold ``e`` for the next attempt: in-flight, KV and prefill backlog;
        ``cached_tokens`` of the prompt are believed cached there."""
        self.release()
        self.prefill = uncached_tokens(self.view, cached_tokens)
        e.dispatch(self.kv_tokens, self.prefill)
        self.holding = e
        self.endpoint, self.engine = e.id, e.engine

    def prefilled(self) -> None:
        """The attempt's prefill is over (first token, or the attempt ended). Idempotent."""
        if self.prefill and self.holding is not None:
            self.holding.prefilled(self.prefill)
        self.prefill = 0
        settle, self.pending_settle = self.pending_settle, None
        if settle is not None:
            settle()

    def release(self) -> None:
        """The attempt is over: give back what :meth:`reserve` took. Idempotent."""
        self.prefilled()
        e = self.holding
        if e is not None:
            self.holding = None
            e.finish(self.kv_tokens, held_tokens=self.view.prompt_tokens + self.generated)


@dataclasses.dataclass(frozen=True, slots=True)
class ParseSettings:
    """What parsing needs from the router config (``scheduling`` + ``priority``)."""

    priority: PriorityConfig
    chunk_tokens: int = 32
    default_max_tokens: int = 256
    drop_headers: frozenset[bytes] = frozenset()
    """Request headers never forwarded beyond the fixed ones (credentials the
    identity layer consumed: ``authorization``, the gateway secret)."""


def parse_request(
    path: str,
    body: bytes,
    raw_headers: Sequence[tuple[bytes, bytes]],
    *,
    settings: ParseSettings,
    known_models: Sequence[str],
    endpoints: Sequence[EndpointId],
    new_id: Callable[[], str],
    now: float,
    grant: Grant = OPEN,
) -> Request:
    """Validate one request; raise :class:`RequestError` with the answer when it is bad.

    ``grant`` (the identity layer's decision) says whether the client's tenant and
    priority may be believed, and bounds the class."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise RequestError(400, "malformed JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"malformed JSON body: {_short(str(e))}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = doc.get("model")
    if model is None and len(known_models) == 1:
        model = known_models[0]
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required (a string)", param="model")
    if model not in known_models:
        if not known_models:
            raise RequestError(503, "no backend has reported its models yet", retry_after=1)
        raise RequestError(404, f"The model `{_short(model)}` does not exist.", param="model")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", param="stream")
    max_tokens = _max_tokens(doc, settings.default_max_tokens)
    _check_shapes(doc)
    headers: dict[str, str] = {}
    forward: Headers = []
    client_id: str | None = None
    trusted = grant.trusted_headers
    drop = settings.drop_headers
    for k, v in raw_headers:
        name = k.lower()
        if name == b"x-request-id":
            client_id = v.decode("latin-1")[:_ID_MAX]
        if trusted and name in (PRIORITY_HEADER.encode(), TENANT_HEADER.encode()):
            headers[name.decode("latin-1")] = _short(v.decode("latin-1"))
        if name not in _NOT_FORWARDED and name not in drop:
            forward.append((k, v))
    class_doc = doc if trusted else {}
    try:
        cls = resolve_class(settings.priority, headers, class_doc)
        tenant = grant.tenant or resolve_tenant(headers)
    except PriorityError as e:
        raise RequestError(e.status, _short(e.message), param=e.param) from None
    if grant is not OPEN:
        asked = PRIORITY_HEADER in headers or class_doc.get("priority") not in (None, 0, "0")
        try:
            cls = grant.apply(settings.priority, cls, asked)
        except IdentityError as e:
            raise RequestError(e.status, e.message, param=e.param) from None
    try:
        rendered = render_prompt(doc)
    except UnicodeEncodeError:
        raise RequestError(400, "the request text is not valid Unicode (lone surrogate)") from None
    salt = doc.get("cache_salt")
    cache_salt = salt if isinstance(salt, str) and salt else None  # the engine checks it
    chunked = chunk_prompt(rendered, settings.chunk_tokens, salt=cache_salt)
    chain, prompt_tokens = chunked.chain, chunked.tokens
    view = RequestView(
        model=model,
        chunks=len(chain),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        priority=cls.level,
    )
    order = rendezvous_order(chunk_key(chunked.first), endpoints)
    kind = request_kind(path)
    return Request(
        id=new_id(),
        client_id=client_id,
        path=path,
        kind=kind,
        body=body,
        doc=doc,
        headers=forward,
        model=model,
        stream=stream,
        cls=cls,
        tenant=tenant,
        arrival=now,
        chain=chain,
        order=order if chain else [],
        view=view,
        kv_tokens=kv_tokens_needed(prompt_tokens, max_tokens, 1),
        resumable=_resumable(doc, kind),
        cache_salt=cache_salt,
    )


#: Fields the router itself reads, and the JSON type each must have when present.
_SHAPES: tuple[tuple[str, type | tuple[type, ...], str], ...] = (
    ("stream_options", dict, "an object"),
    ("n", int, "an integer"),
    ("best_of", int, "an integer"),
)


def _check_shapes(doc: Mapping[str, Any]) -> None:
    """A field the router reads with the wrong JSON type is the client's 400 (the
    engines refuse them too), never an error inside the router."""
    for key, kind, what in _SHAPES:
        value = doc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise RequestError(400, f"'{key}' must be {what}", param=key)


def _resumable(doc: Mapping[str, Any], kind: Kind) -> bool:
    """Whether the answer may be continued elsewhere; a field the check cannot read
    makes it not resumable (relayed as is, the engine judges the field)."""
    try:
        return resumability(doc, kind) is None
    except (TypeError, ValueError, OverflowError, AttributeError):
        return False


def _max_tokens(doc: Mapping[str, Any], default: int) -> int:
    """The output limit the router plans for (KV need, load).

    A value the engine should judge (0, negative, a float, a string) is left to the
    engine, which answers it with its own 400; the router plans with the default.
    An integer beyond any engine's range is refused here: it would otherwise reach
    the router's own arithmetic.
    """
    for key in ("max_tokens", "max_completion_tokens"):
        value = doc.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            if value > MAX_TOKENS_LIMIT:
                raise RequestError(400, f"'{key}' must be at most {MAX_TOKENS_LIMIT}", param=key)
            return value if value > 0 else default
        if value is not None:
            return default
    return default


def _short(text: str, limit: int = 200) -> str:
    """Client-supplied text echoed in an error, cut to ``limit`` characters."""
    return text if len(text) <= limit else text[:limit] + "..."
