"""The emulator's tokenizer as standard Hugging Face tokenizer files (pure).

:mod:`fleetgate.sim.core.tokenizer` computes its ids; this module writes the same
mapping in the format every Hugging Face-style consumer reads (``tokenizer.json``
for the ``tokenizers`` library, ``tokenizer_config.json`` with the special tokens
and the Jinja chat template), so the router tokenizes for emulated engines through
the code path it uses for real ones (``scheduling.tokenizers: {kind: hf}``, or the
shorthand ``kind: emulator`` that points at the files shipped in
``fleetgate/sim/tokenizer/``).

How the computed tokenizer becomes a table-driven one:

* **pre-tokenizer**: one ``Split`` regular expression (behaviour ``Isolated``) that
  cuts text into exactly the pieces :func:`~fleetgate.sim.core.tokenizer.encode`
  emits: a known word form (a lowercase form only at the start of a letter run),
  a lone space before an unknown capitalised run, its capital, chunks of at most
  three lowercase letters (the first one of a lowercase run carrying its leading
  space), and any other single character;
* **model**: BPE with no merges, ``ignore_merges`` (a piece found in the vocabulary
  is one token) and ``byte_fallback`` (a piece that is not, i.e. one capital, a
  space, a digit, punctuation or a non-ASCII character, becomes its UTF-8 bytes as
  the ``<0xNN>`` tokens, which sit at ids 4..259 like the emulator's byte range);
* **vocabulary**: the emulator's ids exactly (specials, bytes, chunks, word forms);
* **chat template**: ``"<role>: <content>\\n"`` per message after BOS, then
  ``"assistant: "`` for a generation prompt, as :func:`render_chat` renders it.

Equality with the computed tokenizer is a test (random texts, Unicode, the chat
template), and so is equality of the shipped files with :func:`tokenizer_json` /
:func:`tokenizer_config`. One difference is documented, not hidden: a literal
``<s>`` in a chat message is the BOS token for the ``tokenizers`` library (it
matches added tokens in text, as real models' tokenizers do), bytes for the
computed tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from fleetgate.sim.core import tokenizer as t

#: the chat template: :func:`fleetgate.sim.core.tokenizer.render_chat` in Jinja, with
#: BOS first (the computed tokenizer prepends it in ``encode_chat``)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] is not string or not message['role'] %}"
    "{{ raise_exception(\"every message needs a non-empty string 'role'\") }}"
    "{% endif %}"
    "{{ message['role'] + ': ' }}"
    "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def _pattern() -> str:
    # longest first, so a word is never cut at a shorter word that starts it
    lower = "|".join(sorted(t.WORDS, key=lambda w: (-len(w), w)))
    caps = "|".join(sorted((w.capitalize() for w in t.WORDS), key=lambda w: (-len(w), w)))
    return (
        f"(?:(?<![A-Za-z]) ?| )(?:{lower})(?![a-z])"  # a known lowercase word (run start)
        f"| ?(?:{caps})(?![a-z])"  # a known capitalised word
        r"| (?=[A-Z])"  # the space before an unknown capitalised run
        r"|[A-Z]"  # its capital
        r"|(?<=[A-Za-z])[a-z]{1,3}"  # a chunk inside a run
        r"|(?:(?<![A-Za-z]) ?| )[a-z]{1,3}"  # the first chunk of a lowercase run
        r"|[\s\S]"  # anything else: one character (bytes through the fallback)
    )


def vocabulary() -> dict[str, int]:
    """Token string -> id, exactly the emulator's ids."""
    vocab = {name: i for i, name in t.SPECIAL_TEXT.items()}
    vocab.update({f"<0x{b:02X}>": t.BYTE_BASE + b for b in range(256)})
    vocab.update({t.piece(i).decode(): i for i in range(t.CHUNK_BASE, t.VOCAB_SIZE)})
    if len(vocab) != t.VOCAB_SIZE:  # two ids with one text would make the file lossy
        raise AssertionError(f"vocabulary has {len(vocab)} entries, not {t.VOCAB_SIZE}")
    return vocab


def tokenizer_json() -> dict[str, Any]:
    """The ``tokenizer.json`` document (``tokenizers`` format version 1.0)."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": name,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, name in sorted(t.SPECIAL_TEXT.items())
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": _pattern()},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": t.SPECIAL_TEXT[t.UNK_ID],
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": True,
            "ignore_merges": True,
            "vocab": vocabulary(),
            "merges": [],
        },
    }


def tokenizer_config() -> dict[str, Any]:
    """The ``tokenizer_config.json`` document: special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": t.SPECIAL_TEXT[t.BOS_ID],
        "eos_token": t.SPECIAL_TEXT[t.EOS_ID],
        "unk_token": t.SPECIAL_TEXT[t.UNK_ID],
        "pad_token": t.SPECIAL_TEXT[t.PAD_ID],
        "add_bos_token": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }


def _dump(doc: dict[str, Any]) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n"


def tokenizer_files() -> dict[str, str]:
    """File name -> text of the emulator's tokenizer directory."""
    return {
        "tokenizer.json": _dump(tokenizer_json()),
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2) + "\n",
    }
