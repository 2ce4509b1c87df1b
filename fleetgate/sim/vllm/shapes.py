"""Pure builders for parts of vLLM response bodies: ``usage`` and ``logprobs``.

Shapes follow the 0.32 recordings (``completions_logprobs.json``,
``chat_logprobs.json``, ``*_stream_usage*``). The emulator has no real
distribution over tokens, so log-probabilities are a deterministic function
of (token id, position): the sampled token is always the most likely one and
its ``k - 1`` alternatives are the following vocabulary ids with lower values.
That keeps the shapes, types and invariants clients rely on (sampled token
first in ``top_logprobs``, values <= 0, ``text_offset`` cumulative) without
pretending to be a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "StreamOptions",
    "chat_logprobs",
    "completion_logprobs",
    "created_cache_tokens",
    "token_logprob",
    "usage",
]


@dataclasses.dataclass(frozen=True, slots=True)
class StreamOptions:
    """What one request asked for in its response (engine-neutral flags)."""

    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    logprobs: int | None = None
    """Completions ``logprobs: k`` or chat ``top_logprobs`` (with ``logprobs: true``)."""

    @property
    def fast_path(self) -> bool:
        """True when a mid-stream event carries nothing but its text."""
        return not (self.continuous_usage or self.return_token_ids or self.logprobs is not None)


def usage(
    prompt: int,
    completion: int,
    cached: int,
    details: bool,
    full: bool,
    created: int | None = None,
) -> dict[str, Any]:
    """``usage`` as vLLM 0.32 writes it (fix-list F2 of docs/emulator-fidelity.md).

    ``full`` (non-streamed responses) always has both ``*_details`` keys (null
    unless ``--enable-prompt-tokens-details``); with details on,
    ``prompt_tokens_details`` has all three keys ``cached_tokens``,
    ``created_cache_tokens`` (``created``: null on completions, an int on chat)
    and ``multimodal_tokens`` (null: text only). Stream usage (the final usage
    chunk, continuous usage) has ``prompt_tokens_details`` only when enabled and
    then only its non-null keys: ``cached_tokens`` on completions, plus
    ``created_cache_tokens`` on chat.
    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if full:
        out["prompt_tokens_details"] = (
            {"cached_tokens": cached, "created_cache_tokens": created, "multimodal_tokens": None}
            if details
            else None
        )
        out["completion_tokens_details"] = None
    elif details:
        block: dict[str, Any] = {"cached_tokens": cached}
        if created is not None:
            block["created_cache_tokens"] = created
        out["prompt_tokens_details"] = block
    return out


def created_cache_tokens(prompt: int, cached: int, block_size: int) -> int:
    """Prompt tokens this request newly wrote to the prefix cache: its whole blocks
    (only full blocks are cached) minus those it found there already.

    An emulator reading of vLLM's ``created_cache_tokens`` (cache writes); the real
    server was only observed with short chat prompts, where it is 0 as here.
    """
    return max(0, (prompt // block_size) * block_size - cached)


def token_logprob(token_id: int, position: int) -> float:
    """A deterministic log-probability in (-4.1, -0.1] for the sampled token."""
    h = (token_id * 0x9E3779B1 + position * 0x85EBCA77) & 0xFFFFFFFF
    return -0.1 - (h % 4000) / 1000.0


def _alternatives(token_id: int, position: int, k: int, vocab: int) -> list[tuple[int, float]]:
    lp = token_logprob(token_id, position)
    return [(token_id, lp)] + [((token_id + j) % vocab, lp - 0.25 * j) for j in range(1, k)]


def completion_logprobs(
    token_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    k: int,
    vocab: int,
    first_position: int = 0,
    first_offset: int = 0,
) -> dict[str, Any]:
    """Legacy completions shape ``{text_offset, token_logprobs, tokens, top_logprobs}``."""
    offsets: list[int] = []
    lps: list[float] = []
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    offset = first_offset
    for i, t in enumerate(token_ids):
        text = decode([t])
        pos = first_position + i
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        lps.append(token_logprob(t, pos))
        top: dict[str, float] = {}
        for alt, lp in _alternatives(t, pos, max(k, 1), vocab)[: max(k, 1)]:
            top.setdefault(decode([alt]), lp)
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(
    token_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    k: int,
    vocab: int,
    first_position: int = 0,
) -> dict[str, Any]:
    """Chat shape ``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    content = []
    for i, t in enumerate(token_ids):
        pos = first_position + i
        text = decode([t])
        top = [
            {"token": (s := decode([alt])), "logprob": lp, "bytes": list(s.encode())}
            for alt, lp in _alternatives(t, pos, k, vocab)[:k]
        ]
        content.append(
            {
                "token": text,
                "logprob": token_logprob(t, pos),
                "bytes": list(text.encode()),
                "top_logprobs": top,
            }
        )
    return {"content": content}
