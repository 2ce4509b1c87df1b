"""Requests -> the engine's token ids: the emulator kind (the shipped tokenizer files)
against the emulator's own ``/tokenize``, the hf kind against transformers'
``apply_chat_template`` (the call vLLM makes) on the real tiny model, and against the
real vLLM recordings."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from realvllm import real_vllm  # noqa: F401  (the session fixture)
from recordings import VLLM_032
from tokenizers import Tokenizer as HfTok
from tokenizers import models, pre_tokenizers, trainers

from fleetgate.router.config import ConfigError, TokenizerSpec, parse_config
from fleetgate.router.scheduling.tokenize import HfTokenizer, prompt_token_ids
from fleetgate.router.tokenizer_files import load_tokenizer
from fleetgate.sim.fleet import EngineSpec, run_fleet

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one line."},
        {"role": "user", "content": "Order 10234 shipped on 2026-11-29, total 4512.75?"},
        {"role": "assistant", "content": "Yes: order 10234 shipped."},
        {"role": "user", "content": "Und der Preis? ÄÖÜ ß 東京 🙂"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
        }
    ],
]


# ------------------------------------------------------------------ emulator


async def test_emulator_kind_equals_the_emulators_own_tokenize() -> None:
    tok = load_tokenizer("m", TokenizerSpec(kind="emulator"))
    assert isinstance(tok, HfTokenizer)  # the shipped files, through the code path of real models
    spec = EngineSpec(kind="vllm")
    async with run_fleet([spec], "127.0.0.1", 0, model="m", time_scale=1.0) as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=10) as c:
            for messages in CONVERSATIONS:
                r = await c.post("/tokenize", json={"model": "m", "messages": messages})
                assert r.status_code == 200, r.text
                want = r.json()["tokens"]
                got = prompt_token_ids({"model": "m", "messages": messages}, tok)
                assert got == want and len(want) > 3
            for prompt in ("The prefix cache is warm.", "digits 0123456789 and more"):
                r = await c.post("/tokenize", json={"model": "m", "prompt": prompt})
                assert prompt_token_ids({"prompt": prompt}, tok) == r.json()["tokens"]


def test_token_id_prompts_need_no_tokenizer_and_odd_bodies_give_none() -> None:
    assert prompt_token_ids({"prompt": [5, 6, 7]}, None) == [5, 6, 7]
    assert prompt_token_ids({"prompt": [[5, 6], [7]]}, None) == [5, 6]  # a batch: the first
    assert prompt_token_ids({"prompt": "text"}, None) is None
    assert prompt_token_ids({"messages": [{"role": "user", "content": "x"}]}, None) is None
    tok = load_tokenizer("m", TokenizerSpec(kind="emulator"))
    assert prompt_token_ids({"prompt": [1, "a"]}, tok) is None
    assert prompt_token_ids({"messages": [{"content": "no role"}]}, tok) is None
    assert prompt_token_ids({"messages": ["not a message"]}, tok) is None


# ------------------------------------------------------- hf, self-contained


TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def small_model(tmp_path: Path, *, template_in_config: bool) -> Path:
    """A byte-level BPE trained here, with the tiny Llama's special tokens and template."""
    tok = HfTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the cache is warm 0123456789"] * 50, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    d = tmp_path / "model"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template_in_config:
        config["chat_template"] = TEMPLATE
    else:
        (d / "chat_template.jinja").write_text(TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("in_config", [True, False])
def test_hf_kind_renders_the_template_then_encodes_without_adding_specials(
    tmp_path: Path, in_config: bool
) -> None:
    d = small_model(tmp_path, template_in_config=in_config)
    tok = load_tokenizer("m", TokenizerSpec(kind="hf", path=str(d)))
    assert isinstance(tok, HfTokenizer)
    messages = [{"role": "user", "content": "hello world"}]
    text = tok.render_chat(messages)
    assert text == "<s><|user|>\nhello world</s>\n<|assistant|>\n"
    raw = HfTok.from_file(str(d / "tokenizer.json"))
    assert tok.encode_chat(messages) == raw.encode(text, add_special_tokens=False).ids
    ids = tok.encode_chat(messages)
    vocab = raw.get_vocab()
    assert ids[0] == vocab["<s>"] and ids[1] == vocab["<|user|>"]
    assert vocab["<|assistant|>"] in ids[-2:]
    no_gen = prompt_token_ids({"messages": messages, "add_generation_prompt": False}, tok)
    assert no_gen is not None and vocab["<|assistant|>"] not in no_gen
    # image parts cannot be tokenized here: the approximate view takes the request
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert prompt_token_ids({"messages": image}, tok) is None


def test_hf_kind_bad_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer("m", TokenizerSpec(kind="hf", path=str(tmp_path)))


def test_config_section_is_typed() -> None:
    base = {"pools": [{"name": "p", "backends": [{"engine": "vllm", "url": "http://127.0.0.1:1"}]}]}
    cfg = parse_config({**base, "scheduling": {"tokenizers": {"m": {"kind": "emulator"}}}})
    assert cfg.scheduling.tokenizers["m"].kind == "emulator"
    for bad in ({"kind": "hf"}, {"kind": "emulator", "path": "/x"}, {"kind": "sentencepiece"}):
        with pytest.raises(Exception, match="tokenizers"):
            parse_config({**base, "scheduling": {"tokenizers": {"m": bad}}})


# ------------------------------------------- hf on the REAL tiny model + vLLM


@pytest.mark.realvllm
def test_hf_kind_has_the_template_skeleton_of_the_real_vllm_recordings() -> None:
    """The recordings were made with an earlier build of the tiny model (its BPE
    merges and BOS/EOS ids differ from today's ``~/.cache`` build: vLLM counted 9
    prompt tokens for "hello world" as chat, today's files give 10), so ids cannot be
    compared one to one. What must agree is the template around the content: BOS,
    the role marker (id 5 in both builds), a newline, the content, EOS, newline, the
    generation prompt marker (id 6 in both) and a newline."""
    from realvllm import ensure_model, ensure_venv

    tiny = ensure_model(ensure_venv())  # built on first use, like the real-vLLM tests
    rec = json.loads((VLLM_032 / "chat_return_token_ids.json").read_text())
    body = json.loads(rec["request"]["body"])
    vllm_ids = rec["response"]["body_json"]["prompt_token_ids"]
    assert rec["response"]["body_json"]["usage"]["prompt_tokens"] == len(vllm_ids)
    tokenize = json.loads((VLLM_032 / "tokenize_messages.json").read_text())
    assert tokenize["response"]["body_json"]["tokens"] == vllm_ids

    tok = load_tokenizer("tiny-llama", TokenizerSpec(kind="hf", path=str(tiny)))
    ours = prompt_token_ids(body, tok)
    assert ours is not None
    content = tok.encode_text(body["messages"][0]["content"], add_special_tokens=False)

    def skeleton(ids: list[int], n_content: int) -> tuple[Any, ...]:
        head, tail = ids[:3], ids[3 + n_content :]
        nl = head[2]
        return (len(tail), head[1], [t == nl for t in tail], tail[2], tail[0] != nl)

    vllm_content = len(vllm_ids) - 7
    assert skeleton(ours, len(content)) == skeleton(vllm_ids, vllm_content)
    assert ours[1] == vllm_ids[1] == 5 and ours[-2] == vllm_ids[-2] == 6


def _transformers_ids(conversations: list[list[dict[str, Any]]]) -> tuple[Path, list[list[int]]]:
    """transformers' apply_chat_template on the tiny model, in the vLLM venv."""
    from realvllm import ensure_model, ensure_venv, offline_env

    python = ensure_venv()
    model = ensure_model(python)
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "convs = json.load(sys.stdin)\n"
        "out = []\n"
        "for c in convs:\n"
        "    text = tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)\n"
        "    out.append(tok(text, add_special_tokens=False)['input_ids'])\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [str(python), "-c", script, str(model)],
        input=json.dumps(conversations),
        capture_output=True,
        text=True,
        timeout=300,
        env=offline_env(),
        check=True,
    )
    ids: list[list[int]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return model, ids


@pytest.mark.realvllm
@pytest.mark.slow
def test_hf_kind_equals_transformers_apply_chat_template_on_the_tiny_model() -> None:
    """vLLM 0.32 renders chat with the tokenizer's apply_chat_template(tokenize=False)
    and encodes without adding special tokens: the same ids, from transformers
    itself, in the vLLM venv, on the same files."""
    text_only = [c for c in CONVERSATIONS if all(isinstance(m["content"], str) for m in c)]
    model, want = _transformers_ids(text_only)
    tok = load_tokenizer("tiny-llama", TokenizerSpec(kind="hf", path=str(model)))
    got = [prompt_token_ids({"messages": c}, tok) for c in text_only]
    assert got == want


def test_tokenizer_cli_flag() -> None:
    import argparse

    from fleetgate.router.cli import build_parser, resolve_config

    parser = argparse.ArgumentParser()
    build_parser(parser)
    args = parser.parse_args(
        ["--port", "1", "--backend", "vllm=http://127.0.0.1:1",
         "--tokenizer", "a=emulator", "--tokenizer", "b=hf:/models/b"]
    )  # fmt: skip
    cfg = resolve_config(args)
    assert cfg.scheduling.tokenizers["a"].kind == "emulator"
    assert cfg.scheduling.tokenizers["b"].path == "/models/b"
    from fleetgate.router.cli import CliError

    for bad in ("a", "a=bpe:/x", "a=hf", "=emulator"):
        args = parser.parse_args(["--port", "1", "--backend", "vllm=http://127.0.0.1:1",
                                  "--tokenizer", bad])  # fmt: skip
        with pytest.raises(CliError, match="--tokenizer"):
            resolve_config(args)


@pytest.mark.realvllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_kind_equals_a_running_real_vllm(real_vllm: Any) -> None:  # noqa: F811
    """A real vLLM 0.32 on the same tiny model: its /tokenize and the prompt_tokens
    of a real chat completion equal the hf kind's ids and count."""
    from realvllm import ensure_model, ensure_venv

    tok = load_tokenizer(
        "tiny-llama", TokenizerSpec(kind="hf", path=str(ensure_model(ensure_venv())))
    )
    with httpx.Client(base_url=real_vllm.base_url, timeout=60) as c:
        for messages in CONVERSATIONS:  # text parts too: joined by newlines, as vLLM does
            body = {"model": real_vllm.model, "messages": messages}
            r = c.post("/tokenize", json={**body, "add_generation_prompt": True})
            assert r.status_code == 200, r.text
            assert prompt_token_ids(body, tok) == r.json()["tokens"]
            r = c.post("/v1/chat/completions", json={**body, "max_tokens": 1})
            assert r.json()["usage"]["prompt_tokens"] == len(prompt_token_ids(body, tok) or [])
        for prompt in ("The prefix cache is warm.", "order 10234 total 4512.75"):
            r = c.post("/tokenize", json={"model": real_vllm.model, "prompt": prompt})
            assert prompt_token_ids({"prompt": prompt}, tok) == r.json()["tokens"]


def test_hf_kind_continue_final_message_ends_at_the_last_content(tmp_path: Path) -> None:
    d = small_model(tmp_path, template_in_config=True)
    tok = load_tokenizer("m", TokenizerSpec(kind="hf", path=str(d)))
    assert isinstance(tok, HfTokenizer)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello wor"}]
    text = tok.render_chat(msgs, continue_final_message=True)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\nhello wor"
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    assert prompt_token_ids(body, tok) == tok.encode_text(text, add_special_tokens=False)


@pytest.mark.realvllm
@pytest.mark.slow
def test_prefix_token_cache_equals_transformers_on_the_tiny_model() -> None:
    """Long prompts sharing a document, and a conversation growing by a turn, through
    the prefix token cache (tokencache.py): still transformers' ids one to one."""
    rng = random.Random(11)
    words = "the engine holds blocks of cache 10234 shipped 4512.75 über 東京 🙂 ref".split()

    def prose(n: int) -> str:
        return " ".join(
            rng.choice(words) + rng.choice(["", "", ",", ".\n", "\n\n"]) for _ in range(n)
        )

    doc = prose(500)
    convs: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": f"{doc}\n\nQuestion: {prose(rng.randint(5, 30))}"}]
        for _ in range(6)
    ]
    history: list[dict[str, Any]] = [{"role": "system", "content": prose(300)}]
    for _ in range(4):
        history = [*history, {"role": "user", "content": prose(80)}]
        convs.append(history)
        history = [*history, {"role": "assistant", "content": prose(40)}]
    model, want = _transformers_ids(convs)
    tok = load_tokenizer("tiny-llama", TokenizerSpec(kind="hf", path=str(model)))
    assert isinstance(tok, HfTokenizer) and tok.prefix_cache is not None
    got = [prompt_token_ids({"messages": c}, tok) for c in convs]
    assert got == want
    assert tok.prefix_cache.hits >= 6 and tok.prefix_cache.mismatches == 0
