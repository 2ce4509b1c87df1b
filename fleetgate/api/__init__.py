"""The ``InferenceService`` API (``fleetgate.dev/v1alpha1``).

:mod:`fleetgate.api.v1alpha1` holds the pydantic models, the single source of
truth; :mod:`fleetgate.api.crd` renders them into the CRD in ``crds/``.
"""

from __future__ import annotations

from fleetgate.api.v1alpha1 import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    InferenceService,
    InferenceServiceSpec,
    InferenceServiceStatus,
)

__all__ = [
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
]
