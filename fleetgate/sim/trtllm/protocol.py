"""trtllm-serve's OpenAI request models (``tensorrt_llm/serve/openai_protocol.py``), strict
as the real ones: unknown fields are a validation error (the real models forbid extra
fields), and ``priority`` exists only in the releases whose models have it
(:func:`request_model`; main: a float in [0, 1], higher first). ``stream_options``
without ``stream: true`` fails validation as it does in the real models.

The emulator acts on a few fields; the other OpenAI sampling fields the real models
declare are accepted and ignored (:class:`TrtllmRequest`). Pure: pydantic only.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "LoraRequest",
    "TrtllmRequest",
    "request_model",
]


class LoraRequest(BaseModel):
    """``lora_request``: the adapter a request runs with (the LLM API's ``LoRARequest``;
    fields it has beyond these are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class TrtllmRequest(BaseModel):
    """Fields shared by completions and chat; extra fields are refused."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    # Declared by the real models, accepted and ignored here.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    n: int = 1
    user: str | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    lora_request: LoraRequest | None = None
    """Run as LoRA task ``lora_int_id``: its blocks hash apart from the base model's and
    are published with that ``lora_id`` (the adapter's weights are not emulated)."""

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> TrtllmRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @property
    def request_priority(self) -> float | None:
        """The body's ``priority`` where the release has the field, else None."""
        value = getattr(self, "priority", None)
        return None if value is None else float(value)


class CompletionRequest(TrtllmRequest):
    prompt: str | list[int]
    echo: bool = False


class ChatCompletionRequest(TrtllmRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


class PriorityCompletionRequest(CompletionRequest):
    model_config = ConfigDict(title="CompletionRequest")

    priority: float | None = Field(default=None, ge=0.0, le=1.0)


class PriorityChatCompletionRequest(ChatCompletionRequest):
    model_config = ConfigDict(title="ChatCompletionRequest")

    priority: float | None = Field(default=None, ge=0.0, le=1.0)


def request_model(
    chat: bool, priority: bool
) -> type[CompletionRequest] | type[ChatCompletionRequest]:
    """The request model of a release (``priority``: the release's models have the field)."""
    if chat:
        return PriorityChatCompletionRequest if priority else ChatCompletionRequest
    return PriorityCompletionRequest if priority else CompletionRequest
