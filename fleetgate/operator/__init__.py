"""The InferenceService operator.

Layers (docs/operator.md): :mod:`handlers` (thin kopf decorators) ->
:mod:`reconcile` (I/O through :mod:`kube`) -> :mod:`manifests`, :mod:`status`,
:mod:`diff` (pure). :mod:`app` assembles and runs it; :mod:`rbac` lists the
permissions it needs.
"""
