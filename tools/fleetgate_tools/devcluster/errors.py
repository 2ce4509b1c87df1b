"""Errors raised by the dev cluster.

::

    DevClusterError            anything the dev cluster cannot do
    +-- BuildError             hack/build-k8s-bins.sh failed or left a binary missing
    +-- StartError             a component exited or never became ready (carries log tails)
    +-- StateError             the --detach state file is missing or unreadable

    fleetgate_tools.procs.ProcessError   a program could not be started (start() raises StartError)
    +-- StopError                        a process survived SIGKILL (re-exported here)

Every message is meant to be read by a human in a failing CI log, so errors that come
from a child process carry the tail of that process's log file. Callers must never turn
these into skips: a missing control plane is a failure, not an absent optional feature.
"""

from __future__ import annotations

from fleetgate_tools.procs import StopError

__all__ = ["BuildError", "DevClusterError", "StartError", "StateError", "StopError"]


class DevClusterError(Exception):
    """Base class of every dev-cluster failure."""


class BuildError(DevClusterError):
    """The Kubernetes binaries could not be built or located."""


class StartError(DevClusterError):
    """A control-plane component died or did not become ready in time."""


class StateError(DevClusterError):
    """The detached-cluster state file is missing, stale or malformed."""
