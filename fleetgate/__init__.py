"""fleetgate: one fleet of vLLM and TensorRT-LLM engines on Kubernetes.

Layout (see README): ``api`` (CRD models), ``engines`` (all engine-specific
knowledge, one module per engine), ``operator`` (kopf), ``router`` (the HTTP
front door), ``sim`` (engine emulator), ``devcluster`` (the test control plane).
"""

__version__ = "0.1.0"
