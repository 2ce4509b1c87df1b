"""Reuse the token ids of a text's prefix when a new text starts the same way.

Requests of one workload share long prompt prefixes (a document asked many
questions, a conversation that grows by a turn): the exact KV view needs every
prompt as token ids, and tokenizing the shared part again and again was the
largest CPU cost of the router with KV events (a third of its CPU on shared-prefix
at 16 engines). :class:`PrefixTokenCache` keeps the ids of recent texts and, for a
new text, takes the cached ids up to a **cut point** and tokenizes only the rest.

A cut point is where a tokenizer restarting on the rest gives the same ids as
tokenizing the whole text:

* it is the start of a pre-tokenizer piece (a "word" of the encoding: BPE merges
  never cross one), so the ids before it do not depend on what follows;
* the text there is one space after a non-space character (``"... the| cache"``):
  byte-level (GPT-2, Llama 3, Qwen), Metaspace and the emulator's pre-tokenizers all
  start a piece with its leading space, and a piece starting with a space reads no
  lookbehind context;
* it lies at least :data:`MARGIN` characters before the end of the part the two
  texts share, so no lookahead of the pre-tokenizer reaches the part they differ in.

Texts are cut into :data:`CHUNK` -character chunks; each chunk boundary of a
cached text records its cut point (the last one at or before the boundary minus
the margin). A lookup finds the longest run of whole chunks the new text shares
with a cached text (chain hashes, then a string comparison, so a hash collision
cannot return another text's ids) and restarts at that chunk's cut point. A
tokenizer without such cut points (no pre-tokenizer: the whole text is one piece)
simply never hits.

These rules are what the tokenizers in use follow, not a proof for every
tokenizer, so the cache checks itself: every :attr:`verify_every`-th hit is also
tokenized whole, and one difference turns the cache off for good (``disabled``,
``mismatches``): a wrong id would silently cost prefix hits.

Pure: no I/O, no clock. Memory is bounded by the characters of the texts kept
(``max_chars``; ids cost 4 bytes each and there are fewer ids than characters).
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: Characters per chunk: the granularity of reuse.
CHUNK = 256
#: A cut point lies this many characters before the end of the shared part.
MARGIN = 32
#: Texts shorter than this are tokenized whole (nothing to gain).
MIN_CHARS = 2 * CHUNK

Encoded = tuple[Sequence[int], Sequence[tuple[int, int]], Sequence[int | None]]
"""What the tokenizer returns for a text: ids, character offsets, piece (word) ids."""


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array[int]
    cuts: list[tuple[int, int]]
    """Per chunk boundary k+1 (k from 0): (ids before the cut, cut offset); (0, 0)
    where the chunk has no usable cut point."""
    hashes: list[int] = field(default_factory=list)


def _chain(text: str, n: int) -> list[int]:
    out: list[int] = []
    h = 0
    for k in range(n):
        h = hash((h, text[k * CHUNK : (k + 1) * CHUNK]))
        out.append(h)
    return out


def _cuts(
    text: str,
    offsets: Sequence[tuple[int, int]],
    words: Sequence[int | None],
    base: int,
    chunks: range,
) -> list[tuple[int, int]]:
    """The cut point for each chunk boundary in ``chunks`` (see module doc), from an
    encoding of ``text[base:]`` (its offsets relative to ``base``, its ids counted from
    0: the caller adds the ids before ``base``)."""
    starts = [o[0] + base for o in offsets]
    out: list[tuple[int, int]] = []
    for k in chunks:
        limit = (k + 1) * CHUNK - MARGIN
        j = bisect.bisect_right(starts, limit) - 1
        found = (0, 0)
        lowest = max(0, j - 64)  # a cut within the last 64 pieces or none
        while j > lowest:
            s = starts[j]
            if (
                s > base
                and words[j] is not None
                and words[j] != words[j - 1]
                and text[s] == " "
                and not text[s - 1].isspace()
                and offsets[j - 1][1] + base <= s
            ):
                found = (j, s)
                break
            j -= 1
        out.append(found)
    return out


class PrefixTokenCache:
    """Token ids of recent texts, reused for the shared prefix of a new text."""

    def __init__(
        self,
        encode: Callable[[str], Encoded],
        *,
        max_chars: int = 16_000_000,
        verify_every: int = 32,
    ) -> None:
        self._encode = encode
        self.max_chars = max_chars
        self.verify_every = verify_every
        self._by_hash: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # id(entry) -> entry
        self._chars = 0
        self._lock = threading.Lock()  # a large prompt is tokenized in a worker thread
        self.disabled = False
        self.hits = 0
        self.misses = 0
        self.mismatches = 0
        self.reused_ids = 0
        self.encoded_chars = 0

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, as ``encode`` gives them for the whole text."""
        if self.disabled or len(text) < MIN_CHARS:
            self.encoded_chars += len(text)
            return list(self._encode(text)[0])
        n = len(text) // CHUNK
        hashes = _chain(text, n)
        with self._lock:
            entry, k = self._find(text, hashes)
        if entry is None:
            self.misses += 1
            ids, offsets, words = self._encode(text)
            self.encoded_chars += len(text)
            cuts = _cuts(text, offsets, words, 0, range(n))
            with self._lock:
                self._put(text, array("i", ids), cuts, hashes)
            return list(ids)
        j, s = entry.cuts[k]
        tail_ids, tail_offsets, tail_words = self._encode(text[s:])
        self.encoded_chars += len(text) - s
        ids = entry.ids[:j]
        ids.extend(tail_ids)
        self.hits += 1
        self.reused_ids += j
        if self.verify_every and self.hits % self.verify_every == 0:
            whole = list(self._encode(text)[0])
            self.encoded_chars += len(text)
            if whole != ids.tolist():
                self.mismatches += 1
                self.disabled = True
                with self._lock:
                    self.clear()
                return whole
        # this text's own cut points: the cached ones up to the hit, then the tail's
        cuts = entry.cuts[: k + 1] + [
            (c + j if c else 0, p)
            for c, p in _cuts(text, tail_offsets, tail_words, s, range(k + 1, n))
        ]
        with self._lock:
            if k + 1 == len(entry.hashes) and id(entry) in self._lru:
                # the new text covers every chunk of the old one: it supersedes it
                del self._lru[id(entry)]
                self._chars -= len(entry.text)
            self._put(text, ids, cuts, hashes)
        return ids.tolist()

    def _find(self, text: str, hashes: list[int]) -> tuple[_Entry | None, int]:
        """The cached text sharing the most whole chunks with ``text`` whose cut point
        for that many chunks is usable, and the chunk index (from 0)."""
        for k in range(len(hashes) - 1, -1, -1):
            entry = self._by_hash.get(hashes[k])
            if entry is None or entry.cuts[k][1] == 0:
                continue
            end = (k + 1) * CHUNK
            if entry.text[:end] != text[:end]:
                continue  # a hash collision
            if id(entry) in self._lru:
                self._lru.move_to_end(id(entry))
            return entry, k
        return None, 0

    def _put(
        self, text: str, ids: array[int], cuts: list[tuple[int, int]], hashes: list[int]
    ) -> None:
        entry = _Entry(text, ids, cuts, hashes)
        for h in hashes:
            self._by_hash[h] = entry
        self._lru[id(entry)] = entry
        self._chars += len(text)
        while self._chars > self.max_chars and len(self._lru) > 1:
            _, old = self._lru.popitem(last=False)
            self._chars -= len(old.text)
            for h in old.hashes:
                if self._by_hash.get(h) is old:
                    del self._by_hash[h]

    def clear(self) -> None:
        """Forget every text (the caller holds the lock)."""
        self._by_hash.clear()
        self._lru.clear()
        self._chars = 0

    @property
    def chars(self) -> int:
        """Characters of the texts kept (the memory bound's measure)."""
        return self._chars
