"""vLLM's OpenAI request models, lenient and strict exactly where vLLM 0.32 is.

Behaviour as recorded from a real vLLM 0.32 server (and re-checked by
``tests/conformance`` against one, see docs/emulator-fidelity.md):

* unknown fields are accepted (``extra="allow"``), a missing ``model`` means the
  served model, ``priority: "5"`` is accepted (pydantic lax mode) while
  ``priority: "high"`` / ``temperature: "hot"`` are 400 validation errors;
* validation errors are ``{"error": {"message": "1 validation error:\\n  {...}",
  "type": "Bad Request", "param": "body.<field>", "code": 400}}``: the message is
  the Python repr of each pydantic error dict with ``loc`` flattened to
  ``body.<path>``, and bad JSON is ``json_invalid`` at ``body.<char offset>``;
  an ``input`` that is a dict (a missing field reports the whole body) is shown
  as ``'<dict of N items>'``, never its contents (fix-list F5 of
  docs/emulator-fidelity.md: ``'input': '<dict of 2 items>'`` for a chat body of
  two fields without ``messages``);
* ``max_tokens`` < 1 and prompts over ``max_model_len`` are engine errors
  (``BadRequestError`` with a plain ``param``), see :mod:`fleetgate.sim.vllm.app`.

Pure: parsing and message formatting only; bodies are built by the engine
adapter's ``error_body`` (``fleetgate.engines``).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "RequestParseError",
    "StreamOptions",
    "TokenizeRequest",
    "parse_body",
]


class RequestParseError(Exception):
    """A body that fails validation; ``message``/``param`` as vLLM words them."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Lenient):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    return_token_ids: bool | None = None
    request_id: str | None = None
    cache_salt: Any = None
    """Checked in :func:`fleetgate.sim.vllm.requests.gen_request` (vLLM's rules)."""


class CompletionRequest(_SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


M = TypeVar("M", bound=BaseModel)


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(["body", *(str(p) for p in loc)])


def _shown_input(value: Any) -> Any:
    """vLLM 0.32 elides dict inputs in validation messages to ``<dict of N items>``."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    return value


def format_validation_error(errors: list[dict[str, Any]]) -> RequestParseError:
    """``N validation error(s):\\n  {repr}`` with ``loc`` as ``body.<path>``."""
    parts = []
    for err in errors:
        item: dict[str, Any] = {
            "type": err["type"],
            "loc": _loc(tuple(err["loc"])),
            "msg": err["msg"],
            "input": _shown_input(err.get("input")),
        }
        if err.get("ctx"):
            item["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
        parts.append(repr(item))
    n = len(parts)
    noun = "error" if n == 1 else "errors"
    message = f"{n} validation {noun}:\n  " + "\n  ".join(parts)
    param = _loc(tuple(errors[0]["loc"])) if errors else None
    return RequestParseError(message, param)


def parse_body(raw: bytes, content_type: str | None, model: type[M]) -> M:
    """Decode and validate one request body as vLLM's FastAPI layer would."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise RequestParseError(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            None,
        )
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        pos = e.pos if isinstance(e, json.JSONDecodeError) else e.start
        msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        item = {
            "type": "json_invalid",
            "loc": f"body.{pos}",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
            "ctx": {"error": msg},
        }
        raise RequestParseError(f"1 validation error:\n  {item!r}", f"body.{pos}") from None
    if not isinstance(data, dict):
        item = {
            "type": "model_attributes_type",
            "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": data,
        }
        raise RequestParseError(f"1 validation error:\n  {item!r}", "body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise format_validation_error([dict(x) for x in e.errors(include_url=False)]) from None
