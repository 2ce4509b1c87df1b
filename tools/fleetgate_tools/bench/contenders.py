"""The routers a benchmark compares, as pure data: names, command lines, configs.

A :class:`Contender` is turned into an argv by :func:`command` given the
engine URLs and the ports chosen for this run; nothing here starts a process.
Every command binds the contender to 127.0.0.1, including the peers' separate
Prometheus listeners (``--prometheus-host``; sglang-router would otherwise bind
0.0.0.0), and points it only at the emulated engines' loopback URLs.

fleetgate ablations are configuration variations of the same router
(``scheduling.weights`` and ``scheduling.picker`` in ``fleetgate/router/config.py``):

* ``fleetgate``              default weights (prefix 3, load 2, kv 1, speed 1)
* ``fleetgate-round-robin``  ``scheduling.picker: round-robin``: the router takes
  turns over the endpoints its filters keep (healthy, not ejected, serving the
  model), ignoring every score; the issue's "round robin" ablation
* ``fleetgate-random``       all weights 0: the seeded tie-break picks at random
  (kept as a contender, not in :data:`DEFAULT_SET`)
* ``fleetgate-least-loaded`` load only
* ``fleetgate-kv-only``      KV headroom only
* ``fleetgate-affinity-only`` prefix affinity only (with its load bound)
* ``fleetgate-no-preemption`` default weights, priority classes on, preemption
  off (``priority.preemption_enabled: false``); only differs on class workloads
* ``fleetgate-cold2``        ``scheduling.cold_choices: 2``: a prefix no engine holds
  goes to the less loaded of its two rendezvous candidates (power of two choices)
* ``fleetgate-lb1``          ``scheduling.load_bound: 1.0``: prefix affinity spills
  only above twice the pool's mean load (the default of a single router since
  the load bound follows ``router_replicas``)
* ``fleetgate-lb025``        ``scheduling.load_bound: 0.25``: spills above 1.25x the
  mean, the default with router replicas (and of every router before)
* ``fleetgate-admission``    the admission queue (``priority: {}``) on for every
  workload, as the Helm chart deploys the router
* ``fleetgate-no-prefill-cost`` ``scheduling.prefill_slack: null``: affinity and
  rendezvous placement bounded by load alone, as before the prefill-cost rule
* ``fleetgate-prefill-greedy`` ``prefill_slack: 0``, ``prefill_slack_tokens: 0``:
  only endpoints with the least prefill backlog + uncached prompt are eligible
* ``fleetgate-flat-bound``   ``scheduling.load_bound_tokens: null``: the same load
  bound for every prefix instead of one scaled by the prompt tokens a spill would
  prefill again
* ``fleetgate-rendezvous``   ``scheduling.cold_choices: 1``: a new prefix goes to its
  rendezvous target among the least prefill-backlogged endpoints, as the router does
  by default when ``router_replicas`` > 1 (the Helm chart's 2 replicas)
* ``fleetgate-no-speed``     default weights with the engine-speed scorer off; only
  differs on class workloads over engines of different speeds (mixed-engine)
* ``fleetgate-events``       default weights on the exact prefix view: the emulated
  engines publish KV-cache events (fleet file ``kv_events: true``; vLLM over
  ZeroMQ, TensorRT-LLM kept for ``POST /kv_cache_events``), each backend gets
  its ``kv_events`` endpoint and ``scheduling.tokenizers`` maps the model to the
  emulator's tokenizer (``{kind: emulator}``). Needs a router that takes those
  keys (issue 13 section 3); :func:`events_support_error` says when it does not.
* ``fleetgate-events-lb1``   ``fleetgate-events`` with ``scheduling.load_bound: 1.0``
  whatever ``router_replicas`` says (the replicas' shared view is the engines' events)
* ``fleetgate-events-no-prefill-cost`` ``fleetgate-events`` with ``prefill_slack: null``:
  the prefill-cost rule weighs the router's OWN backlog, which router replicas do not
  share, so two replicas may place one new prefix on two engines
* ``fleetgate-events-no-prefill-cost-lb1`` the same with ``load_bound: 1.0``
* ``fleetgate-events-sticky`` ``fleetgate-events`` with the spill rules out of reach
  (``load_bound`` 10, ``queue_work`` 1000, ``prefill_slack: null``): a prompt goes to
  its longest holder whatever the load, as vllm-router's cache_aware does below its
  imbalance thresholds
* ``fleetgate-events-no-queue-rule`` ``fleetgate-events`` with ``queue_work`` 1000: a
  holder with a full batch keeps affinity while another engine has a free slot
* ``fleetgate-events-held-first`` ``fleetgate-events`` with
  ``scheduling.held_prefix_sooner``: a request whose engine holds half its prompt or
  more goes there one priority level above its class (engines with a priority queue)
* ``fleetgate-events-held-guard`` ``fleetgate-events-held-first`` with
  ``scheduling.held_prefix_guard_s`` 1 modelled second (the chat objective): no raised
  level on an engine while a request sent there at its own level waits longer
* ``fleetgate-events-held-guard3`` the same with 3 modelled seconds (``...-guard2``: 2):
  at load 0.6 the 1 s guard left nothing of held-first's gain (most requests wait over a
  second there)
* ``fleetgate-events-held-first-sticky`` the same with the spill rules out of reach
  (as ``fleetgate-events-sticky``)
* ``fleetgate-events-flat-bound`` ``fleetgate-events`` with ``load_bound_tokens: null``
* ``fleetgate-fifo``         ``fleetgate`` whose class queue (class workloads) is
  dispatched strictly in order (``priority.affinity_wait_s: null``)
* ``fleetgate-w1``           ``fleetgate`` with ``affinity_wait_s`` 1 modelled second
* ``fleetgate-events-admission`` ``fleetgate-events`` with the admission queue on
  (``priority: {}``, as the Helm chart deploys the router): under saturation a free
  engine goes to the first queued request that prefers it (affinity dispatch,
  ``priority.affinity_wait_s``)
* ``fleetgate-events-admission-kv1`` the same with ``saturation.kv_usage_max: 1.0``
* ``fleetgate-events-admission-wm4`` the same with ``waiting_max: 4`` as well
* ``fleetgate-events-admission-w1``, ``-w4``, ``-w30`` the same with
  ``affinity_wait_s`` 1 (the default before 2026-12-05), 4 and 30 modelled seconds
* ``fleetgate-events-admission-fifo`` the same with ``affinity_wait_s: null``: each
  free engine goes to the head of the queue (the queue before affinity dispatch)
* ``fleetgate-approx``       the same as ``fleetgate`` (the approximate prefix
  view, no events), under the name the issue's comparisons use
* ``round-robin-no-classes`` the ``fleetgate demo`` baseline: what a plain load
  balancer does (a Kubernetes Service, a round-robin proxy): endpoints take
  turns and the requests' priority classes are not sent (no ``priority:``
  section, no ``x-fleetgate-priority`` header), so every engine serves its
  queue first come, first served

A contender's ``weights`` tuple (prefix, load, kv) turns exactly those scorers on:
its config also sets ``speed: 0``, so the engine-speed scorer (urgent work to the
fastest engines) is part of ``fleetgate`` (and ``fleetgate-no-preemption``, which
must differ from it in preemption only), never of a single-scorer ablation.

Peers (PyPI, flags from each CLI's ``--help``): ``vllm-router`` 0.1.17 with
``--policy cache_aware|power_of_two|round_robin`` and ``sglang-router`` 0.3.2
(``python -m sglang_router.launch_router``) with ``--policy cache_aware``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from fleetgate.engines.trtllm.kv_events import KV_EVENTS_PATH, TRTLLM_KV_EVENTS_FORMAT
from fleetgate.engines.trtllm.kv_zmq import TRTLLM_ZMQ_FORMAT
from fleetgate.engines.vllm import KV_EVENTS_TOPIC, VLLM_KV_EVENTS_FORMAT
from fleetgate.router.config import ConfigError, Health, Scrape, Timeouts, parse_config
from fleetgate.router.priority.config import DEFAULT_CLASSES, PriorityClass, PriorityConfig

ContenderKind = Literal["fleetgate", "vllm-router", "sglang-router"]

PEER_VERSIONS: dict[str, str] = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}


@dataclasses.dataclass(frozen=True, slots=True)
class Contender:
    name: str
    kind: ContenderKind
    policy: str | None = None
    """Peer ``--policy`` value."""
    weights: tuple[float, float, float] | None = None
    """fleetgate (prefix, load, kv) weights, engine-speed off; None = the router's defaults."""
    description: str = ""
    preemption: bool = True
    """fleetgate: ``priority.preemption_enabled`` when the workload has classes."""
    picker: Literal["max-score", "round-robin"] | None = None
    """fleetgate ``scheduling.picker``; None = the router's default (max-score)."""
    cold_choices: int | None = None
    """fleetgate ``scheduling.cold_choices``; None = the router's default (all
    endpoints with one router replica)."""
    load_bound: float | None = None
    """fleetgate ``scheduling.load_bound``; None = the router's default
    (``Scheduling.effective_load_bound``: 1.0 for the bench's single router)."""
    admission: bool = False
    """fleetgate: the ``priority:`` section (admission queue) even when the workload
    sends no classes (every request is ``standard``), as the Helm chart deploys it."""
    scheduling: tuple[tuple[str, Any], ...] = ()
    """Further fleetgate ``scheduling`` settings, as (key, value) pairs."""
    classes: bool = True
    """Send the workload's priority classes (``x-fleetgate-priority``; fleetgate: its
    ``priority:`` section). False: a class-blind load balancer, the header not sent."""
    kv_events: bool = False
    """fleetgate: engines publish KV-cache events and the router subscribes (exact
    prefix view with the emulator's tokenizer)."""
    priority_settings: tuple[tuple[str, Any], ...] = ()
    """Further fleetgate ``priority`` settings (with ``admission``), as (key, value) pairs."""
    held_guard_s: float | None = None
    """fleetgate ``scheduling.held_prefix_guard_s`` in modelled seconds (scaled by the
    time scale); None = not set."""
    affinity_wait_s: float | None | Literal["default"] = "default"
    """fleetgate with the admission queue: ``priority.affinity_wait_s`` in modelled
    seconds (scaled by the time scale); ``"default"``: the router's."""


#: The ``-sticky`` contenders: every spill rule out of reach (the load bound far above
#: any load, the no-queueing rule at a work no engine reaches, the prefill-cost rule off).
STICKY_LOAD_BOUND = 10.0
SPILL_RULES_OUT: tuple[tuple[str, Any], ...] = (("prefill_slack", None), ("queue_work", 1000.0))

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender(
            "fleetgate",
            "fleetgate",
            description="default weights prefix 3, load 2, kv 1, speed 1",
        ),
        Contender(
            "fleetgate-round-robin",
            "fleetgate",
            picker="round-robin",
            description="round-robin picker over the filtered endpoints, scores ignored",
        ),
        Contender(
            "fleetgate-random",
            "fleetgate",
            weights=(0.0, 0.0, 0.0),
            description="all scorers off: seeded random pick",
        ),
        Contender(
            "fleetgate-least-loaded", "fleetgate", weights=(0.0, 1.0, 0.0), description="load only"
        ),
        Contender(
            "fleetgate-kv-only",
            "fleetgate",
            weights=(0.0, 0.0, 1.0),
            description="KV headroom only",
        ),
        Contender(
            "fleetgate-affinity-only",
            "fleetgate",
            weights=(1.0, 0.0, 0.0),
            description="prefix affinity only (with its load bound)",
        ),
        Contender(
            "fleetgate-no-preemption",
            "fleetgate",
            preemption=False,
            description="default weights, priority classes on, preemption off",
        ),
        Contender(
            "fleetgate-cold2",
            "fleetgate",
            cold_choices=2,
            description="default weights, a cold prefix to the less loaded of 2 rendezvous picks",
        ),
        Contender(
            "fleetgate-lb1",
            "fleetgate",
            load_bound=1.0,
            description="default weights, affinity spills only above 2x the mean load",
        ),
        Contender(
            "fleetgate-lb025",
            "fleetgate",
            load_bound=0.25,
            description="default weights, affinity spills above 1.25x the mean load",
        ),
        Contender(
            "fleetgate-admission",
            "fleetgate",
            admission=True,
            description="default weights with the admission queue on for every workload",
        ),
        Contender(
            "fleetgate-fifo",
            "fleetgate",
            affinity_wait_s=None,
            description="default weights; with classes, the class queue dispatched strictly "
            "in order (priority.affinity_wait_s: null, the queue before affinity dispatch)",
        ),
        Contender(
            "fleetgate-w1",
            "fleetgate",
            affinity_wait_s=1.0,
            description="default weights; with classes, affinity_wait_s 1 (modelled s; the "
            "default before 2026-12-05, third session)",
        ),
        Contender(
            "fleetgate-events-admission",
            "fleetgate",
            kv_events=True,
            admission=True,
            description="exact prefix view with the admission queue on (as the Helm chart "
            "deploys it): a free engine goes to the first queued request that prefers it",
        ),
        Contender(
            "fleetgate-events-admission-kv1",
            "fleetgate",
            kv_events=True,
            admission=True,
            priority_settings=(("saturation", {"kv_usage_max": 1.0}),),
            description="fleetgate-events-admission with saturation.kv_usage_max 1.0: an "
            "engine counts as saturated by its slots and its own queue, not by a KV estimate",
        ),
        Contender(
            "fleetgate-events-admission-wm4",
            "fleetgate",
            kv_events=True,
            admission=True,
            priority_settings=(("saturation", {"kv_usage_max": 1.0, "waiting_max": 4}),),
            description="fleetgate-events-admission-kv1 with saturation.waiting_max 4: each "
            "engine keeps up to 4 requests of its own queue, so its prefill budget never idles",
        ),
        Contender(
            "fleetgate-events-admission-w1",
            "fleetgate",
            kv_events=True,
            admission=True,
            affinity_wait_s=1.0,
            description="fleetgate-events-admission with affinity_wait_s 1 (modelled s; the "
            "default before 2026-12-05, third session)",
        ),
        Contender(
            "fleetgate-events-admission-w4",
            "fleetgate",
            kv_events=True,
            admission=True,
            affinity_wait_s=4.0,
            description="fleetgate-events-admission with affinity_wait_s 4 (modelled s)",
        ),
        Contender(
            "fleetgate-events-admission-w30",
            "fleetgate",
            kv_events=True,
            admission=True,
            affinity_wait_s=30.0,
            description="fleetgate-events-admission with affinity_wait_s 30: a queued request "
            "waits for its holder unless a free engine has no taker in the window",
        ),
        Contender(
            "fleetgate-events-admission-fifo",
            "fleetgate",
            kv_events=True,
            admission=True,
            affinity_wait_s=None,
            description="exact prefix view, admission queue dispatched strictly in order "
            "(priority.affinity_wait_s: null, the queue before affinity dispatch)",
        ),
        Contender(
            "fleetgate-no-prefill-cost",
            "fleetgate",
            scheduling=(("prefill_slack", None),),
            description="default weights, the prefill-cost rule off (load bound alone)",
        ),
        Contender(
            "fleetgate-prefill-greedy",
            "fleetgate",
            scheduling=(("prefill_slack", 0.0), ("prefill_slack_tokens", 0)),
            description="default weights, prefill-cost rule without slack (cheapest only)",
        ),
        Contender(
            "fleetgate-flat-bound",
            "fleetgate",
            scheduling=(("load_bound_tokens", None),),
            description="default weights, one load bound for every prefix (not hit-weighted)",
        ),
        Contender(
            "fleetgate-rendezvous",
            "fleetgate",
            cold_choices=1,
            description="default weights, a new prefix by rendezvous (as with router replicas)",
        ),
        Contender(
            "fleetgate-no-speed",
            "fleetgate",
            weights=(3.0, 2.0, 1.0),
            description="default weights with the engine-speed scorer off",
        ),
        Contender(
            "fleetgate-events",
            "fleetgate",
            kv_events=True,
            description="default weights, exact prefix view from the engines' KV events",
        ),
        Contender(
            "fleetgate-events-lb1",
            "fleetgate",
            kv_events=True,
            load_bound=1.0,
            description="exact prefix view, affinity spills only above 2x the mean load "
            "(also with router replicas)",
        ),
        Contender(
            "fleetgate-events-no-prefill-cost",
            "fleetgate",
            kv_events=True,
            scheduling=(("prefill_slack", None),),
            description="exact prefix view, the prefill-cost rule off (load bound alone)",
        ),
        Contender(
            "fleetgate-events-no-prefill-cost-lb1",
            "fleetgate",
            kv_events=True,
            load_bound=1.0,
            scheduling=(("prefill_slack", None),),
            description="exact prefix view, the prefill-cost rule off, load bound 1.0",
        ),
        Contender(
            "fleetgate-events-flat-bound",
            "fleetgate",
            kv_events=True,
            scheduling=(("load_bound_tokens", None),),
            description="exact prefix view, one load bound for every prefix (not hit-weighted)",
        ),
        Contender(
            "fleetgate-events-sticky",
            "fleetgate",
            kv_events=True,
            load_bound=STICKY_LOAD_BOUND,
            scheduling=SPILL_RULES_OUT,
            description="exact prefix view; affinity kept whatever the load (no spill rules)",
        ),
        Contender(
            "fleetgate-events-no-queue-rule",
            "fleetgate",
            kv_events=True,
            scheduling=(("queue_work", 1000.0),),
            description="exact prefix view; the no-queueing rule out of reach",
        ),
        Contender(
            "fleetgate-events-held-first",
            "fleetgate",
            kv_events=True,
            scheduling=(("held_prefix_sooner", True),),
            description="exact prefix view; a prompt half held by its engine goes one level sooner",
        ),
        *(
            Contender(
                f"fleetgate-events-held-guard{suffix}",
                "fleetgate",
                kv_events=True,
                scheduling=(("held_prefix_sooner", True),),
                held_guard_s=guard_s,
                description="held-first, paused on an engine while a request sent there at "
                f"its own level has waited {guard_s:g} modelled s",
            )
            for suffix, guard_s in (("", 1.0), ("2", 2.0), ("3", 3.0))
        ),
        Contender(
            "fleetgate-events-held-first-sticky",
            "fleetgate",
            kv_events=True,
            load_bound=STICKY_LOAD_BOUND,
            scheduling=(*SPILL_RULES_OUT, ("held_prefix_sooner", True)),
            description="held-first with the spill rules out of reach",
        ),
        Contender(
            "fleetgate-approx",
            "fleetgate",
            description="default weights, approximate prefix view (no events)",
        ),
        Contender(
            "round-robin-no-classes",
            "fleetgate",
            picker="round-robin",
            classes=False,
            description="round robin, priority classes not sent (a plain load balancer)",
        ),
        Contender("vllm-router-cache_aware", "vllm-router", policy="cache_aware"),
        Contender("vllm-router-power_of_two", "vllm-router", policy="power_of_two"),
        Contender("vllm-router-round_robin", "vllm-router", policy="round_robin"),
        Contender("sglang-router-cache_aware", "sglang-router", policy="cache_aware"),
    )
}

#: Asked for by the issue but not expressible with the integrated router yet.
UNAVAILABLE: dict[str, str] = {}

DEFAULT_SET = (
    "fleetgate",
    "fleetgate-round-robin",
    "fleetgate-least-loaded",
    "fleetgate-kv-only",
    "fleetgate-affinity-only",
    "vllm-router-cache_aware",
    "vllm-router-power_of_two",
    "vllm-router-round_robin",
    "sglang-router-cache_aware",
)


class UnknownContender(ValueError):
    pass


def parse_contenders(text: str) -> list[Contender]:
    """``a,b,c`` -> contenders; ``all`` stands for :data:`DEFAULT_SET` (also beside
    other names: ``all,fleetgate-lb1``); names checked."""
    names: list[str] = []
    for n in (n.strip() for n in text.split(",")):
        if n == "all":
            names += DEFAULT_SET
        elif n:
            names.append(n)
    if not names:
        raise UnknownContender("--contenders: give at least one name")
    out = []
    for n in names:
        if n in UNAVAILABLE:
            raise UnknownContender(f"contender {n!r} is not available: {UNAVAILABLE[n]}")
        if n not in CONTENDERS:
            raise UnknownContender(
                f"unknown contender {n!r}; known: {', '.join(CONTENDERS)} (or 'all')"
            )
        out.append(CONTENDERS[n])
    if len(set(names)) != len(names):
        raise UnknownContender("--contenders: a name is given twice")
    return out


def fleetgate_config(
    contender: Contender,
    backends: Sequence[tuple[str, str]],
    seed: int,
    priority_classes: bool = False,
    *,
    capacities: Sequence[int | None] | None = None,
    time_scale: float = 1.0,
    kv_events: Sequence[dict[str, Any] | None] | None = None,
    router_replicas: int = 1,
) -> dict[str, Any]:
    """The router YAML (as a dict) for ``contender`` over ``(engine, url)`` backends.

    ``capacities``: each backend's concurrent-sequence limit (``--max-num-seqs`` /
    ``max_batch_size``), given to the router as ``capacity`` exactly as Kubernetes
    discovery takes it from the InferenceService spec (vLLM does not export it in
    its metrics; without it the router only learns a slot limit from the engine's
    own queue). The peers have no such setting.

    ``priority_classes``: the workload sends class names, so turn the router's
    default classes on (``priority: {}``, as the Helm chart does), with
    preemption as the contender says. ``time_scale`` (emulator wall seconds per
    modelled second): the classes' times (TTFT objective, queue time limit,
    Retry-After) are the defaults multiplied by it, so the router works to the
    same objectives, in its wall clock, that the report measures in modelled time.

    ``kv_events``: per backend, its ``kv_events`` section (:func:`kv_events_backend`;
    a ``kv_events`` contender needs one for every backend). ``router_replicas``:
    ``scheduling.router_replicas`` (2 behind the bench's round-robin front), as
    the Helm chart sets it from its replica count.
    """
    caps = list(capacities) if capacities is not None else [None] * len(backends)
    if len(caps) != len(backends):
        raise ValueError(f"{len(caps)} capacities for {len(backends)} backends")
    events = list(kv_events) if kv_events is not None else [None] * len(backends)
    if len(events) != len(backends):
        raise ValueError(f"{len(events)} kv_events for {len(backends)} backends")
    if contender.kv_events and any(e is None for e in events):
        raise ValueError(f"{contender.name}: every engine must publish KV events")
    pool_backends: list[dict[str, Any]] = []
    for (kind, url), cap, ev in zip(backends, caps, events, strict=True):
        b: dict[str, Any] = {"engine": kind, "url": url}
        if cap is not None:
            b["capacity"] = cap
        if contender.kv_events and ev is not None:
            b["kv_events"] = dict(ev)
        pool_backends.append(b)
    config: dict[str, Any] = {
        "test_mode": True,
        "pools": [{"name": "default", "backends": pool_backends}],
        "scheduling": {"seed": seed},
    }
    if time_scale != 1.0:
        config["timeouts"] = scaled_timeouts(time_scale)
        config["scrape"] = {"timeout_s": Scrape().timeout_s * time_scale}
        config["health"] = {"timeout_s": Health().timeout_s * time_scale}
    if (priority_classes and contender.classes) or contender.admission:
        priority: dict[str, Any] = {} if contender.preemption else {"preemption_enabled": False}
        if time_scale != 1.0:
            priority["classes"] = [_scaled_class(c, time_scale) for c in DEFAULT_CLASSES]
        wait = contender.affinity_wait_s
        if wait == "default":
            wait = PriorityConfig().affinity_wait_s
        priority["affinity_wait_s"] = None if wait is None else wait * time_scale
        priority.update(contender.priority_settings)
        config["priority"] = priority
    if contender.weights is not None:
        prefix, load, kv = contender.weights
        config["scheduling"]["weights"] = {"prefix": prefix, "load": load, "kv": kv, "speed": 0.0}
    if contender.load_bound is not None:
        config["scheduling"]["load_bound"] = contender.load_bound
    if contender.cold_choices is not None:
        config["scheduling"]["cold_choices"] = contender.cold_choices
    if contender.picker is not None:
        config["scheduling"]["picker"] = contender.picker
    config["scheduling"].update(contender.scheduling)
    if contender.held_guard_s is not None:
        config["scheduling"]["held_prefix_guard_s"] = contender.held_guard_s * time_scale
    if router_replicas != 1:
        config["scheduling"]["router_replicas"] = router_replicas
    if contender.kv_events:
        config["scheduling"]["tokenizers"] = {MODEL: {"kind": "emulator"}}
    return config


#: The model every bench fleet serves (``scenarios.MODEL``; repeated here to keep
#: this module free of the scenario layer).
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def kv_events_backend(kind: str, endpoint: str | None, replay: str | None) -> dict[str, Any]:
    """A backend's ``kv_events`` section for an emulated engine with events on.

    vLLM: the ZeroMQ PUB and replay sockets the emulator printed (``tcp://H:P``),
    as ``transport/format/port/replay_port/topic`` (the fields of
    ``fleetgate.engines.base.KvEventsEndpoint`` and of the operator's
    ``fleetgate.dev/kv-events`` annotation; the host is the backend's).
    TensorRT-LLM: the same when it printed sockets (line main: its streaming publisher),
    otherwise drained over HTTP at ``/kv_cache_events`` on the engine's port (1.3).
    """
    if kind == "trtllm" and endpoint is None and replay is None:
        return {
            "transport": "http-drain",
            "format": TRTLLM_KV_EVENTS_FORMAT,
            "path": KV_EVENTS_PATH,
        }
    if endpoint is None or replay is None:
        raise ValueError(f"{kind}: the engine printed no KV-event endpoints")
    return {
        "transport": "zmq",
        "format": TRTLLM_ZMQ_FORMAT if kind == "trtllm" else VLLM_KV_EVENTS_FORMAT,
        "port": _port(endpoint),
        "replay_port": _port(replay),
        "topic": KV_EVENTS_TOPIC,
    }


def _port(endpoint: str) -> int:
    tail = endpoint.rsplit(":", 1)[-1]
    if not tail.isdigit():
        raise ValueError(f"{endpoint!r}: expected tcp://HOST:PORT")
    return int(tail)


def events_support_error(config: dict[str, Any]) -> str | None:
    """Why this router build cannot run a ``kv_events`` config (None: it can).

    Validates the config with the router's own model: a router without the KV-event
    subscriber (``backends[].kv_events``) or tokenizer scoring
    (``scheduling.tokenizers``) rejects those keys as unknown."""
    try:
        parse_config(config)
    except ConfigError as e:
        return (
            "this fleetgate router does not accept the KV-event config yet "
            f"(backends[].kv_events, scheduling.tokenizers: issue 13 section 3): {e}"
        )
    return None


def scaled_timeouts(time_scale: float) -> dict[str, Any]:
    """The router's engine-side timeouts in the emulator's wall clock: the defaults
    (modelled seconds, what an engine may legitimately take) times ``time_scale``.

    A vLLM stream may pause for a second or more under KV pressure; at time scale 25
    the unscaled 15 s ``stream_idle_s`` is 0.6 modelled seconds, so the router would
    fail over streams an engine is still serving, and eject the engine after three
    (measured: shared-prefix at 16 engines, scale 25, 1889 of 1995 requests failed).
    Connect and client-side limits are network time and stay as they are. The
    ``/metrics`` and ``/health`` timeouts are scaled the same way by the caller: the
    emulator is one process for the whole fleet, and during a burst (flash-crowd:
    200 prompts of 6000 words) it answered a scrape later than the 1 s wall timeout,
    so each router replica marked every engine unhealthy and answered 503 "no
    healthy endpoint" (22 requests, docs/bench.md); the peers do not eject on a slow
    ``/metrics``. Scrape and probe intervals stay as configured.
    """
    t = Timeouts()
    return {
        "first_byte_s": t.first_byte_s * time_scale,
        "idle_s": t.idle_s * time_scale,
        "stream_idle_s": {k: v * time_scale for k, v in t.stream_idle_s.items()},
        "stream_idle_default_s": t.stream_idle_default_s * time_scale,
        "total_s": t.total_s * time_scale,
    }


def _scaled_class(cls: PriorityClass, time_scale: float) -> dict[str, Any]:
    out = cls.model_dump(exclude_defaults=True)
    out["ttft_objective_s"] = cls.ttft_objective_s * time_scale
    out["max_queue_time_s"] = cls.max_queue_time_s * time_scale
    if cls.retry_after_s:
        out["retry_after_s"] = max(1, round(cls.retry_after_s * time_scale))
    return out


def peer_dir(kind: str, root: Path) -> Path:
    return root / f"{kind}-{PEER_VERSIONS[kind]}"


def command(
    contender: Contender,
    *,
    port: int,
    metrics_port: int,
    backends: Sequence[tuple[str, str]],
    config_path: Path | None = None,
    peers_root: Path | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The argv that starts ``contender`` on 127.0.0.1:``port``."""
    urls = [u for _, u in backends]
    if contender.kind == "fleetgate":
        if config_path is None:
            raise ValueError("fleetgate needs a config file")
        return [
            python,
            "-m",
            "fleetgate",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--config",
            str(config_path),
            # INFO logs each preemption with the client's x-request-id: the harness
            # replays exactly the preempted requests to check their resumed output
            "--log-level",
            "info",
        ]
    if peers_root is None:
        raise ValueError(f"{contender.kind} needs the peers directory")
    venv = peer_dir(contender.kind, peers_root)
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        str(contender.policy),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]
    if contender.kind == "vllm-router":
        return [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
    return [
        str(venv / "bin" / "python"),
        "-m",
        "sglang_router.launch_router",
        *common,
        "--log-level",
        "warn",
    ]
