"""Where the tools write what they make: outside the checkout, in the user's cache.

``$FLEETGATE_CACHE`` if set, else ``~/.cache/fleetgate``: the root the install
scripts in ``hack/`` and ``fleetgate dev-cluster`` use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    raw = env.get("FLEETGATE_CACHE")
    return Path(raw) if raw else Path.home() / ".cache" / "fleetgate"
