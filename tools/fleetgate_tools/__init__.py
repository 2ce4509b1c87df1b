"""fleetgate_tools: the development tools of fleetgate (not shipped in the image).

* ``bench``: seeded workloads, load generator, contenders, reports (``fleetgate bench``);
* ``demo``: the one-command tour on an emulated fleet (``fleetgate demo``);
* ``devcluster``: the real Kubernetes test control plane (``fleetgate dev-cluster``);
* ``dashboards``: the Grafana dashboards as code (``fleetgate dashboards``);
* ``procs``: the one process supervisor the others use.

They depend on the runtime package ``fleetgate``, never the other way round.
"""
