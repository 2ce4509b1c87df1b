"""fleetgate: one fleet of vLLM and TensorRT-LLM engines on Kubernetes.

Layout (see README): ``api`` (CRD models), ``engines`` (all engine-specific
knowledge, one module per engine), ``operator`` (kopf), ``router`` (the HTTP
front door), ``sim`` (engine emulator), ``cli`` (the ``fleetgate`` command).
The development tools (bench, demo, dev cluster, dashboards) are a separate
distribution, ``fleetgate_tools`` in ``tools/``, that this package never imports.
"""

__version__ = "0.1.0"
