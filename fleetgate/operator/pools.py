"""Autoscaling across the services of one routing pool: pure, plain numbers.

These need every autoscaled service of a pool at once (docs/operator.md
"Mixed engines and the pool GPU budget"):

* **The split of demand by role.** When autoscaled services serving the same model
  in one pool have different ``routing.role`` values, the ``latency``-role ones
  take the demand (queue, arrivals, held requests) of the latency classes and the
  ``throughput``-role ones that of the batch classes (:class:`ClassRoles`,
  :func:`demand_roles`). A model with one role in its pool takes all of it.
* **One role serving both** (:func:`consolidate`). A role whose services all have
  ``minReplicas: 0`` and whose own demand wants at most one replica stands at zero
  while the pool's other role has room for the model's whole load: its classes are
  served by the other role's replicas (the router sends any class to any engine of
  the model), so quiet hours run one replica, not one per role. It comes back when
  the load would fill the other role's replicas past :data:`KEEP_FILL`, or when the
  other role's decision grows it (its replicas then count toward that growth).
* **The latency role's room** (:func:`spare_room`). The latency role is sized on
  its classes' demand alone, but the router sends any class to any engine of the
  model, so its replicas also run batch-class requests while they have room. What
  room they keep beyond their own classes' load is subtracted from the throughput
  role's need: the model's peak runs the replicas its whole load needs, not those of
  each role's share rounded up separately (a peak of 1.3 + 5.9 in flight at a target
  of 4.5 per replica is 2 replicas, not 1 + 2).
* **Services of one role share its demand** (:func:`demand_shares`). Two autoscaled
  services that take the same demand (same pool, model and role, e.g. one vLLM
  service per GPU type) each get a part of its queue, held requests and arrivals in
  proportion to their replicas, not all of it each (which would size both for the
  whole); their in-flight requests are their own pods' anyway.
* **The GPU budget of a pool.** ``replicas x gpu.count`` summed over the pool's
  autoscaled services stays within the budget (:func:`share_budget`): the latency
  role is served first up to what it wants, then the throughput role, one replica
  at a time in turn within a role; nobody goes below ``minReplicas``.

The operator may not import the router, so the router's default priority classes
(``fleetgate/router/priority/config.py``: critical 8, standard 0, batch -5,
sheddable -10) are named here; a test checks they still match.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

__all__ = [
    "DEFAULT_CLASS_ROLES",
    "LATENCY",
    "ROLES",
    "THROUGHPUT",
    "ABSORB_FILL",
    "KEEP_FILL",
    "LOAD_WINDOW_SECONDS",
    "ClassRoles",
    "Grant",
    "Member",
    "Sharer",
    "PoolOptionError",
    "demand_roles",
    "demand_shares",
    "Share",
    "consolidate",
    "parse_class_roles",
    "parse_pool_budgets",
    "share_budget",
    "spare_room",
]

Role = Literal["latency", "throughput"]
LATENCY: Role = "latency"
THROUGHPUT: Role = "throughput"
ROLES: tuple[Role, ...] = (LATENCY, THROUGHPUT)

#: The router's default classes (fleetgate/router/priority/config.py) and the role
#: whose services serve them: interactive classes to the latency role, batch and
#: sheddable work to the throughput role.
DEFAULT_CLASS_ROLES: Mapping[str, Role] = {
    "critical": LATENCY,
    "standard": LATENCY,
    "batch": THROUGHPUT,
    "sheddable": THROUGHPUT,
}
#: A class named in no mapping goes to the latency role: the router's default class
#: (``standard``) is interactive, and a custom class is more often a premium tier
#: than a batch one; starving an interactive class is the costlier mistake.
DEFAULT_UNMAPPED_ROLE: Role = LATENCY

_CLASS = re.compile(r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")  # the router's class names
_POOL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # spec.routing.pool


class PoolOptionError(ValueError):
    """A ``--class-role`` or ``--pool-gpu-budget`` value that cannot be used."""


@dataclasses.dataclass(frozen=True, slots=True)
class ClassRoles:
    """Which role's services serve each priority class's demand."""

    roles: Mapping[str, Role] = dataclasses.field(default_factory=lambda: dict(DEFAULT_CLASS_ROLES))
    unmapped: Role = DEFAULT_UNMAPPED_ROLE
    """The role of a class not in ``roles``."""

    def role_of(self, cls: str) -> Role:
        return self.roles.get(cls, self.unmapped)

    def accepts(self, role: Role) -> Callable[[str], bool]:
        """The predicate "this class's demand goes to ``role``"."""
        return lambda cls: self.role_of(cls) == role

    def describe(self, role: Role) -> str:
        """The classes of ``role`` for a person (``critical, standard + unlisted``)."""
        named = sorted(c for c, r in self.roles.items() if r == role)
        if self.unmapped == role:
            named.append("any other class")
        return ", ".join(named) or "no class"


def parse_class_roles(items: Iterable[str]) -> ClassRoles:
    """``CLASS=ROLE`` items (each may be comma-separated) over the defaults;
    ``*=ROLE`` sets the role of unlisted classes. PoolOptionError on bad input."""
    roles: dict[str, Role] = dict(DEFAULT_CLASS_ROLES)
    unmapped = DEFAULT_UNMAPPED_ROLE
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            cls, eq, role = (x.strip() for x in part.partition("="))
            if not eq or role not in ROLES:
                raise PoolOptionError(
                    f"--class-role {part!r}: want CLASS=latency or CLASS=throughput"
                )
            if cls == "*":
                unmapped = LATENCY if role == LATENCY else THROUGHPUT
            elif _CLASS.match(cls):
                roles[cls] = LATENCY if role == LATENCY else THROUGHPUT
            else:
                raise PoolOptionError(
                    f"--class-role {part!r}: {cls!r} is not a priority class name "
                    "(lowercase letters, digits, '-', '_', '.'; or '*' for unlisted classes)"
                )
    return ClassRoles(roles, unmapped)


def parse_pool_budgets(items: Iterable[str]) -> dict[str, int]:
    """``POOL=N`` items (each may be comma-separated) -> pool -> GPUs.
    PoolOptionError on bad input or a pool given twice."""
    out: dict[str, int] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            pool, eq, count = (x.strip() for x in part.partition("="))
            if not eq or not _POOL.match(pool) or len(pool) > 63:
                raise PoolOptionError(
                    f"--pool-gpu-budget {part!r}: want POOL=N with POOL a routing.pool name"
                )
            try:
                n = int(count)
            except ValueError:
                n = -1
            if n < 0:
                raise PoolOptionError(
                    f"--pool-gpu-budget {part!r}: N must be a whole number of GPUs >= 0"
                )
            if pool in out:
                raise PoolOptionError(f"--pool-gpu-budget: pool {pool!r} given twice")
            out[pool] = n
    return out


Key = tuple[str, str]
"""(namespace, name) of an InferenceService."""


def demand_roles(services: Iterable[tuple[Key, str, str, Role]]) -> dict[Key, Role | None]:
    """``(key, pool, model, role)`` of every autoscaled service -> the role whose
    classes' demand the service takes, or None for all of it (its model has one role
    among the pool's autoscaled services)."""
    listed = list(services)
    roles: dict[tuple[str, str], set[Role]] = {}
    for _, pool, model, role in listed:
        roles.setdefault((pool, model), set()).add(role)
    return {
        key: role if len(roles[(pool, model)]) > 1 else None for key, pool, model, role in listed
    }


@dataclasses.dataclass(frozen=True, slots=True)
class Share:
    """A service's part of the demand it takes with other services."""

    weight: float
    """The fraction of the queue, held requests and arrivals it sizes for."""
    objective: bool
    """Whether its decision reads the TTFT objective's attainment (one service per
    demand, so a missed objective adds one replica, not one per service)."""
    of: int
    """How many services take that demand."""


def demand_shares(
    services: Iterable[tuple[Key, tuple[str, str, Role | None], int, int]],
) -> dict[Key, Share]:
    """``(key, (pool, model, role), spec.replicas, maxReplicas)`` of every autoscaled
    service -> the share of each one that takes a demand (:func:`demand_roles`) with
    others; a service alone on its demand is left out (it takes all of it).

    The router spreads a model's requests over every endpoint of it, so a service's
    part is its replicas over the group's (starting ones included: they serve within
    a cold start, as for any scale-up). With no replica in the group, the first
    service (by namespace and name) that may run one takes it all, so one wakes, not
    every one. A service at zero gets no part while another with replicas can still
    grow; once every service with replicas is at its ``maxReplicas``, the first one at
    zero gets one replica's part, so the demand beyond them reaches a service that
    can run it. The service with the largest part (first by name on a tie) reads the
    TTFT objective.
    """
    groups: dict[tuple[str, str, Role | None], list[tuple[Key, int, int]]] = {}
    for key, group, current, most in services:
        groups.setdefault(group, []).append((key, current, most))
    out: dict[Key, Share] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        members.sort()
        weights = {key: float(current) for key, current, _ in members}
        running = [(c, most) for _, c, most in members if c > 0]
        idle = [key for key, c, most in members if c == 0 and most > 0]
        if idle and all(c >= most for c, most in running):
            weights[idle[0]] = 1.0  # no replica anywhere, or the running ones are full
        total = sum(weights.values())
        lead = max(members, key=lambda m: weights[m[0]])  # the first of equals
        for key, _, _ in members:
            out[key] = Share(
                weight=weights[key] / total if total > 0 else 0.0,
                objective=key == lead[0],
                of=len(members),
            )
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """One autoscaled service of a pool, as the budget sees it."""

    key: Key
    role: Role
    gpus: int
    """GPUs per replica (``spec.gpu.count``; 0 costs nothing)."""
    min_replicas: int
    current: int
    """``spec.replicas`` now."""
    wanted: int
    """What its own decision asks for (already within ``[min, max]``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    replicas: int
    """Replicas to run now: ``target``, unless growing needs GPUs that other services
    of the pool still hold (they drain first; the growth follows on a later tick)."""
    target: int
    """What the budget grants once those GPUs are free."""
    note: str | None
    """Why the budget limited this service; None when it did not."""


def _round_robin(
    group: Sequence[Member], start: Mapping[Key, int], upto: Callable[[Member], int], left: int
) -> tuple[dict[Key, int], int]:
    """One replica at a time to each member in turn while it wants more and fits."""
    got = dict(start)
    progress = True
    while progress:
        progress = False
        for m in group:
            if got[m.key] < upto(m) and m.gpus <= left:
                got[m.key] += 1
                left -= m.gpus
                progress = True
    return got, left


def share_budget(pool: str, budget: int, members: Sequence[Member]) -> dict[Key, Grant]:
    """Share ``budget`` GPUs over the autoscaled services of ``pool``.

    Targets: every service keeps ``minReplicas`` (even past the budget); the GPUs
    left go to the latency role first, one replica at a time to each service in turn
    (ordered by namespace/name) until each has what it wants or no replica fits, then
    to the throughput role the same way. A service without GPUs is never limited.

    Now: a service whose target is below its replicas shrinks (the loop drains the
    replicas to remove, then removes them together); one whose target is above grows
    only into the GPUs free now (``budget - sum(replicas x gpus)``), latency first, so
    the sum of ``spec.replicas x gpus`` never exceeds the budget on account of a
    scale-up.
    """
    ordered = sorted(members, key=lambda m: (ROLES.index(m.role), m.key))
    free_gpu = [m for m in ordered if m.gpus <= 0]
    costly = [m for m in ordered if m.gpus > 0]
    target: dict[Key, int] = {m.key: m.wanted for m in free_gpu}
    floor = {m.key: m.min_replicas for m in costly}
    left = budget - sum(m.min_replicas * m.gpus for m in costly)
    for role in ROLES:
        group = [m for m in costly if m.role == role]
        got, left = _round_robin(group, floor, lambda m: m.wanted, max(left, 0))
        target.update({m.key: got[m.key] for m in group})
    free_now = budget - sum(m.current * m.gpus for m in costly)
    out: dict[Key, Grant] = {}
    for m in ordered:
        t = target[m.key]
        replicas = t
        if m.gpus > 0 and t > m.current:
            room = max(0, free_now) // m.gpus
            replicas = max(m.min_replicas, min(t, m.current + room))
            free_now -= max(0, replicas - m.current) * m.gpus
        notes = []
        if t < m.wanted:
            notes.append(f"{m.wanted} wanted, {t} granted")
        if replicas < t:
            notes.append(f"{t - replicas} more once GPUs drain elsewhere in the pool")
        note = f"pool {pool} gpu budget {budget} reached ({'; '.join(notes)})" if notes else None
        out[m.key] = Grant(replicas=replicas, target=t, note=note)
    return out


#: A role with replicas gives them up (they drain) when the model's whole load would
#: fill at most this share of the other role's replicas' target load: the margin is
#: for the arrivals' trend, which the load of now does not show.
ABSORB_FILL = 0.5
#: A role at zero stays there while the load fills at most this share; between the
#: two thresholds nothing changes, so a load near one of them does not flap.
KEEP_FILL = 0.75
#: The load compared is its mean over this many seconds of decisions: the load of
#: one instant follows Poisson clumps and bursts (a quiet pool at 3 req/s read 1 to 4
#: in flight from one second to the next, and a latency role came and went 3 times
#: in 40 s on it).
LOAD_WINDOW_SECONDS = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class Sharer:
    """One autoscaled service of a model that both roles of a pool serve."""

    key: Key
    role: Role
    min_replicas: int
    current: int
    """``spec.replicas`` now (starting replicas included: they serve within a cold
    start, as any scale-up does)."""
    ready: int
    """Ready replicas the routers find serving (their ``/health``)."""
    wanted: int
    """What its own decision asks for, on its role's classes' demand."""
    load: float
    """Requests in flight on its pods plus its classes' queued and held ones."""
    arrivals: float | None
    """Its classes' arrival rate (requests/s; None on the first scrape, when it is not
    known yet)."""
    target: float | None
    """``targetInFlightPerReplica`` (None: it scales on another signal)."""


def consolidate(group: Sequence[Sharer], total: float | None = None) -> dict[Key, str]:
    """The services of one (pool, model) group that stand at zero because the other
    role's replicas serve their classes: key -> why (for a person).

    A role qualifies when every one of its services has ``minReplicas: 0``, its own
    demand wants at most one replica in all, and the other role has a replica that
    serves (Ready, and a router's last health probe found it serving), wants one, and
    wants no more than it has (a role growing for the model's load is the end of low
    demand: the one at zero comes back rather than the other adding replicas). A role
    with replicas starts to drain only while they all serve (none is still starting)
    and the other role keeps one replica.
    Then the model's whole load (every service's) is compared with the other role's
    target load (the replicas it keeps, ``min(spec.replicas, wanted)``, x
    ``targetInFlightPerReplica``), and the role stands at zero while that fill is at
    most :data:`ABSORB_FILL` (it has replicas: they drain) or :data:`KEEP_FILL` (it
    is at zero already). When both roles qualify, the one with fewer arrivals of its
    own stands down (a tie: the throughput role, so the faster engine keeps
    serving). While an arrival rate is unknown (the first scrape, after a restart) a
    role already at zero may stay there but none starts to drain. Only groups whose
    every service scales on in-flight requests take part: a KV target has no load to
    add. ``total``: the model's load to compare (the caller's mean over
    :data:`LOAD_WINDOW_SECONDS`); None: the sum of the services' loads now.
    """
    by_role = {role: [m for m in group if m.role == role] for role in ROLES}
    if not all(by_role.values()) or any(m.target is None for m in group):
        return {}
    if total is None:
        total = sum(m.load for m in group)
    known = all(m.arrivals is not None for m in group)
    options: list[tuple[float, int, Role, float, list[Sharer]]] = []
    for role in ROLES:
        mine = by_role[role]
        other = by_role[THROUGHPUT if role == LATENCY else LATENCY]
        if any(m.min_replicas > 0 for m in mine) or sum(m.wanted for m in mine) > 1:
            continue
        if not any(o.ready for o in other) or sum(o.wanted for o in other) < 1:
            continue
        if sum(o.wanted for o in other) > sum(o.current for o in other):
            # the other role grows: demand is no longer low, and this role's replicas
            # come back to take their classes instead of the other's growing for them
            # (the caller cuts that growth by what comes back)
            continue
        # the replicas the other role keeps: its own decision may be shrinking it this
        # very tick, and both going at once left a peak short by two replicas
        capacity = sum(min(o.current, o.wanted) * (o.target or 0.0) for o in other)
        if capacity <= 0:
            continue
        fill = total / capacity
        at_zero = sum(m.current for m in mine) == 0
        if not at_zero and (
            sum(m.ready for m in mine) < sum(m.current for m in mine)
            or sum(min(o.current, o.wanted) for o in other) > 1
        ):
            # A role starts to drain only onto one replica of the other (quiet hours,
            # not a peak both roles' replicas serve: at 49% of 3 vLLM replicas a peak's
            # TensorRT-LLM replica drained and came back 3 s later), and only once its
            # own replicas all serve (one that came back within a cold start was asked
            # for: draining it as the other role stops growing flapped 0 -> 1 -> 0 -> 1
            # in 4 s)
            continue
        if fill <= (KEEP_FILL if at_zero else ABSORB_FILL) and (known or at_zero):
            arrivals = sum(m.arrivals or 0.0 for m in mine)
            # fewer arrivals first; on a tie the throughput role (index 1) stands down
            options.append((arrivals, -ROLES.index(role), role, fill, other))
    if not options:
        return {}
    _, _, role, fill, other = min(options, key=lambda o: (o[0], o[1]))
    served_by = ", ".join(f"{ns}/{name}" for ns, name in sorted(o.key for o in other))
    why = (
        f"the pool's {THROUGHPUT if role == LATENCY else LATENCY}-role replicas serve "
        f"its classes ({served_by}: the model's load {total:.3g} fills {fill:.0%} "
        f"of their target)"
    )
    return {m.key: why for m in by_role[role]}


def spare_room(latency: Iterable[tuple[int, int, float | None, float | None]]) -> float:
    """The requests in flight the latency-role services of a (pool, model) group can
    run beyond their own classes' need: ``(current, desired, target, need)`` of each
    (``spec.replicas``, its decision, ``targetInFlightPerReplica``, what that
    decision sized for) -> the sum of ``min(current, desired) x target - need`` over
    them, none below 0. The replicas counted are those it keeps: starting ones
    included (they serve within a cold start, as the other role's would), not the
    ones its decision removes. A service without an in-flight target or a need adds
    nothing."""
    room = 0.0
    for current, desired, target, need in latency:
        if target is None or need is None:
            continue
        room += max(0.0, min(current, desired) * target - need)
    return room
