"""Per-endpoint engine identity: the adapter of an engine's release and its served name.

Two things an endpoint may know beyond its engine type (pure: standard library and
:mod:`fleetgate.engines` only):

* **the engine release** (``version``): an adapter that knows its engine's releases
  (TensorRT-LLM: ``adapter.for_version``) is bound to it, so the router sends only
  the request fields that release accepts and polls the metrics source it publishes
  load on (:func:`adapter_for`). Static backends give it as ``version``; Kubernetes
  discovery reads the operator's ``fleetgate.dev/engine-version`` annotation;
* **the served name** clients use. trtllm-serve has no served-name option and lists
  its positional model argument (``Qwen/Qwen2.5-7B-Instruct``) in ``/v1/models``.
  With a served name the endpoint's model list shows that name in place of the
  engine's (:func:`served_models`), so the router's ``/v1/models`` lists it and
  requests for it route there. trtllm-serve echoes the request's ``model`` in its
  answers without checking it (``ChatPostprocArgs.from_request`` /
  ``CompletionPostprocArgs``: ``model=request.model``; the emulator does the same;
  the adapter's ``accepts_any_model_name``), so requests go upstream unchanged. An
  engine that checks names (vLLM) gets its own name in the request's ``model``
  (``Exchange``). An answer that names the engine's own model is rewritten to the
  served name (:class:`ModelRename`, raw relays; the splicer renders the served name
  itself).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from fleetgate.engines import get_adapter
from fleetgate.engines.base import EngineAdapter, EngineVersionError

__all__ = [
    "EngineVersionError",
    "ModelRename",
    "adapter_for",
    "check_version",
    "served_models",
]


def adapter_for(engine: str, version: str | None) -> EngineAdapter:
    """The adapter of ``engine`` bound to ``version`` (the registry's when None).

    Raises :class:`EngineVersionError` for a version the adapter does not support, or
    a version given for an engine whose adapter has no release table.
    """
    adapter = get_adapter(engine)
    if version is None:
        return adapter
    bind = getattr(adapter, "for_version", None)
    if bind is None:
        raise EngineVersionError(
            f"{adapter.name} adapters do not depend on the engine version; remove the version"
        )
    bound: EngineAdapter = bind(version)
    return bound


def check_version(engine: str, version: str) -> str:
    """``version`` if :func:`adapter_for` accepts it; else :class:`EngineVersionError`."""
    adapter_for(engine, version)
    return version


def served_models(listed: Iterable[str], served: str | None) -> tuple[frozenset[str], str | None]:
    """An endpoint's model set and the engine's own name for its served model.

    ``listed`` is the engine's ``/v1/models`` in order. Without a served name, or when
    the engine lists it already (vLLM's ``--served-model-name``), the set is the
    engine's and the engine name is None (nothing to rename). Otherwise the first
    model listed (the base model: trtllm-serve lists only it, vLLM lists it before its
    LoRA adapters) is replaced by the served name and returned as the engine name.
    """
    names = list(dict.fromkeys(listed))
    if served is None or served in names or not names:
        return frozenset(names), None
    return frozenset([served, *names[1:]]), names[0]


class ModelRename:
    """Rewrites ``"model":"<engine name>"`` to ``"model":"<served name>"`` in answer bytes.

    For raw relays from an endpoint whose engine lists another name than the served
    one. Matches the compact form every supported engine writes (pydantic
    ``model_dump_json``, Starlette's ``JSONResponse``); a JSON string inside generated
    text cannot match, its quotes are escaped. :meth:`feed` takes a stream's chunks in
    order and holds back a chunk's tail only while it is a proper prefix of the
    pattern (split between two chunks), so SSE events, which end in a blank line, are
    never delayed; :meth:`flush` returns what is held at the end.
    """

    __slots__ = ("_held", "new", "old")

    def __init__(self, engine_name: str, served_name: str) -> None:
        self.old = b'"model":' + json.dumps(engine_name, ensure_ascii=False).encode()
        self.new = b'"model":' + json.dumps(served_name, ensure_ascii=False).encode()
        self._held = b""

    def whole(self, data: bytes) -> bytes:
        """A complete body."""
        return data.replace(self.old, self.new) if self.old in data else data

    def feed(self, chunk: bytes) -> bytes:
        """The next chunk of a stream: its bytes that are final, rewritten."""
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        if self.old in chunk:
            chunk = chunk.replace(self.old, self.new)
        old = self.old
        # The pattern starts with '"': only a quote in the last len-1 bytes can begin
        # a split occurrence.
        start = max(0, len(chunk) - len(old) + 1)
        q = chunk.find(b'"', start)
        while q >= 0:
            if old.startswith(chunk[q:]):
                self._held = chunk[q:]
                return chunk[:q]
            q = chunk.find(b'"', q + 1)
        return chunk

    def flush(self) -> bytes:
        """What :meth:`feed` held back, at the end of the stream."""
        held, self._held = self._held, b""
        return held
