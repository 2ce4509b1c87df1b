"""The pure core of the router's priority handling.

* :mod:`.config`: priority classes, request -> class/tenant resolution.
* :mod:`.queue`: the admission queue (class order, WFQ among tenants, limits).
* :mod:`.saturation`: when a pool counts as full (stale metrics = unknown).
* :mod:`.preemption`: which in-flight request to preempt, and why.
* :mod:`.policy`: one event-driven drain step (shed, dispatch, preempt).
* :mod:`.continuation`: the request body that resumes a preempted/died request.
* :mod:`.splice`: one seamless client stream/body out of all its segments.

Nothing here does I/O, reads a clock or imports an HTTP library; the router
(``fleetgate/router``) owns the sockets, timers and tasks and calls in.
"""
