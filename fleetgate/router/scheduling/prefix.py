"""Prefix affinity without a tokenizer: render, chunk, chain-hash, index, rendezvous.

Rendering (``render_prompt``) turns a request body into bytes that two equal
prompts always share, deterministically and completely:

* chat: EVERY message, its role included, in order (routing on the first
  message only gives silent 0% hits when conversations share a system prompt,
  sglang #26263); ``tools`` too, because chat templates put them in the prompt.
  Non-string content (parts lists) is rendered as canonical JSON.
* completions: the prompt string, or token ids as decimal text.
* The model name leads, so two models never share chains.

``chunk_chain`` cuts the rendering into chunks of ``chunk_tokens`` ESTIMATED tokens
and chain-hashes the whole ones: ``h[i] = blake2b(h[i-1] || chunk[i])`` (8-byte
digests). ``h[i]`` therefore names the entire prefix up to chunk ``i``, like
vLLM's block hashes, and is stable across processes and machines (no
``hash()``/``PYTHONHASHSEED``, the other silent-0% cause).

Tokens are estimated by a regex pre-tokenizer (:data:`UNIT`): one unit per run of
up to six ASCII letters (with one leading space), per digit, per up to three
non-ASCII bytes (a CJK character), per whitespace run and per other byte
(punctuation). Fixed BYTE chunks made the view depend on the bytes per token of the
text: 128 bytes are ~32 tokens of English but ~128 of digits, so a digit-heavy
prompt's chunks were four times coarser than the engine's blocks and its token
estimate four times too small. Unit chunks keep one chunk ~ ``chunk_tokens`` tokens
whatever the text (the estimate is within ~2x of a real BPE; digits are counted
one per token, as Llama-2, Mistral, Qwen and the emulator split them).

``PrefixIndex`` keeps, per endpoint, an approximate bounded LRU set of chain
hashes it has served. Match length is found by probing from the longest
prefix down, so eviction of an old head entry never hides a longer match.

``rendezvous_order`` (highest random weight hashing) ranks endpoints for a
key, so any number of router replicas place a never-seen prefix on the same
engine without talking to each other. Bounded load (the spill) is applied by
the affinity scorer, not here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fleetgate.router.scheduling.types import EndpointId

_SEP_MSG = b"\x1e"
_SEP_FIELD = b"\x1f"


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _content(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if value is None:
        return b""
    return _canonical(value)


def render_prompt(body: Mapping[str, Any]) -> bytes:
    """Deterministic bytes of everything that makes up the prompt of ``body``."""
    parts: list[bytes] = [str(body.get("model", "")).encode(), _SEP_MSG]
    messages = body.get("messages")
    if isinstance(messages, list):
        tools = body.get("tools")
        if tools is not None:
            parts += [b"tools", _SEP_FIELD, _canonical(tools), _SEP_MSG]
        for message in messages:
            if isinstance(message, Mapping):
                parts += [str(message.get("role", "")).encode(), _SEP_FIELD]
                parts.append(_content(message.get("content")))
                extra = {k: v for k, v in message.items() if k not in ("role", "content")}
                if extra:
                    parts += [_SEP_FIELD, _canonical(extra)]
            else:
                parts.append(_content(message))
            parts.append(_SEP_MSG)
        return b"".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt.encode())
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        parts.append(" ".join(str(t) for t in prompt).encode())
    elif isinstance(prompt, list):
        # A batch: the first prompt decides placement (all go to one engine).
        if prompt:
            parts.append(render_prompt({"model": "", "prompt": prompt[0]})[1:])
    elif prompt is not None:
        parts.append(_canonical(prompt))
    return b"".join(parts)


#: One estimated token (see the module docstring). Atomic, so a failed repetition
#: never backtracks into other splits of the same run (linear time).
UNIT = rb"(?> ?[A-Za-z]{1,6}|[0-9]|[\x80-\xff]{1,3}|\s+|[^A-Za-z0-9\s\x80-\xff])"
_UNIT_RE = re.compile(UNIT)


@functools.lru_cache(maxsize=16)
def _chunk_re(chunk_tokens: int) -> re.Pattern[bytes]:
    return re.compile(b"(?>(?:" + UNIT + b"){%d})" % chunk_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunked:
    """A rendering cut into estimated-token chunks."""

    chain: tuple[int, ...]
    """Chain hashes of the whole chunks."""
    tokens: int
    """Estimated tokens of the whole rendering (whole chunks + the rest)."""
    first: bytes
    """The first chunk (the whole rendering when shorter): the rendezvous key's source."""


def chunk_prompt(data: bytes, chunk_tokens: int, *, salt: str | None = None) -> Chunked:
    """Cut ``data`` into chunks of ``chunk_tokens`` estimated tokens and chain-hash them;
    ``salt`` (a request's ``cache_salt``) starts the chain elsewhere, as the engine's
    hashes of a salted request start elsewhere."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    out: list[int] = []
    prev = (
        b"\x00" * 8
        if salt is None
        else hashlib.blake2b(salt.encode(), digest_size=8, person=b"fg-salt").digest()
    )
    pos = 0
    first = b""
    for m in _chunk_re(chunk_tokens).finditer(data):
        if m.start() != pos:  # cannot happen (every byte starts a unit); never skip bytes
            break
        chunk = m.group()
        if not first:
            first = chunk
        prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
        pos = m.end()
    rest = len(_UNIT_RE.findall(data, pos))
    return Chunked(tuple(out), len(out) * chunk_tokens + rest, first or data)


def chunk_chain(data: bytes, chunk_tokens: int) -> tuple[int, ...]:
    """Chain hashes of every whole ``chunk_tokens``-token chunk of ``data``."""
    return chunk_prompt(data, chunk_tokens).chain


def estimate_tokens(data: bytes) -> int:
    """Estimated tokens of ``data`` (the unit count)."""
    return len(_UNIT_RE.findall(data))


def first_chunk_key(data: bytes, chunk_tokens: int) -> int:
    """Rendezvous key: the first chunk (or the whole prompt when shorter)."""
    return chunk_key(chunk_prompt(data, chunk_tokens).first)


def chunk_key(first: bytes) -> int:
    """Rendezvous key of a prompt whose first chunk is ``first``."""
    digest = hashlib.blake2b(first, digest_size=8, person=b"fg-hrw").digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: int, endpoints: Iterable[EndpointId]) -> list[EndpointId]:
    """Endpoints by descending highest-random-weight for ``key`` (ties by id)."""
    kb = key.to_bytes(8, "big")

    def weight(endpoint: EndpointId) -> tuple[int, str]:
        h = hashlib.blake2b(kb + endpoint.encode(), digest_size=8).digest()
        return (int.from_bytes(h, "big"), endpoint)

    return sorted(endpoints, key=weight, reverse=True)


class PrefixIndex:
    """Per-endpoint bounded LRU sets of chain hashes (approximate: no eviction events).

    Not thread-safe; owned by one router process and only touched from its
    event loop. Bounded: at most ``capacity`` hashes per endpoint.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._sets: dict[EndpointId, OrderedDict[int, None]] = {}

    def match(self, endpoint: EndpointId, chain: Sequence[int]) -> int:
        """Number of leading chunks of ``chain`` the endpoint is believed to hold."""
        entries = self._sets.get(endpoint)
        if not entries:
            return 0
        for i in range(len(chain) - 1, -1, -1):
            if chain[i] in entries:
                return i + 1
        return 0

    def record(self, endpoint: EndpointId, chain: Sequence[int]) -> None:
        """Note that ``endpoint`` now holds every prefix of ``chain`` (most recent)."""
        if not chain:
            return
        entries = self._sets.setdefault(endpoint, OrderedDict())
        for h in chain:
            if h in entries:
                entries.move_to_end(h)
            else:
                entries[h] = None
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, endpoint: EndpointId) -> None:
        """Drop everything known about ``endpoint`` (removed, or restarted)."""
        self._sets.pop(endpoint, None)

    def size(self, endpoint: EndpointId) -> int:
        return len(self._sets.get(endpoint, ()))
