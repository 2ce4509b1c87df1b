"""``python router_launcher.py CONFIG.yaml PORT``: the router as the chart runs it, with
Kubernetes discovery attached.

Stand-in for ``fleetgate router --config CONFIG.yaml`` until the router's config accepts
``discovery.kind: kubernetes`` (the wiring patch is in ship's report: router/config.py,
app.py and cli.py belong to engineer "router"). It does what that patch does: the
``discovery`` section becomes a KubernetesDiscoveryConfig, the rest is the ordinary
RouterConfig, and :func:`fleetgate.router.discovery_k8s.attach` runs the watches in the
app's lifespan. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import logging
import sys
from urllib.parse import urlsplit

import uvicorn
import yaml

from fleetgate.router.app import build_router
from fleetgate.router.config import is_loopback_host, parse_config
from fleetgate.router.discovery_k8s import KubernetesDiscoveryConfig, attach


def main(argv: list[str]) -> int:
    path, port = argv[0], int(argv[1])
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    discovery = data.pop("discovery", {}) or {}
    if discovery.get("kind") != "kubernetes":
        raise SystemExit(f"{path}: discovery.kind must be kubernetes here")
    k8s = KubernetesDiscoveryConfig.model_validate(discovery.get("kubernetes") or {})
    config = parse_config(data)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_router(config)

    def loopback(url: str) -> bool:
        return is_loopback_host(urlsplit(url).hostname or "")

    attach(app, k8s, allow_url=loopback if config.effective_test_mode else None)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
