"""The emulator's tokenizer: deterministic, stateless, cheap, exactly reversible.

Every emulated engine (vLLM and TensorRT-LLM alike) uses this one tokenizer so
that equal text gives equal token ids everywhere, block hashes agree across
engines and ``/tokenize`` agrees with the KV model (see
``fleetgate.sim.core.api``).

Design
------
The id of a piece is *computed*, never looked up in a table that grows at run
time, so the mapping is the same in every process (no ``PYTHONHASHSEED``
dependence) and :func:`decode` needs no state. The vocabulary is laid out in
fixed ranges:

========================  =====================================================
ids                       meaning
========================  =====================================================
0, 1, 2, 3                ``<unk>``, ``<s>`` (BOS), ``</s>`` (EOS), ``<pad>``
                          (Llama's order: the real fixtures start chat prompts
                          with BOS = 1)
4 .. 259                  byte fallback: one id per UTF-8 byte
260 .. 36 815             *chunks*: 1-3 lowercase ASCII letters, with or
                          without one leading space (2 x 18 278 ids)
36 816 .. VOCAB_SIZE-1    *words*: a fixed list of common English words of 4+
                          letters, each in four forms: ``w``, ``" w"``,
                          ``W`` (capitalised) and ``" W"``
========================  =====================================================

Encoding scans the text with one regular expression. A run of letters (with
an optional single leading space) becomes one word id when it is a known
form; otherwise its leading capital and the leading space go through the byte
fallback and its lowercase letters are cut into chunks of at most three
letters (the first chunk carries the space). Every other character (digits,
punctuation, newlines, non-ASCII) becomes its UTF-8 bytes. So English-like text
costs about one token per word and made-up text about one per three letters,
roughly like a real BPE.

Invariants (unit-tested):

* ``decode(encode(text)) == text`` for every ``str`` (the fallback covers all
  of Unicode).
* Equal text prefixes give equal token prefixes up to the last piece of the
  shorter text: pieces never span a word boundary, so two prompts sharing a
  system prompt share its tokens and therefore its KV blocks.
* Ids are stable across processes and Python versions (pure arithmetic).

The chat template (:func:`render_chat`) is plain text: ``"<role>: <content>\\n"``
per message, plus ``"assistant:"`` when a generation prompt is asked for;
:func:`encode_chat` prepends BOS, as real chat templates do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
PAD_ID = 3
SPECIAL_TEXT: dict[int, str] = {UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>", PAD_ID: "<pad>"}

BYTE_BASE = 4
CHUNK_BASE = BYTE_BASE + 256
_ALPHA = "abcdefghijklmnopqrstuvwxyz"
#: number of 1-, 2- and 3-letter lowercase strings
_CHUNKS_PER_SPACE = 26 + 26 * 26 + 26 * 26 * 26
WORD_BASE = CHUNK_BASE + 2 * _CHUNKS_PER_SPACE

# Common English words of four or more letters. Order is part of the id
# layout: only ever APPEND to this list, never reorder or delete.
_WORD_TEXT = """
that with have this will your from they know want been good much some time very
when come here just like long make many more only over such take than them well
were what about after again also back because before being both call came could
down each even find first give great hand help high home into keep kind last
leave left life little look made most must name never next night open other
part people place point right same seem show side small sound still story study
their there these thing think three through together under until upon used
water where which while without word work world would write year years young
answer around change different does every follow form found going house large
learn letter light line mean might mother move need number off often page paper
play read school should something sometimes start state tell those thought
turn went why another between city country early earth enough example family
father food head important india land live mile near only plant real river
second sentence something soon stop tree watch above along always begin began
below body book carry children close color cross draw during feet fire four
friend group grow half hard hear hold horse hour idea include information list
money morning music notice often order question quick rain ready remember
model models engine engines token tokens cache prefix request requests server
servers batch queue queues latency router routing priority memory block blocks
kernel compute network cluster service services deploy metric metrics scheduler
inference prompt prompts output input context language system user assistant
data value values result results table alpha beta gamma delta question answer
function method class object string integer float list array return error
"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(w for w in _WORD_TEXT.split() if len(w) >= 4))
_FORMS_PER_WORD = 4
VOCAB_SIZE = WORD_BASE + _FORMS_PER_WORD * len(WORDS)

_WORD_ID: dict[str, int] = {}
_ID_TEXT: dict[int, str] = {}
for _i, _w in enumerate(WORDS):
    for _j, _form in enumerate((_w, " " + _w, _w.capitalize(), " " + _w.capitalize())):
        _WORD_ID[_form] = WORD_BASE + _FORMS_PER_WORD * _i + _j
        _ID_TEXT[WORD_BASE + _FORMS_PER_WORD * _i + _j] = _form
_CHUNK_OFFSET = {1: 0, 2: 26, 3: 26 + 26 * 26}
_PIECE = re.compile(r"( ?)([A-Za-z][a-z]*)|(.)", re.DOTALL)


class ChatTemplateError(ValueError):
    """A chat message has a shape the template cannot render."""


def _chunk_id(letters: str, space: bool) -> int:
    index = 0
    for ch in letters:
        index = index * 26 + (ord(ch) - 97)
    return CHUNK_BASE + (_CHUNKS_PER_SPACE if space else 0) + _CHUNK_OFFSET[len(letters)] + index


def _chunk_text(token_id: int) -> str:
    index = token_id - CHUNK_BASE
    space = index >= _CHUNKS_PER_SPACE
    if space:
        index -= _CHUNKS_PER_SPACE
    length = 1 if index < 26 else 2 if index < 26 + 676 else 3
    index -= _CHUNK_OFFSET[length]
    letters = []
    for _ in range(length):
        index, rem = divmod(index, 26)
        letters.append(_ALPHA[rem])
    return (" " if space else "") + "".join(reversed(letters))


def _bytes_ids(text: str, out: list[int]) -> None:
    out.extend(BYTE_BASE + b for b in text.encode("utf-8"))


def encode(text: str, *, add_bos: bool = False) -> list[int]:
    """Token ids of ``text`` (optionally preceded by BOS)."""
    out: list[int] = [BOS_ID] if add_bos else []
    word_id = _WORD_ID
    for match in _PIECE.finditer(text):
        space, word, other = match.group(1, 2, 3)
        if other is not None:
            if other.isascii():
                out.append(BYTE_BASE + ord(other))
            else:
                _bytes_ids(other, out)
            continue
        found = word_id.get(space + word)
        if found is not None:
            out.append(found)
            continue
        rest = word
        if word[0].isupper():
            if space:
                out.append(BYTE_BASE + 32)
                space = ""
            out.append(BYTE_BASE + ord(word[0]))
            rest = word[1:]
        for start in range(0, len(rest), 3):
            out.append(_chunk_id(rest[start : start + 3], bool(space) and start == 0))
    return out


def piece(token_id: int, *, skip_special_tokens: bool = True) -> bytes:
    """The bytes one id stands for (specials: empty, or their name)."""
    if token_id < BYTE_BASE:
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        return b"" if skip_special_tokens else SPECIAL_TEXT[token_id].encode()
    if token_id < CHUNK_BASE:
        return bytes((token_id - BYTE_BASE,))
    if token_id < WORD_BASE:
        return _chunk_text(token_id).encode()
    if token_id < VOCAB_SIZE:
        return _ID_TEXT[token_id].encode()
    raise ValueError(f"token id {token_id} is outside the vocabulary (size {VOCAB_SIZE})")


def decode(token_ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``token_ids``; invalid UTF-8 from stray byte ids becomes U+FFFD.

    Raises ``ValueError`` for an id outside ``0 .. VOCAB_SIZE-1``.
    """
    data = b"".join(piece(t, skip_special_tokens=skip_special_tokens) for t in token_ids)
    return data.decode("utf-8", errors="replace")


def token_strs(token_ids: Sequence[int]) -> list[str]:
    """One display string per id (``/tokenize``'s ``token_strs``)."""
    return [
        piece(t, skip_special_tokens=False).decode("utf-8", errors="replace") for t in token_ids
    ]


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                raise ChatTemplateError("only text content parts are supported")
        return "\n".join(parts)  # vLLM joins text parts with newlines
    raise ChatTemplateError("message content must be a string or a list of text parts")


def render_chat(
    messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True
) -> str:
    """The chat template: ``"<role>: <content>\\n"`` per message.

    ``add_generation_prompt`` appends ``"assistant: "`` (the model's turn): exactly
    how an assistant message starts, as real templates end the generation prompt
    (Llama 3's ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``), so when a
    client sends the answer back the next prompt carries the generated ids right
    after it and the engine's cached answer blocks are hit.
    Raises :class:`ChatTemplateError` for a message without a string ``role``
    or with non-text content.
    """
    lines: list[str] = []
    for message in messages:
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError("every message needs a non-empty string 'role'")
        lines.append(f"{role}: {_content_text(message.get('content'))}\n")
    if add_generation_prompt:
        lines.append("assistant: ")
    return "".join(lines)


def encode_chat(
    messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of the rendered chat, starting with BOS."""
    return encode(render_chat(messages, add_generation_prompt=add_generation_prompt), add_bos=True)
