"""The engine emulator: many emulated vLLM / TensorRT-LLM servers in one process.

Layers (each module's docstring has the details and invariants):

* ``core/`` (pure): tokenizer, text generation, scheduler +
  KV-cache models and step-time profiles behind ``core.api.EngineModel``.
* :mod:`~fleetgate.sim.driver`: one asyncio task per engine steps its model and
  sleeps the modelled time (``time_scale``); woken by new requests, never polls.
* :mod:`~fleetgate.sim.generation`: a request's token stream (stop strings,
  abort-on-close) and the per-request observer hooks the metrics use.
* :mod:`~fleetgate.sim.vllm` / :mod:`~fleetgate.sim.trtllm`: one package per
  engine with the same modules (``app``: raw ASGI app and builder, ``protocol``:
  request models, ``requests``: semantics after validation, ``metrics``: the
  engine's metrics endpoints) reproducing each server's wire format (vLLM checked
  against a real 0.32); error bodies come from ``fleetgate.engines`` adapters.
* :mod:`~fleetgate.sim.fleet`: :func:`run_fleet` (the Python API) and the
  ``--fleet`` file model; :mod:`~fleetgate.sim.cli`: ``fleetgate sim``.

Python API (tests, router tests, benches)::

    from fleetgate.sim import EngineSpec, run_fleet

    specs = [EngineSpec(kind="vllm"), EngineSpec(kind="trtllm", profile="test")]
    async with run_fleet(specs, "127.0.0.1", 0, model="m", time_scale=1.0) as fleet:
        url = fleet.engines[0].url            # http://127.0.0.1:<port>
        fleet.engines[0].engine.driver        # reach into the engine when a test must

Only loopback addresses are accepted; ``port=0`` gives each engine an ephemeral
port, otherwise engines take consecutive ports.

The names below are imported lazily so that importing the pure ``core``
package never pulls in uvicorn or prometheus_client.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EngineSpec", "Fleet", "FleetError", "FleetFile", "RunningEngine", "run_fleet"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("fleetgate.sim.fleet"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
