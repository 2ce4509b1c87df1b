"""The pure core of the router's priority handling.

* :mod:`.config`: priority classes, request -> class/tenant resolution.
* :mod:`.queue`: the admission queue (class order, pools, limits, expiry).
* :mod:`.class_queue`: one class's queue in a pool (parked first, WFQ among tenants).
* :mod:`.saturation`: when a pool counts as full (stale metrics = unknown).
* :mod:`.preemption`: which in-flight request to preempt, and why.
* :mod:`.policy`: one event-driven drain step (shed, dispatch, preempt).
* :mod:`.continuation`: the request body that resumes a preempted/died request.
* :mod:`.splice`: one seamless client stream out of all of an answer's segments.
* :mod:`.fastpath`: plain token events read from their bytes (the engines' shapes).
* :mod:`.client_events`: an engine event read, and rendered for the client (JSON path).
* :mod:`.assemble`: what is rendered from an answer's totals (the stream's tail
  with its usage event, non-streaming body).
* :mod:`.wire`: the router's own JSON and SSE bytes, rendered as vLLM renders them.

Nothing here does I/O, reads a clock or imports an HTTP library; the router
(``fleetgate/router``) owns the sockets, timers and tasks and calls in.

How the router wires it (one ``AdmissionQueue`` per router process, built in
the app lifespan from the YAML ``priority:`` section):

1. Request in: ``cls = resolve_class(cfg, headers, body)`` and
   ``tenant = resolve_tenant(headers)`` (a ``PriorityError`` becomes
   ``err.status`` + ``err.openai_body()``). If ``resumability(body, kind)`` is
   None the request is *resumable*: its upstream body is
   ``upstream_body(body, return_token_ids=<engine returns ids>)`` and its bytes
   go through a ``StreamSplicer(kind, include_usage=<client's>,
   return_token_ids=<client's>)``, told each attempt's engine with
   ``splicer.use_token_events(adapter.token_events)``; a non-streaming client gets
   ``encode_json(splicer.assemble_response())``. Others are proxied untouched
   and reported as ``InFlight(resumable=False)``.
2. ``queue.offer(rid, cls, tenant, now, ctx, pool=<model>)``; a ``Shed`` is
   answered at once (``status``, ``headers()``, ``openai_body()``).
3. ``drain(queue, now, config=cfg, views_for=..., pick=..., in_flight=...,
   preempting_for=...)`` on every event: arrival, request end,
   scrape, endpoint change, and the one timer armed at ``queue.next_expiry()``.
   ``views_for`` builds ``EndpointView`` s from the latest ``LoadSnapshot`` s
   (``scrape_age_s = now - scraped_at``) plus the router's in-flight counts,
   now and at scrape time (``in_flight_at_scrape``);
   ``pick`` is the scheduling pipeline restricted to the available endpoints.
4. Actions: ``Shed`` -> answer (a parked request whose stream already started
   ends with an error event instead); ``Dispatch`` -> send
   ``engine_priority_body(body, adapter.priority_fields(cls.level))``, or for a
   parked item ``plan = build_continuation(...)``,
   ``splicer.begin_continuation(plan.mode, seam_prefix=plan.seam_prefix)`` and
   send ``plan.body`` to ``plan.path``; ``Preempt`` -> add ``for_item`` to
   ``preempting_for``, close the victim's upstream stream (vLLM aborts it and
   frees its KV), ``queue.park(victim, ..., arrival=<original>)``.
5. Engine died mid-answer (connection error or an ``upstream_error`` event, and
   ``not splicer.finished``): park it like a preempted request, at most
   ``cfg.max_resumes_per_request`` times. When the
   upstream ends with ``splicer.finished``: write ``splicer.finish()``.
"""
