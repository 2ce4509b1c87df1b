"""Deterministic output tokens: a pure function of the context and the seed.

The rule
--------
Let ``ctx = prompt_token_ids + generated_so_far`` and ``t = len(ctx)``. The
token produced at absolute position ``t`` is a function of only ``seed`` and a
64-bit *context hash* ``h(ctx)``, a chain over every token of the context::

    h([])        = mix(seed ^ SEED_SALT)
    h(ctx + [x]) = mix(h(ctx) ^ (x * ID_MULT + ID_SALT))

From ``v = mix(h(ctx) ^ DRAW_SALT)`` we take:

* the **EOS decision**: the low 32 bits as a uniform ``u``; EOS iff
  ``u < eos_hazard`` (unless ``ignore_eos``), and
* the **word**: the high bits index :data:`OUTPUT_IDS`, a fixed list of
  single-token words and punctuation of the shared tokenizer.

Why this shape
--------------
*Continuation property.* A request preempted (or cut off) after ``k`` tokens
and resumed elsewhere as ``prompt + generated[:k]`` with the same seed has the
same context at every later position, hence the same hashes, hence exactly the
remaining tokens of the uninterrupted run, *and* the same EOS point. Nothing
depends on where the "original" prompt ended, so the router needs no extra
state to resume a request: it sends the ids it already has.

*Output length model.* Because EOS is decided per position with a constant
hazard, the output length (without ``max_tokens``) is geometric with mean
``1/eos_hazard`` - the memoryless distribution is exactly what makes the length
survive resumption. ``max_tokens`` and ``stop_token_ids`` are applied by the
caller (:func:`finish_reason`), so they never change which tokens are chosen:
a run with a larger ``max_tokens`` extends a shorter one.

Every prompt token influences the output (the chain covers the whole context),
so different prompts give different texts. Cost: ``O(len(prompt))`` once, then
``O(1)`` per token via :class:`Stream`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from fleetgate.sim.core import tokenizer

_M64 = (1 << 64) - 1
SEED_SALT = 0x6A09E667F3BCC908
ID_MULT = 0x9E3779B97F4A7C15
ID_SALT = 0x3C6EF372FE94F82B
DRAW_SALT = 0xA54FF53A5F1D36F1


def mix(x: int) -> int:
    """SplitMix64's finaliser: a cheap, well-mixed 64-bit permutation."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _output_ids() -> tuple[int, ...]:
    words = [" " + w for w in tokenizer.WORDS[:200]]
    words += [" the", " and", " of", " to", " in", " is", " it", " for", " on", " we"]
    ids: list[int] = []
    for w in words:
        encoded = tokenizer.encode(w)
        if len(encoded) != 1:  # pragma: no cover - guarded by a unit test
            raise AssertionError(f"{w!r} is not a single token")
        ids.extend(encoded)
    ids += tokenizer.encode(".") * 8 + tokenizer.encode(",") * 12
    return tuple(ids)


#: The tokens text generation draws from: one-token words plus '.' and ','.
OUTPUT_IDS: tuple[int, ...] = _output_ids()

DEFAULT_MEAN_OUTPUT_TOKENS = 256.0


def hazard_for_mean(mean_output_tokens: float) -> float:
    """EOS probability per token for a geometric length with this mean."""
    if mean_output_tokens < 1.0:
        raise ValueError("mean_output_tokens must be at least 1")
    return 1.0 / mean_output_tokens


def context_hash(seed: int, token_ids: Iterable[int]) -> int:
    """``h(ctx)`` of the module docstring."""
    h = mix(seed ^ SEED_SALT)
    for x in token_ids:
        h = mix(h ^ ((x * ID_MULT + ID_SALT) & _M64))
    return h


def draw(h: int, eos_hazard: float, ignore_eos: bool) -> int:
    """The token at the position whose context hash is ``h``."""
    v = mix(h ^ DRAW_SALT)
    if not ignore_eos and (v & 0xFFFFFFFF) < eos_hazard * 4294967296.0:
        return tokenizer.EOS_ID
    return OUTPUT_IDS[(v >> 32) % len(OUTPUT_IDS)]


def finish_reason(
    token_id: int,
    num_generated: int,
    max_tokens: int,
    *,
    ignore_eos: bool,
    stop_token_ids: Sequence[int] = (),
) -> str | None:
    """Why generation ends after ``token_id`` (the ``num_generated``-th), if it does."""
    if token_id == tokenizer.EOS_ID and not ignore_eos:
        return "stop"
    if token_id in stop_token_ids:
        return "stop"
    if num_generated >= max_tokens:
        return "length"
    return None


@dataclasses.dataclass(slots=True)
class Stream:
    """Incremental generator over one growing context (O(1) per token)."""

    seed: int
    eos_hazard: float
    ignore_eos: bool
    _hash: int

    @classmethod
    def start(
        cls, context: Sequence[int], *, seed: int, eos_hazard: float, ignore_eos: bool
    ) -> Stream:
        return cls(seed, eos_hazard, ignore_eos, context_hash(seed, context))

    def next_token(self) -> int:
        """The token at the current end of the context; appends it."""
        token = draw(self._hash, self.eos_hazard, self.ignore_eos)
        self._hash = mix(self._hash ^ ((token * ID_MULT + ID_SALT) & _M64))
        return token


def generate(
    prompt_token_ids: Sequence[int],
    *,
    seed: int,
    max_tokens: int,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    eos_hazard: float = 1.0 / DEFAULT_MEAN_OUTPUT_TOKENS,
) -> tuple[list[int], str]:
    """The whole uninterrupted output and its finish reason (reference form)."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    stream = Stream.start(prompt_token_ids, seed=seed, eos_hazard=eos_hazard, ignore_eos=ignore_eos)
    out: list[int] = []
    while True:
        token = stream.next_token()
        out.append(token)
        reason = finish_reason(
            token, len(out), max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
        )
        if reason is not None:
            return out, reason
