"""Fleet benchmarks: seeded workloads, a bounded async load generator, contenders
(fleetgate, its ablations, peer routers) and a Markdown/PNG report."""
