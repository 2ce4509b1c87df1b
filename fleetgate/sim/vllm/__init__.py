"""The emulated vLLM OpenAI-compatible server.

Modules, the same shape as :mod:`fleetgate.sim.trtllm`:

* :mod:`~fleetgate.sim.vllm.app`: the ASGI app (routes, streaming) and :func:`build_vllm`;
* :mod:`~fleetgate.sim.vllm.protocol`: request models and validation-error rendering;
* :mod:`~fleetgate.sim.vllm.requests`: request semantics after validation (model
  name, prompt, limits, priority);
* :mod:`~fleetgate.sim.vllm.shapes`: response pieces (usage, logprobs);
* :mod:`~fleetgate.sim.vllm.metrics`: ``/metrics`` (``vllm:*`` families).
"""

from __future__ import annotations

from fleetgate.sim.vllm.app import VllmApp, build_vllm
from fleetgate.sim.vllm.metrics import VllmMetrics

__all__ = ["VllmApp", "VllmMetrics", "build_vllm"]
