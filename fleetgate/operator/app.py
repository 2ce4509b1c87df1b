"""Assemble and run the operator: credentials, checks, kopf, metrics and health.

:func:`run` is what ``fleetgate operator`` and the cluster tests call. It fails
fast with a :class:`StartupError` whose message is one readable line when the
operator cannot work at all:

* no Kubernetes credentials (no ``--kubeconfig``, no ``KUBECONFIG``, no
  ``~/.kube/config``, not in a pod);
* the API server is unreachable or refuses the credentials;
* the ``inferenceservices.fleetgate.dev`` CRD is not installed.

Then it serves ``/metrics`` (Prometheus, the operator's own registry) and
``/healthz`` on one port (the Helm chart probes ``/healthz`` on the metrics
port) and runs kopf until ``stop_flag`` is set. ``/healthz`` answers 200 once kopf
has started and while its thread is alive, 503 otherwise.
"""

from __future__ import annotations

import dataclasses
import gc
import http.server
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kopf
import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from urllib3.exceptions import InsecureRequestWarning

from fleetgate.api.crd import crd_name
from fleetgate.api.v1alpha1 import GROUP, KIND, VERSION
from fleetgate.operator.autoscaler import Autoscaler, fetch_text
from fleetgate.operator.handlers import register
from fleetgate.operator.kube import DynamicKubeApi, KubeApi, KubeError, NotFound
from fleetgate.operator.metrics import OperatorMetrics
from fleetgate.operator.options import OperatorOptions
from fleetgate.operator.reconcile import Reconciler, Resync

__all__ = ["Endpoints", "StartupError", "load_credentials", "run"]

log = logging.getLogger(__name__)


class StartupError(Exception):
    """The operator cannot start; the message is one line for the user."""


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoints:
    """Where /metrics and /healthz are served (port 0 = pick a free one)."""

    host: str = "0.0.0.0"
    port: int = 8080


def load_credentials(kubeconfig: str | None) -> k8s_client.Configuration:
    """Kubernetes client configuration from the usual places, or a clear error."""
    cfg = k8s_client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        first = path.split(os.pathsep)[0]
        if not Path(first).is_file():
            raise StartupError(f"kubeconfig {first} does not exist")
        try:
            k8s_config.load_kube_config(config_file=first, client_configuration=cfg)  # type: ignore[no-untyped-call]
        except (k8s_config.ConfigException, OSError, ValueError, yaml.YAMLError) as e:
            raise StartupError(f"kubeconfig {first} is not usable: {e}") from e
        return cfg
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException as e:
            raise StartupError(f"in-cluster credentials are not usable: {e}") from e
        return cfg
    default = Path.home() / ".kube" / "config"
    if default.is_file():
        try:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(default), client_configuration=cfg
            )
        except (k8s_config.ConfigException, OSError, ValueError, yaml.YAMLError) as e:
            raise StartupError(f"kubeconfig {default} is not usable: {e}") from e
        return cfg
    raise StartupError(
        "no Kubernetes credentials: pass --kubeconfig, set KUBECONFIG, create "
        "~/.kube/config, or run inside a pod with a service account"
    )


def connection_info(cfg: k8s_client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials, in kopf's terms (so kopf and our client agree)."""
    token: str | None = None
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    if auth:
        # kubeconfig tokens arrive as "Bearer T", the in-cluster loader's as "bearer T"
        scheme, _, rest = str(auth).strip().partition(" ")
        token = rest.strip() if scheme.lower() == "bearer" and rest.strip() else str(auth).strip()
    return kopf.ConnectionInfo(
        server=str(cfg.host),
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme="Bearer" if token else None,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        username=cfg.username or None,
        password=cfg.password or None,
    )


def check_api(api: KubeApi, server: str, namespace: str = "") -> None:
    """The API server answers and serves the InferenceService CRD.

    Discovery alone is not enough: right after a CRD is deleted the API server can
    still advertise it for a while, so an actual list call must succeed too.
    """
    missing = StartupError(
        f"CRD {crd_name()} is not installed in the cluster at {server}: "
        "run `kubectl apply -f crds/` (or install the Helm chart's CRDs) first"
    )
    try:
        if not api.kind_exists(f"{GROUP}/{VERSION}", KIND):
            raise missing
        api.list(f"{GROUP}/{VERSION}", KIND, namespace, "")
    except NotFound as e:
        raise missing from e
    except KubeError as e:
        raise StartupError(f"Kubernetes API at {server} refused us: {e}") from e
    except StartupError:
        raise
    except Exception as e:  # urllib3 / socket errors surface as many types
        raise StartupError(f"Kubernetes API at {server} is unreachable: {e}") from e


def _http_server(
    endpoints: Endpoints, metrics: OperatorMetrics, healthy: threading.Event
) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, ctype, code = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
            elif self.path in ("/healthz", "/livez", "/readyz"):
                ok = healthy.is_set()
                body = b"ok\n" if ok else b"kopf is not running\n"
                ctype, code = "text/plain; charset=utf-8", 200 if ok else 503
            else:
                body, ctype, code = b"not found\n", "text/plain; charset=utf-8", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return http.server.ThreadingHTTPServer((endpoints.host, endpoints.port), Handler)


def run(
    options: OperatorOptions,
    *,
    kubeconfig: str | None = None,
    namespaces: Sequence[str] = (),
    endpoints: Endpoints | None = None,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    bound: list[int] | None = None,
) -> None:
    """Run until ``stop_flag`` (or a signal in the main thread). Blocks.

    ``bound`` (tests) receives the actual metrics/health port.
    """
    cfg = load_credentials(kubeconfig)
    if not cfg.verify_ssl:
        # The kubeconfig asked for it (insecure-skip-tls-verify): say so once, not per request.
        log.warning("TLS verification of the API server is disabled by the kubeconfig")
        warnings.filterwarnings("ignore", category=InsecureRequestWarning)
    api_client = k8s_client.ApiClient(configuration=cfg)
    try:
        api = DynamicKubeApi(api_client)
        check_api(api, str(cfg.host), namespaces[0] if namespaces else "")
        metrics = OperatorMetrics()
        reconciler = Reconciler(api, options, metrics)
        registry = kopf.OperatorRegistry()
        register(registry, reconciler, connection=connection_info(cfg))
        healthy = threading.Event()
        server = _http_server(endpoints or Endpoints(), metrics, healthy)
        if bound is not None:
            bound.append(int(server.server_address[1]))
        serving = threading.Thread(target=server.serve_forever, name="operator-http", daemon=True)
        serving.start()
        started = _Relay(healthy, ready_flag)
        resync_stop = threading.Event()
        resync = threading.Thread(
            target=Resync(
                api, reconciler, tuple(namespaces), options.reconcile_interval, resync_stop
            ).run,
            name="operator-resync",
            daemon=True,
        )
        resync.start()
        autoscaler = threading.Thread(
            target=Autoscaler(
                api,
                reconciler,
                options,
                metrics,
                tuple(namespaces),
                resync_stop,
                long_poll=fetch_text,  # wake on the routers' /held
            ).run,
            name="operator-autoscaler",
            daemon=True,
        )
        autoscaler.start()
        try:
            kopf.run(
                registry=registry,
                standalone=True,
                clusterwide=not namespaces,
                namespaces=list(namespaces),
                stop_flag=stop_flag,
                ready_flag=started.flag,
            )
        finally:
            _collect_kopf_leftovers()
            healthy.clear()
            resync_stop.set()
            resync.join(timeout=30)
            autoscaler.join(timeout=30)
            started.stop()
            server.shutdown()
            server.server_close()
            serving.join(timeout=5)
    finally:
        api_client.close()  # type: ignore[no-untyped-call]


def _collect_kopf_leftovers() -> None:
    """Collect what kopf's closed event loop left for the garbage collector, quietly.

    When kopf stops, watch streams cancelled mid-response can leave aiohttp
    transports to be finalised by the garbage collector, which then warns
    (ResourceWarning) at some random later moment in an unrelated place. Their loop
    is closed by now, so collecting them here is safe and keeps the noise local.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


class _Relay:
    """Turn kopf's ready flag into ``healthy`` (and the caller's ready flag)."""

    def __init__(self, healthy: threading.Event, ready: threading.Event | None) -> None:
        self.flag = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._wait, args=(healthy, ready), name="operator-ready", daemon=True
        )
        self._thread.start()

    def _wait(self, healthy: threading.Event, ready: threading.Event | None) -> None:
        while not self._done.is_set():
            if self.flag.wait(timeout=0.2):
                healthy.set()
                if ready is not None:
                    ready.set()
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
