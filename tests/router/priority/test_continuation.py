"""Continuation request bodies: modes, limits, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from fleetgate.router.priority.continuation import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    ContinuationError,
    Delivered,
    build_continuation,
    repair_seam,
    request_kind,
    resumability,
    upstream_body,
)

PROMPT_IDS = (948, 507, 547, 505, 318, 89, 84, 21)
CHAT_IDS = (1, 5, 206, 794, 477, 7, 206, 6, 206)
GEN = (345, 2008, 1937)


def _d(text: str = " 3 375 883", ids: tuple[int, ...] | None = GEN, prompt: Any = PROMPT_IDS):
    return Delivered(
        text=text, tokens=3 if text else 0, token_ids=ids if text else (), prompt_token_ids=prompt
    )


COMP = {"model": "m", "prompt": "The prefix cache is warm.", "max_tokens": 8, "temperature": 0}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello world"}],
    "max_tokens": 8,
    "temperature": 0,
    "seed": 3,
    "stop_token_ids": [13],
    "stream": True,
}


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/completions", "completions"),
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),
    ],
)
def test_request_kind(path: str, kind: str) -> None:
    assert request_kind(path) == kind


def test_request_kind_rejects_other_paths() -> None:
    with pytest.raises(ContinuationError, match="/v1/embeddings"):
        request_kind("/v1/embeddings")


@pytest.mark.parametrize(
    ("body", "kind", "why"),
    [
        pytest.param(COMP, "completions", None, id="plain"),
        pytest.param({**COMP, "prompt": list(PROMPT_IDS)}, "completions", None, id="ids"),
        pytest.param({**COMP, "prompt": ["one"]}, "completions", None, id="one-in-list"),
        pytest.param({**COMP, "n": 2}, "completions", "n > 1", id="n"),
        pytest.param({**COMP, "best_of": 3}, "completions", "best_of", id="best-of"),
        pytest.param({**COMP, "echo": True}, "completions", "echo", id="echo"),
        pytest.param({**COMP, "prompt": ["a", "b"]}, "completions", "single", id="two-prompts"),
        pytest.param({**COMP, "prompt": [[1], [2]]}, "completions", "single", id="two-id-lists"),
        pytest.param({**COMP, "prompt": 5}, "completions", "single", id="bad-prompt"),
        pytest.param({**COMP, "logprobs": 2}, "completions", "logprobs", id="nonstream-logprobs"),
        pytest.param(
            {**COMP, "logprobs": 2, "stream": True}, "completions", None, id="stream-logprobs"
        ),
        pytest.param(
            {**CHAT, "response_format": {"type": "json_object"}},
            "chat",
            "structured",
            id="json-mode",
        ),
        pytest.param({**CHAT, "stop": "\n\n"}, "chat", "stop strings", id="stop-str"),
        pytest.param({**COMP, "stop": ["", "END"]}, "completions", "stop", id="stop-list"),
        pytest.param({**CHAT, "stop": []}, "chat", None, id="stop-empty-list"),
        pytest.param({**CHAT, "stop": None}, "chat", None, id="stop-null"),
        pytest.param({**CHAT, "stop": [""]}, "chat", None, id="stop-only-empty"),
        pytest.param({**COMP, "stop_token_ids": [13]}, "completions", None, id="stop-ids"),
        pytest.param({**CHAT, "tools": [{"type": "function"}]}, "chat", "tool", id="tools"),
        pytest.param({**CHAT, "logprobs": True}, "chat", "logprobs", id="chat-logprobs"),
        pytest.param({"model": "m"}, "chat", "messages", id="no-messages"),
        pytest.param(CHAT, "chat", None, id="chat"),
    ],
)
def test_resumability(body: dict[str, Any], kind: Any, why: str | None) -> None:
    got = resumability(body, kind)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got
        with pytest.raises(ContinuationError, match="cannot be continued"):
            build_continuation(body, kind, _d(), accepts_token_ids=True, return_token_ids=True)


@pytest.mark.parametrize("return_ids", [True, False])
def test_upstream_body_forces_stream_usage_and_optionally_ids(return_ids: bool) -> None:
    original = {**COMP, "stream_options": {"continuous_usage_stats": True}}
    body = upstream_body(original, return_token_ids=return_ids)
    assert body["stream"] is True
    assert body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert ("return_token_ids" in body) is return_ids
    assert "stream" not in original and original["stream_options"] == {
        "continuous_usage_stats": True
    }


@pytest.mark.parametrize(
    ("original", "delivered", "accepts", "mode", "prompt"),
    [
        pytest.param(COMP, _d(), True, "token-ids", [*PROMPT_IDS, *GEN], id="ids-from-engine"),
        pytest.param(
            {**COMP, "prompt": list(PROMPT_IDS)},
            _d(prompt=None),
            True,
            "token-ids",
            [*PROMPT_IDS, *GEN],
            id="ids-from-client-prompt",
        ),
        pytest.param(
            {**COMP, "prompt": ["The prefix cache is warm."]},
            _d(prompt=None),
            True,
            "text",
            "The prefix cache is warm. 3 375 883",
            id="text-when-prompt-ids-unknown",
        ),
        pytest.param(
            COMP,
            _d(),
            False,
            "text",
            "The prefix cache is warm. 3 375 883",
            id="text-when-engine-refuses-ids",
        ),
        pytest.param(
            COMP,
            _d(ids=None),
            True,
            "text",
            "The prefix cache is warm. 3 375 883",
            id="text-when-generated-ids-unknown",
        ),
        pytest.param(COMP, _d(text=""), True, "restart", "The prefix cache is warm.", id="restart"),
    ],
)
def test_completions_modes(
    original: dict[str, Any], delivered: Delivered, accepts: bool, mode: str, prompt: Any
) -> None:
    plan = build_continuation(
        original, "completions", delivered, accepts_token_ids=accepts, return_token_ids=True
    )
    assert plan.mode == mode and plan.path == COMPLETIONS_PATH
    assert plan.body["prompt"] == prompt
    expected_left = 8 - delivered.tokens
    assert plan.body["max_tokens"] == expected_left == plan.remaining_tokens
    assert plan.body["stream"] is True
    assert plan.body["temperature"] == 0 and plan.body["model"] == "m"


def test_token_id_prompt_without_generated_ids_cannot_continue() -> None:
    with pytest.raises(ContinuationError, match="token-id prompt"):
        build_continuation(
            {**COMP, "prompt": list(PROMPT_IDS)},
            "completions",
            _d(ids=None, prompt=None),
            accepts_token_ids=True,
            return_token_ids=True,
        )


@pytest.mark.parametrize(
    ("extra", "left_key", "left", "min_left"),
    [
        pytest.param({}, "max_tokens", 5, None, id="max-tokens"),
        pytest.param(
            {"max_completion_tokens": 6}, "max_tokens", 5, None, id="completions-ignore-mct"
        ),
        pytest.param({"min_tokens": 5}, "max_tokens", 5, 2, id="min-tokens-shrink"),
        pytest.param({"min_tokens": 2}, "max_tokens", 5, 0, id="min-tokens-floor"),
    ],
)
def test_limits_shrink_by_delivered(
    extra: dict[str, Any], left_key: str, left: int, min_left: int | None
) -> None:
    plan = build_continuation(
        {**COMP, **extra}, "completions", _d(), accepts_token_ids=True, return_token_ids=False
    )
    assert plan.body[left_key] == left
    assert plan.body.get("min_tokens") == min_left
    assert "return_token_ids" not in plan.body


def test_chat_max_completion_tokens_wins() -> None:
    plan = build_continuation(
        {**CHAT, "max_completion_tokens": 6},
        "chat",
        _d(),
        accepts_token_ids=False,
        return_token_ids=False,
    )
    assert plan.remaining_tokens == 3
    assert plan.body["max_completion_tokens"] == 3 and plan.body["max_tokens"] == 3


def test_no_limit_stays_unlimited() -> None:
    body = {k: v for k, v in COMP.items() if k != "max_tokens"}
    plan = build_continuation(
        body, "completions", _d(), accepts_token_ids=True, return_token_ids=True
    )
    assert plan.remaining_tokens is None and "max_tokens" not in plan.body


def test_nothing_left_is_an_error() -> None:
    with pytest.raises(ContinuationError, match="nothing left"):
        build_continuation(
            {**COMP, "max_tokens": 3},
            "completions",
            _d(),
            accepts_token_ids=True,
            return_token_ids=True,
        )


def test_chat_token_ids_carries_sampling_but_not_chat_fields() -> None:
    original = {**CHAT, "priority": "batch", "chat_template_kwargs": {"x": 1}, "min_tokens": 4}
    plan = build_continuation(
        original,
        "chat",
        _d(prompt=None),
        accepts_token_ids=True,
        return_token_ids=True,
        chat_prompt_token_ids=CHAT_IDS,
    )
    assert plan.mode == "chat-token-ids" and plan.path == COMPLETIONS_PATH
    assert plan.body == {
        "model": "m",
        "temperature": 0,
        "seed": 3,
        "stop_token_ids": [13],
        "priority": "batch",
        "prompt": [*CHAT_IDS, *GEN],
        "max_tokens": 5,
        "min_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def test_chat_token_ids_from_the_stream_prompt_ids() -> None:
    plan = build_continuation(
        CHAT, "chat", _d(prompt=CHAT_IDS), accepts_token_ids=True, return_token_ids=False
    )
    assert plan.mode == "chat-token-ids"
    assert plan.body["prompt"] == [*CHAT_IDS, *GEN]
    assert "return_token_ids" not in plan.body


@pytest.mark.parametrize(
    ("accepts", "delivered", "chat_ids"),
    [
        pytest.param(False, _d(prompt=CHAT_IDS), CHAT_IDS, id="engine-refuses-ids"),
        pytest.param(True, _d(ids=None, prompt=None), CHAT_IDS, id="generated-ids-unknown"),
        pytest.param(True, _d(prompt=None), None, id="prompt-ids-unknown"),
    ],
)
def test_chat_falls_back_to_assistant_prefix(
    accepts: bool, delivered: Delivered, chat_ids: tuple[int, ...] | None
) -> None:
    plan = build_continuation(
        CHAT,
        "chat",
        delivered,
        accepts_token_ids=accepts,
        return_token_ids=False,
        chat_prompt_token_ids=chat_ids,
    )
    assert plan.mode == "chat-assistant-prefix" and plan.path == CHAT_PATH
    assert plan.body["messages"] == [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": " 3 375 883"},
    ]
    assert plan.body["continue_final_message"] is True
    assert plan.body["add_generation_prompt"] is False
    assert plan.body["max_tokens"] == 5 and plan.body["seed"] == 3
    assert CHAT["messages"] == [{"role": "user", "content": "hello world"}]  # not mutated


def test_assistant_prefix_extends_an_existing_prefill() -> None:
    original = {
        **CHAT,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure:"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    plan = build_continuation(
        original, "chat", _d(), accepts_token_ids=False, return_token_ids=False
    )
    assert plan.body["messages"][-1] == {"role": "assistant", "content": "Sure: 3 375 883"}
    assert len(plan.body["messages"]) == 2


# -- the seam -------------------------------------------------------------------

_PROMPT = "Preemption test: the quick brown fox jumps over the lazy dog."
_DELIVERED = " 40091 994\ufffdquest1808 923"


@pytest.mark.parametrize(
    ("text", "seam_prefix", "expected"),
    [
        pytest.param(_PROMPT + _DELIVERED + " 290", _PROMPT, " 290", id="leak-exact"),
        pytest.param(" 290", _PROMPT, " 290", id="no-leak"),
        pytest.param(_DELIVERED + " 290", _PROMPT, _DELIVERED + " 290", id="prefix-missing"),
        pytest.param("<|user|>\nhi\n" + _DELIVERED + " 290", None, " 290", id="chat-leak"),
        pytest.param("x" + _DELIVERED + "y", None, "x" + _DELIVERED + "y", id="chat-too-short"),
        pytest.param(" 290", None, " 290", id="chat-no-leak"),
    ],
)
def test_repair_seam(text: str, seam_prefix: str | None, expected: str) -> None:
    assert repair_seam(text, _DELIVERED, seam_prefix) == expected


def test_repair_seam_with_nothing_delivered_keeps_the_text() -> None:
    assert repair_seam("<|user|>\nhi\n 290", "", None) == "<|user|>\nhi\n 290"
    assert repair_seam("abc", "", "") == "abc"
