"""Decide, without writing, whether a child needs to be applied again.

"An unchanged spec causes no writes" needs two checks, because either alone is wrong:

* **Hash of what we applied** (annotation ``fleetgate.dev/applied-hash`` on the
  child): it changes when the desired object changes, including when a field is
  *removed* from it. Server-side apply only drops a field we used to own when we
  apply again without it, so a plain "desired is contained in live" test would
  keep a stale nodeSelector forever.
* **Desired contained in live** (:func:`contained`): catches drift, i.e. someone
  edited or removed one of our fields after the last apply, while ignoring what
  the API server adds (defaults, status, other managers' fields).

Pure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ANNOTATION_APPLIED_HASH", "contained", "needs_apply", "stamp"]

ANNOTATION_APPLIED_HASH = "fleetgate.dev/applied-hash"


def _digest(obj: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def stamp(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with the applied-hash annotation of its own content."""
    stamped = json.loads(json.dumps(obj))
    annotations = stamped["metadata"].setdefault("annotations", {})
    annotations.pop(ANNOTATION_APPLIED_HASH, None)
    annotations[ANNOTATION_APPLIED_HASH] = _digest(stamped)
    return dict(stamped)


def contained(desired: Any, live: Any) -> bool:
    """True when every field of ``desired`` is present and equal in ``live``.

    Dicts may have extra keys in ``live``; lists must have the same length and
    match element-wise (Kubernetes keeps list order for what we apply).
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(k in live and contained(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return False
        return all(contained(d, x) for d, x in zip(desired, live, strict=True))
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    return bool(desired == live)


def needs_apply(stamped: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """True when ``live`` (None = absent) differs from the stamped desired object."""
    if live is None:
        return True
    live_hash = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED_HASH)
    want_hash = stamped["metadata"]["annotations"][ANNOTATION_APPLIED_HASH]
    if live_hash != want_hash:
        return True
    return not contained(
        {k: v for k, v in stamped.items() if k not in ("apiVersion", "kind")}, live
    )
