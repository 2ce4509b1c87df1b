"""The shared emulator tokenizer: exact round trips, stable ids, prefix sharing, chat template."""

from __future__ import annotations

import pytest

from fleetgate.sim.core import tokenizer as tk


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("The prefix cache is warm.", id="sentence"),
        pytest.param("", id="empty"),
        pytest.param("hello world", id="lower"),
        pytest.param("HELLO General Kenobi", id="capitals"),
        pytest.param("alpha0 beta alpha1 beta.", id="digits"),
        pytest.param("  two  spaces\tand\ttabs\n\nnewlines  ", id="whitespace"),
        pytest.param("Ünïcödé, 日本語 and emoji 🙂!", id="unicode"),
        pytest.param("x" * 50 + " zzzqqq" * 7, id="long-unknown-words"),
    ],
)
def test_decode_inverts_encode(text: str) -> None:
    ids = tk.encode(text)
    assert all(0 <= i < tk.VOCAB_SIZE for i in ids)
    assert tk.decode(ids) == text
    if text.isascii():  # multi-byte characters span several byte tokens
        assert "".join(tk.token_strs(ids)) == text


def test_ids_are_fixed_arithmetic_not_process_state() -> None:
    # Layout from the module docstring; these literals must never change
    # (block hashes and recorded workloads depend on them).
    assert tk.encode("a") == [tk.CHUNK_BASE]
    assert tk.encode(" a") == [tk.CHUNK_BASE + 18278]
    assert tk.encode("zzz") == [tk.CHUNK_BASE + 18277]
    assert tk.encode("A") == [tk.BYTE_BASE + 65]
    assert tk.encode(" that") == [tk.WORD_BASE + 1]
    assert tk.encode("That") == [tk.WORD_BASE + 2]
    assert tk.encode("hello", add_bos=True) == [tk.BOS_ID, 5809, 586]  # "hel" + "lo"
    assert tk.VOCAB_SIZE == tk.WORD_BASE + 4 * len(tk.WORDS)


def test_common_words_cost_one_token_and_unknown_ones_about_three_letters_each() -> None:
    assert len(tk.encode("the model engine with low latency")) == 6
    assert len(tk.encode("qwertyuiop")) == 4  # 3 + 3 + 3 + 1 letters


def test_equal_text_prefixes_give_equal_token_prefixes() -> None:
    system = "You are a helpful assistant. Answer the question about the cluster.\n"
    a = tk.encode(system + "user: what is the latency?")
    b = tk.encode(system + "user: how many engines?")
    shared = tk.encode(system)
    assert a[: len(shared)] == shared
    assert b[: len(shared)] == shared


def test_decode_specials_and_bad_ids() -> None:
    assert tk.decode([tk.BOS_ID, *tk.encode("hi"), tk.EOS_ID]) == "hi"
    assert tk.decode([tk.BOS_ID, tk.EOS_ID], skip_special_tokens=False) == "<s></s>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tk.decode([tk.VOCAB_SIZE])
    with pytest.raises(ValueError, match="negative"):
        tk.decode([-1])
    # a lone continuation byte is not valid UTF-8: replaced, never an exception
    assert tk.decode([tk.BYTE_BASE + 0x80]) == "\ufffd"


def test_chat_template_renders_roles_and_starts_with_bos() -> None:
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": parts},
    ]
    text = tk.render_chat(messages)
    # text parts are joined with a newline, as vLLM's "string" content format does
    assert text == "system: Be brief.\nuser: hello \nworld\nassistant: "
    assert tk.render_chat(messages, add_generation_prompt=False).endswith("world\n")
    ids = tk.encode_chat(messages)
    assert ids[0] == tk.BOS_ID
    assert tk.decode(ids) == text


@pytest.mark.parametrize(
    "message",
    [
        pytest.param({"content": "no role"}, id="missing-role"),
        pytest.param({"role": 3, "content": "x"}, id="role-not-str"),
        pytest.param({"role": "user", "content": 5}, id="content-int"),
        pytest.param({"role": "user", "content": [{"type": "image_url"}]}, id="image-part"),
    ],
)
def test_chat_template_rejects_bad_messages(message: dict[str, object]) -> None:
    with pytest.raises(tk.ChatTemplateError):
        tk.render_chat([message])
