"""The emulated ``trtllm-serve`` (TensorRT-LLM's OpenAI-compatible server).

Modules, the same shape as :mod:`fleetgate.sim.vllm`:

* :mod:`~fleetgate.sim.trtllm.app`: the ASGI app (routes, streaming) and :func:`build_trtllm`;
* :mod:`~fleetgate.sim.trtllm.protocol`: request models;
* :mod:`~fleetgate.sim.trtllm.requests`: request semantics after validation (prompt,
  limits, priority);
* :mod:`~fleetgate.sim.trtllm.metrics`: JSON ``/metrics`` (drained iteration stats) and
  ``/prometheus/metrics`` (``trtllm_*`` families).
"""

from __future__ import annotations

from fleetgate.sim.trtllm.app import TrtllmApp, build_trtllm
from fleetgate.sim.trtllm.metrics import TrtllmMetrics

__all__ = ["TrtllmApp", "TrtllmMetrics", "build_trtllm"]
