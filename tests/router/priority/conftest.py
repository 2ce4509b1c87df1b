"""The real vLLM server (tests/realvllm.py) for the resume-from-token-ids checks."""

from __future__ import annotations

from realvllm import real_vllm

__all__ = ["real_vllm"]
