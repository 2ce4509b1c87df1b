"""textgen: determinism, the continuation (resume) property and the output-length model."""

from __future__ import annotations

import pytest

from fleetgate.sim.core import textgen
from fleetgate.sim.core import tokenizer as tk

PROMPT = tk.encode("user: tell me about prefix caching in inference engines\nassistant:")


def test_same_inputs_same_tokens_and_different_inputs_differ() -> None:
    a = textgen.generate(PROMPT, seed=7, max_tokens=64, ignore_eos=True)
    b = textgen.generate(PROMPT, seed=7, max_tokens=64, ignore_eos=True)
    assert a == b
    assert textgen.generate(PROMPT, seed=8, max_tokens=64, ignore_eos=True)[0] != a[0]
    other = tk.encode("user: tell me about block reuse in inference engines\nassistant:")
    assert textgen.generate(other, seed=7, max_tokens=64, ignore_eos=True)[0] != a[0]


@pytest.mark.parametrize("ignore_eos", [True, False], ids=["ignore-eos", "eos"])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_resuming_from_prompt_plus_generated_gives_the_remaining_tokens(
    seed: int, ignore_eos: bool
) -> None:
    full, reason = textgen.generate(PROMPT, seed=seed, max_tokens=200, ignore_eos=ignore_eos)
    for k in (1, 2, len(full) // 2, len(full) - 1):
        if not 0 < k < len(full):
            continue
        rest, rest_reason = textgen.generate(
            PROMPT + full[:k], seed=seed, max_tokens=200 - k, ignore_eos=ignore_eos
        )
        assert rest == full[k:], f"k={k}"
        assert rest_reason == reason


def test_eos_ends_with_stop_and_ignore_eos_never_emits_it() -> None:
    stopped = 0
    for seed in range(60):
        out, reason = textgen.generate(PROMPT, seed=seed, max_tokens=400, eos_hazard=1 / 40)
        if reason == "stop":
            stopped += 1
            assert out[-1] == tk.EOS_ID and tk.EOS_ID not in out[:-1]
        else:
            assert reason == "length" and len(out) == 400
        forced, forced_reason = textgen.generate(
            PROMPT, seed=seed, max_tokens=100, ignore_eos=True, eos_hazard=1 / 40
        )
        assert tk.EOS_ID not in forced and forced_reason == "length" and len(forced) == 100
    assert stopped >= 55  # P(no EOS in 400 tokens at 1/40) ~ 4e-5 per seed


def test_output_length_is_geometric_with_the_configured_mean() -> None:
    lengths = [
        len(textgen.generate(PROMPT + [i], seed=3, max_tokens=10_000, eos_hazard=1 / 50)[0])
        for i in range(600)
    ]
    mean = sum(lengths) / len(lengths)
    assert 42 <= mean <= 58  # 1/h = 50; std of the mean ~2


def test_stop_token_ids_and_max_tokens() -> None:
    full, _ = textgen.generate(PROMPT, seed=5, max_tokens=50, ignore_eos=True)
    stop_at = full[10]
    first = full.index(stop_at)
    out, reason = textgen.generate(
        PROMPT, seed=5, max_tokens=50, ignore_eos=True, stop_token_ids=(stop_at,)
    )
    assert reason == "stop" and out == full[: first + 1]
    assert textgen.generate(PROMPT, seed=5, max_tokens=3, ignore_eos=True) == (full[:3], "length")
    with pytest.raises(ValueError):
        textgen.generate(PROMPT, seed=5, max_tokens=0)
    with pytest.raises(ValueError):
        textgen.hazard_for_mean(0.5)


def test_output_vocabulary_is_plausible_single_token_words() -> None:
    for token in set(textgen.OUTPUT_IDS):
        text = tk.decode([token])
        assert text and tk.encode(text) == [token]
    words = tk.decode(textgen.generate(PROMPT, seed=1, max_tokens=40, ignore_eos=True)[0])
    assert len(words.split()) >= 25  # mostly space-separated words
