"""Registers the shared ``k8s_cluster``/``k8s_namespace`` fixtures for this directory.

If the root tests/conftest.py ever loads ``pytest_plugins = ["k8s_fixtures"]``, drop
this import so the session keeps a single cluster.
"""

from __future__ import annotations

from k8s_fixtures import k8s_cluster, k8s_namespace, pytest_collection_finish

__all__ = ["k8s_cluster", "k8s_namespace", "pytest_collection_finish"]
