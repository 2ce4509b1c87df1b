"""The prefix token cache gives exactly the ids of tokenizing each text whole."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTok
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from fleetgate.router.config import TokenizerSpec
from fleetgate.router.scheduling.tokencache import CHUNK, Encoded, PrefixTokenCache
from fleetgate.router.scheduling.tokenize import HfTokenizer
from fleetgate.router.tokenizer_files import load_tokenizer

WORDS = (
    "the router keeps a view of which engine holds which blocks cache prefix "
    "order shipped units ref über naïve 東京 🙂 x y z Question answer"
).split()


def prose(rng: random.Random, words: int) -> str:
    parts: list[str] = []
    for _ in range(words):
        w = rng.choice(WORDS)
        r = rng.random()
        if r < 0.08:
            w = str(rng.randint(0, 10**6))
        elif r < 0.12:
            w += rng.choice([",", ".", ":", ";", "!"])
        elif r < 0.15:
            w += rng.choice(["\n", "\n\n", "  ", "\t", " \n"])
        parts.append(w)
    return " ".join(parts)


def workload(seed: int) -> list[str]:
    """Shared documents with different questions, conversations growing by a turn,
    identical repeats and unrelated texts, interleaved."""
    rng = random.Random(seed)
    docs = [prose(random.Random(seed * 31 + g), rng.randint(300, 900)) for g in range(4)]
    texts: list[str] = []
    convo = prose(rng, 200)
    for i in range(60):
        kind = i % 4
        if kind == 0:
            texts.append(f"{rng.choice(docs)}\n\nQuestion: {prose(rng, rng.randint(5, 40))}")
        elif kind == 1:
            convo += f"\nuser: {prose(rng, rng.randint(10, 60))}\nassistant: {prose(rng, 30)}"
            texts.append(convo)
        elif kind == 2 and texts:
            texts.append(rng.choice(texts))
        else:
            texts.append(prose(rng, rng.randint(100, 500)))
    return texts


def byte_level_bpe() -> HfTok:
    tok = HfTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([prose(random.Random(i), 200) for i in range(30)], trainer)
    tok.decoder = decoders.ByteLevel()
    return tok


def metaspace_bpe() -> HfTok:
    tok = HfTok(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"])
    tok.train_from_iterator([prose(random.Random(i), 200) for i in range(30)], trainer)
    return tok


def one_piece_bpe() -> HfTok:
    """No pre-tokenizer (Llama-2 style normaliser only): the whole text is one piece,
    so merges may cross any point and no cut point exists."""
    tok = HfTok(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"])
    tok.train_from_iterator([prose(random.Random(i), 200) for i in range(30)], trainer)
    return tok


def encoder(tok: HfTok) -> Callable[[str], Encoded]:
    def encode(text: str) -> Encoded:
        enc = tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets, enc.word_ids

    return encode


@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_bpe])
def test_cached_ids_equal_whole_text_ids(make: Callable[[], HfTok]) -> None:
    tok = make()
    cache = PrefixTokenCache(encoder(tok), verify_every=0)
    for seed in range(3):
        for text in workload(seed):
            assert cache.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert cache.mismatches == 0 and not cache.disabled
    # the shared parts were really reused, and most characters were not tokenized again
    assert cache.hits > 60 and cache.reused_ids > 0
    total = sum(len(t) for s in range(3) for t in workload(s))
    assert cache.encoded_chars < 0.6 * total


def test_emulator_tokenizer_through_chat_equals_uncached() -> None:
    cached = load_tokenizer("m", TokenizerSpec(kind="emulator"))
    assert isinstance(cached, HfTokenizer) and cached.prefix_cache is not None
    plain = load_tokenizer("m", TokenizerSpec(kind="emulator"))
    assert isinstance(plain, HfTokenizer)
    plain.prefix_cache = None
    rng = random.Random(7)
    history: list[dict[str, str]] = [{"role": "system", "content": prose(rng, 300)}]
    for text in workload(5):
        history.append({"role": "user", "content": text[:2000]})
        for conv in ([{"role": "user", "content": text}], history):
            assert cached.encode_chat(conv) == plain.encode_chat(conv)
        assert cached.encode_text(text) == plain.encode_text(text)  # with BOS
        history.append({"role": "assistant", "content": prose(rng, 20)})
    assert cached.prefix_cache.hits > 50 and cached.prefix_cache.mismatches == 0


def test_a_text_without_cut_points_is_tokenized_whole() -> None:
    tok = one_piece_bpe()
    cache = PrefixTokenCache(encoder(tok))
    texts = workload(1)
    for text in texts:
        assert cache.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert cache.hits == 0 and cache.reused_ids == 0


def test_a_tokenizer_breaking_the_rules_is_caught_and_the_cache_turns_off() -> None:
    """An encoder whose ids depend on how long the text is cannot be cut anywhere; the
    self-check catches it on the first checked hit and the cache stops reusing."""
    tok = byte_level_bpe()

    def odd(text: str) -> Encoded:
        enc = tok.encode(text, add_special_tokens=False)
        return [len(text) % 7, *enc.ids[1:]], enc.offsets, enc.word_ids

    cache = PrefixTokenCache(odd, verify_every=1)
    doc = prose(random.Random(3), 600)
    first = cache.encode(doc + "\n\nQuestion: one")
    assert first == list(odd(doc + "\n\nQuestion: one")[0])
    text = doc + "\n\nQuestion: a different one"
    assert cache.encode(text) == list(odd(text)[0])  # the whole-text ids, not the spliced
    assert cache.mismatches == 1 and cache.disabled and cache.chars == 0
    third = doc + "\n\nQuestion: three"
    assert cache.encode(third) == list(odd(third)[0])
    assert cache.hits == 1


def test_memory_is_bounded_by_characters_kept() -> None:
    tok = byte_level_bpe()
    cache = PrefixTokenCache(encoder(tok), max_chars=20 * CHUNK)
    for text in workload(2):
        cache.encode(text)
        assert cache.chars <= max(20 * CHUNK, len(text))


def test_a_hash_collision_does_not_return_another_texts_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fleetgate.router.scheduling.tokencache as tc

    tok = byte_level_bpe()
    monkeypatch.setattr(tc, "_chain", lambda text, n: list(range(n)))  # every text collides
    cache = PrefixTokenCache(encoder(tok), verify_every=0)
    a = prose(random.Random(1), 400)
    b = prose(random.Random(2), 400)
    assert cache.encode(a) == tok.encode(a, add_special_tokens=False).ids
    assert cache.encode(b) == tok.encode(b, add_special_tokens=False).ids
    assert cache.hits == 0


def test_hf_tokenizer_with_truncation_in_its_file_keeps_no_cache(tmp_path: Path) -> None:
    tok = byte_level_bpe()
    tok.enable_truncation(64)
    t = HfTokenizer(tok.to_str(), {}, None)
    assert t.prefix_cache is None
    text = prose(random.Random(4), 400)
    assert t.encode_text(text) == tok.encode(text).ids
