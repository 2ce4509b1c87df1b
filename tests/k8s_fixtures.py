"""pytest plugin: a real Kubernetes control plane for tests marked ``k8s``.

The root ``tests/conftest.py`` registers it once (``pytest_plugins = ["k8s_fixtures"]``),
so every test directory gets the fixtures and the whole session shares ONE cluster. Never
import the fixture functions into a module: that would define a second session fixture and
start a second cluster.

Fixtures:

* ``k8s_cluster`` (session): a started :class:`fleetgate_tools.devcluster.DevCluster` with
  ``.kubeconfig`` (Path), ``.api_url``, ``.bin_dir``, ``.token``, ``.kubectl(*args)``,
  ``.kubectl_json(*args)``, ``.apply(*objects)`` and ``.api()`` (a tiny JSON client).
  Four fake GPU nodes are Ready: ``gpu-h100-0/1`` (8 x ``nvidia.com/gpu``, label
  ``nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3``) and ``gpu-a100-0/1`` (4 GPUs,
  ``NVIDIA-A100-SXM4-80GB``). Every node is tainted ``kwok.x-k8s.io/node=fake:NoSchedule``:
  pods need ``fleetgate_tools.devcluster.FAKE_NODE_TOLERATION``. Pods get 127.0.1.x IPs.
* ``k8s_namespace`` (function): a fresh namespace, deleted afterwards, whose
  ``default`` ServiceAccount already exists (so pods can be created immediately). It
  first fails, with the logs, if a cluster component has died.

The cluster is shared by the whole session: work inside your namespace and never
cordon, taint, relabel or delete the fake nodes.

Missing binaries are built (hack/build-k8s-bins.sh: ~15 min cold on 2 cores). The
``pytest_collection_finish`` hook below does that once collection is over and before any
test runs, so a cold build is not cut short by a test's ``--timeout``; re-export the
hook next to the fixtures (as tests/devcluster/conftest.py does) or register the plugin.
A failed build or start is an ERROR of the test, never a skip: a silently skipped
cluster test is a test that asserts nothing. Teardown stops every component by PID and
fails if any survives.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetgate_tools.devcluster import BuildError, ClusterConfig, DevCluster, ensure_binaries
from fleetgate_tools.procs import is_running

_BUILD_ERROR = pytest.StashKey[BuildError]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build missing binaries before the first test, outside any per-test timeout."""
    if any(item.get_closest_marker("k8s") for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")

        def announce(log: Path) -> None:
            if reporter is not None:
                reporter.write_line(f"k8s tests: building Kubernetes binaries first; log {log}")

        try:
            ensure_binaries(on_build=announce)
        except BuildError as e:  # reported by every k8s_cluster user, not as a crash
            session.config.stash[_BUILD_ERROR] = e


@pytest.fixture(scope="session")
def k8s_cluster(request: pytest.FixtureRequest) -> Iterator[DevCluster]:
    earlier = request.config.stash.get(_BUILD_ERROR, None)
    if earlier is not None:
        raise earlier
    binset = ensure_binaries()  # BuildError propagates: the test errors, loudly
    cluster = DevCluster(binset, ClusterConfig())
    cluster.start()  # StartError (with component logs) propagates likewise
    refs = list(cluster.refs)
    try:
        yield cluster
    finally:
        cluster.stop()
        survivors = [f"{r.name} pid {r.pid}" for r in refs if is_running(r)]
        if survivors:
            pytest.fail(f"dev cluster teardown left processes running: {survivors}")


@pytest.fixture
def k8s_namespace(k8s_cluster: DevCluster) -> Iterator[str]:
    dead = k8s_cluster.dead_components()
    if dead:  # say so plainly instead of letting kubectl time out in the test
        pytest.fail(f"dev cluster component(s) died: {dead}\n{k8s_cluster.log_tails()}")
    name = f"t-{uuid.uuid4().hex[:10]}"
    k8s_cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30
    while k8s_cluster.kubectl("-n", name, "get", "sa", "default", check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail(f"default ServiceAccount never appeared in namespace {name}")
        time.sleep(0.2)
    try:
        yield name
    finally:
        k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
