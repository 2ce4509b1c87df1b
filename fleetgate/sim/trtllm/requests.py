"""trtllm-serve request semantics after validation: prompt, limits, priority.

Errors after validation are trtllm-serve's flat ``{"object": "error", ...}`` bodies
(built by the TensorRT-LLM adapter's ``error_body``); :class:`HttpError` carries the
status, message and type to the app. Pure: no I/O.
"""

from __future__ import annotations

import uuid

from fleetgate.engines.trtllm.kv_zmq import lora_id_salt
from fleetgate.sim.generation import GenRequest, SimEngine
from fleetgate.sim.trtllm.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["DEFAULT_PRIORITY", "HttpError", "gen_request"]

DEFAULT_PRIORITY = 0.5


class HttpError(Exception):
    """An error before any byte was sent: status, message and the flat body's ``type``."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type


def gen_request(engine: SimEngine, req: CompletionRequest | ChatCompletionRequest) -> GenRequest:
    """The engine request for a validated body; :class:`HttpError` when it cannot run."""
    o = engine.options
    if isinstance(req, ChatCompletionRequest):
        try:
            prompt = engine.tokenizer.render_chat(req.messages)
        except ValueError as e:
            raise HttpError(400, str(e)) from None
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        assert isinstance(req, CompletionRequest)
        p = req.prompt
        prompt = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if any(not 0 <= t < engine.tokenizer.vocab_size for t in prompt):
            raise HttpError(400, "Token id out of vocabulary range.")
        max_tokens = req.max_tokens
    if not prompt:
        raise HttpError(400, "The prompt must not be empty.")
    if len(prompt) >= o.max_model_len:
        raise HttpError(
            400,
            f"The sum of prompt length ({len(prompt)}) and query length (1) "
            f"should not exceed max_num_tokens ({o.max_model_len})",
        )
    room = o.max_model_len - len(prompt)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return GenRequest(
        request_id=engine.internal_id(uuid.uuid4().hex[:16]),
        prompt_token_ids=tuple(prompt),
        max_tokens=min(max_tokens, room) if max_tokens else min(room, 2048),
        priority=req.request_priority if req.request_priority is not None else DEFAULT_PRIORITY,
        ignore_eos=req.ignore_eos,
        stop=stop,
        seed=req.seed or 0,
        lora_name=None if req.lora_request is None else lora_id_salt(req.lora_request.lora_int_id),
    )
