"""Engine adapters: one module per engine, each defining a module-level ``ADAPTER``.

The registry discovers adapters by scanning this package, so a new engine is one
new file here and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from fleetgate.engines.base import EngineAdapter

__all__ = ["EngineAdapter", "UnknownEngineError", "adapters", "get_adapter"]


class UnknownEngineError(KeyError):
    """No adapter has this name or alias."""


@cache
def adapters() -> dict[str, EngineAdapter]:
    """All adapters by name, discovered once."""
    found: dict[str, EngineAdapter] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        adapter = getattr(module, "ADAPTER", None)
        if adapter is not None:
            found[adapter.name] = adapter
    return found


def get_adapter(name: str) -> EngineAdapter:
    """Look an adapter up by name or alias (case-insensitive)."""
    key = name.lower()
    for adapter in adapters().values():
        if key == adapter.name or key in adapter.aliases:
            return adapter
    known = sorted(n for a in adapters().values() for n in (a.name, *a.aliases))
    raise UnknownEngineError(f"unknown engine {name!r}; known: {', '.join(known)}")
