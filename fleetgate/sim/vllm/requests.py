"""vLLM request semantics after validation: model name, prompt, limits, priority.

Messages and ``param`` values are vLLM 0.32's own (recorded from a real server):
unknown model -> 404 ``NotFoundError``; ``max_tokens`` < 1 and prompts of
``max_model_len`` tokens or more -> 400 ``BadRequestError`` (the message shows
``max_model_len + 1``, as vLLM truncates tokenisation there).

``max_tokens`` has two limits (docs/emulator-fidelity.md F1): a value greater
than ``max_model_len`` itself is refused (400 ``BadRequestError``,
``param: "max_tokens"``, "max_tokens=5000 cannot be greater than
max_model_len=2048. Please request fewer output tokens."),
while a value <= ``max_model_len`` that merely overflows the context together
with the prompt is clamped to ``max_model_len - prompt_len`` (200). The prompt
is checked first (vLLM tokenises and validates the prompt before it derives the
output budget), so an over-long prompt is reported as such whatever
``max_tokens`` says. ``X-Vllm-Priority`` overrides the
body's ``priority``; ``X-Request-Id`` names the request.
Pure: no I/O; raises :class:`HttpError` that the app turns into a response.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from fleetgate.sim.generation import GenRequest, SimEngine
from fleetgate.sim.vllm.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["HttpError", "check_model", "choice_requests", "gen_request", "prompt_ids", "render"]


class HttpError(Exception):
    """An error response before any byte was sent (status + vLLM error fields)."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(str(p) for p in parts)  # vLLM's "string" content format
    return str(content)


def check_model(engine: SimEngine, name: str | None) -> str | None:
    """404 for a model the engine does not serve; the LoRA adapter ``name`` names
    (``--lora-modules``), or None for the base model."""
    o = engine.options
    if name is None or name == o.model_name:
        return None
    if name in o.lora_modules:
        return name
    raise HttpError(
        404,
        f"The model `{name}` does not exist. Valid aliases: {o.model_name}.",
        "NotFoundError",
        "model",
    )


#: vLLM 0.32's limit on ``cache_salt`` (``entrypoints/generate/base/protocol.py``).
MAX_CACHE_SALT_LENGTH = 128


def gen_request(
    engine: SimEngine,
    scope_headers: Mapping[str, str],
    req: CompletionRequest | ChatCompletionRequest,
    prompt: list[int],
    max_tokens: int | None,
    lora_name: str | None = None,
) -> GenRequest:
    o = engine.options
    if max_tokens is not None and max_tokens < 1:
        raise HttpError(
            400,
            f"max_tokens must be at least 1, got {max_tokens}. "
            f"(parameter=max_tokens, value={max_tokens})",
            "BadRequestError",
            "max_tokens",
        )
    if req.n < 1:
        raise HttpError(
            400,
            f"n must be at least 1, got {req.n}. (parameter=n, value={req.n})",
            "BadRequestError",
            "n",
        )
    if len(prompt) >= o.max_model_len:
        shown = o.max_model_len + 1 if len(prompt) > o.max_model_len else len(prompt)
        raise HttpError(
            400,
            f"This model's maximum context length is {o.max_model_len} tokens. However, "
            f"your prompt contains at least {shown} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={shown})",
            "BadRequestError",
            "input_tokens",
        )
    if max_tokens is not None and max_tokens > o.max_model_len:
        raise HttpError(
            400,
            f"max_tokens={max_tokens} cannot be greater than max_model_len={o.max_model_len}. "
            "Please request fewer output tokens. "
            f"(parameter=max_tokens, value={max_tokens})",
            "BadRequestError",
            "max_tokens",
        )
    room = o.max_model_len - len(prompt)
    limit = room if max_tokens is None else min(max_tokens, room)
    priority = req.priority
    hdr = scope_headers.get("x-vllm-priority")
    if hdr is not None:
        try:
            priority = int(hdr.strip())
        except ValueError:
            raise HttpError(
                400, f"Invalid X-Vllm-Priority header: {hdr!r}", "BadRequestError", "priority"
            ) from None
    salt = req.cache_salt
    if salt is not None and (
        not isinstance(salt, str)
        or not salt
        or len(salt) > MAX_CACHE_SALT_LENGTH
        or any(c in salt for c in "@/\\\0")
    ):
        raise HttpError(
            400,
            "Parameter 'cache_salt' must be a non-empty string of at most "
            f"{MAX_CACHE_SALT_LENGTH} characters without '@', '/', '\\' or NUL.",
            "BadRequestError",
            "cache_salt",
        )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    external = scope_headers.get("x-request-id") or req.request_id or uuid.uuid4().hex[:16]
    return GenRequest(
        request_id=engine.internal_id(external),
        prompt_token_ids=tuple(prompt),
        max_tokens=limit,
        priority=float(priority),
        ignore_eos=req.ignore_eos,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        seed=req.seed or 0,
        lora_name=lora_name,
        cache_salt=salt,
    )


def choice_requests(
    engine: SimEngine, gen: GenRequest, n: int, temperature: float | None
) -> list[GenRequest]:
    """The ``n`` independent generations of one request, choice ``i`` at index ``i``.

    Choice 0 is ``gen`` itself (so ``n: 1`` and the first of ``n`` choices agree);
    choice ``i`` gets its own engine id and, unless sampling is greedy
    (``temperature: 0``, where real vLLM gives ``n`` equal outputs), the seed
    ``seed + i``, so the choices differ but each is repeatable.
    """
    greedy = temperature == 0
    out = [gen]
    for i in range(1, n):
        external = gen.request_id.rsplit("#", 1)[0]
        out.append(
            dataclasses.replace(
                gen,
                request_id=engine.internal_id(external),
                seed=gen.seed if greedy else gen.seed + i,
            )
        )
    return out


def prompt_ids(engine: SimEngine, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise HttpError(
                400,
                f"Token id {bad[0]} is out of vocabulary "
                f"(vocab size {vocab}). (parameter=prompt, value={bad[0]})",
                "BadRequestError",
                "prompt",
            )
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt_ids(engine, prompt[0])
    if prompt is None or prompt == []:
        # vLLM 0.32's wording (fix-list F4); note there is no ``value=`` part.
        raise HttpError(
            400,
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            "BadRequestError",
            "prompt",
        )
    raise HttpError(
        400, "Batched prompts are not supported by the emulator.", "BadRequestError", "prompt"
    )


def render(
    engine: SimEngine, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    clean: list[dict[str, object]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise HttpError(
                400,
                f"1 validation error:\n  {{'type': 'missing', 'loc': 'body.messages.{i}.role',"
                " 'msg': 'Field required'}",
                "Bad Request",
                f"body.messages.{i}.role",
            )
        clean.append({"role": role, "content": content_text(m.get("content"))})
    try:
        return engine.tokenizer.render_chat(clean, add_generation_prompt)
    except ValueError as e:
        raise HttpError(400, str(e), "BadRequestError", "messages") from None
