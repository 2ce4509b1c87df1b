"""trtllm-serve's OpenAI request models (``tensorrt_llm/serve/openai_protocol.py``).

Only the fields the emulator acts on are modelled; everything else is accepted.
``stream_options`` without ``stream: true`` fails validation as it does in the
real models, and ``priority`` is a float in [0, 1], higher first.

Pure: pydantic only.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ChatCompletionRequest", "CompletionRequest", "TrtllmRequest"]


class TrtllmRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    priority: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> TrtllmRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self


class CompletionRequest(TrtllmRequest):
    prompt: str | list[int]


class ChatCompletionRequest(TrtllmRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
