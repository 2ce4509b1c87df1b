"""The emulator's tokenizer as Hugging Face files: the shipped copy is what the
generator writes, and the ``tokenizers`` library over it gives the computed ids."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTok

from fleetgate.router.scheduling.tokenize import HfTokenizer
from fleetgate.router.tokenizer_files import EMULATOR_TOKENIZER_DIR
from fleetgate.sim.core import tokenizer as tk
from fleetgate.sim.core import tokenizer_file as tf


@pytest.fixture(scope="module")
def hf() -> HfTok:
    return HfTok.from_str(tf.tokenizer_files()["tokenizer.json"])


def test_the_shipped_files_are_the_generators_output() -> None:
    """Regenerate with ``fleetgate sim --write-tokenizer fleetgate/sim/emulator-tokenizer``."""
    for name, text in tf.tokenizer_files().items():
        shipped = (EMULATOR_TOKENIZER_DIR / name).read_text(encoding="utf-8")
        assert shipped == text, f"{name} is stale: regenerate it"


def test_the_vocabulary_is_the_emulators_ids(hf: HfTok) -> None:
    assert hf.get_vocab_size() == tk.VOCAB_SIZE
    for tid in (tk.BOS_ID, tk.BYTE_BASE + 65, tk.CHUNK_BASE, tk.WORD_BASE, tk.VOCAB_SIZE - 1):
        text = hf.id_to_token(tid)
        assert text is not None and hf.token_to_id(text) == tid


TRICKY = [
    "",
    "that",
    " that",
    "xthat",  # a known word inside an unknown run is chunks
    "thatx",
    "That That THAT tHat",
    "aThat",  # a capital starts a run: a known capitalised word
    "  that\tthe\nthere therefore",
    "HTTP/1.1 200 OK\r\n",
    "order 10234 total 4512.75; ÄÖÜ ß 東京 🙂 naïve café",
    "<unk> <s> </s> <pad> <0x41>",
    "a" * 100 + " Zzzzzzz",
    "\u00a0that\u2028model",
]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [*tk.WORDS, *(w.capitalize() for w in tk.WORDS)]
    alphabet = (
        list("abcdefghijklmnopqrstuvwxyz") * 3
        + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        + list("  \n\t.,;:!?0123456789'\"-")
        + ["é", "ß", "中", "😀", "\u00a0"]
    )
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 30)):
            r = rng.random()
            if r < 0.4:
                parts.append(rng.choice(words))
            elif r < 0.7:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))))
            else:
                parts.append(rng.choice([" ", "  ", "\n", ". ", ","]))
        out.append("".join(parts))  # no separator: words run into made-up letters
    return out


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_texts_encode_and_decode_alike(hf: HfTok, text: str) -> None:
    if "<s>" in text:  # the one documented difference: added tokens match in text
        assert hf.encode(text, add_special_tokens=False).ids.count(tk.BOS_ID) == 1
        return
    ids = hf.encode(text, add_special_tokens=False).ids
    assert ids == tk.encode(text)
    assert hf.decode(ids) == text == tk.decode(ids)


def test_random_texts_encode_alike(hf: HfTok) -> None:
    texts = random_texts(3000, seed=7)
    got = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    bad = [t for t, ids in zip(texts, got, strict=True) if ids != tk.encode(t)]
    assert not bad, f"{len(bad)} of {len(texts)} differ, e.g. {bad[0]!r}"


def test_the_chat_template_renders_like_the_emulator() -> None:
    files = tf.tokenizer_files()
    tok = HfTokenizer(
        files["tokenizer.json"], json.loads(files["tokenizer_config.json"]), tf.CHAT_TEMPLATE
    )
    conversations: list[list[dict[str, object]]] = [
        [{"role": "user", "content": "hello world"}],
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Und der Preis? ÄÖÜ 東京"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = tk.encode_chat(messages, add_generation_prompt=gen)
            assert tok.encode_chat(messages, add_generation_prompt=gen) == want
    with pytest.raises(ValueError, match="role"):
        tok.encode_chat([{"content": "no role"}])


def test_cli_writes_the_files(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    r = subprocess.run(
        [sys.executable, "-m", "fleetgate", "sim", "--write-tokenizer", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert HfTok.from_file(str(out / "tokenizer.json")).get_vocab_size() == tk.VOCAB_SIZE
