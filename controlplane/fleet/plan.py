"""The fleet's decisions as values: what one reconcile pass changes, planned from what was observed.

A reconcile pass (``controlplane.fleet.reconcile``) observes (processes alive? /ready? ports taken?),
calls :func:`plan_pass` here, and applies the plan once. Planning is pure: no I/O, no asyncio and no
clock; the observation carries the time. Each action is a frozen value that says why it was taken, so
tests assert on plans and need neither processes nor sleeps.

Within a pass the steps see each other's effects, in this order: exits, readiness, restarts due, the
rolling update, the canary's replicas, counts per zone, finished drains. A replica restarted by the third
step, for example, counts as the newest one when the sixth step picks which replica to drain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from controlplane.fleet.config import FleetConfig
from controlplane.replicas import ReplicaState

UNREADY_AFTER_FAILURES = 3  # consecutive failed readiness probes before a ready replica counts as unready
DRAIN_GRACE_S = 5.0  # past its own drain timeout, a draining replica is killed
_GONE = (ReplicaState.DRAINING, ReplicaState.STOPPED)  # no longer counted towards the desired replicas

A = TypeVar("A")


# ---- what the plan reads ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ObservedReplica:
    """One replica as the fleet knows it at the start of a pass, with what was observed of it."""

    replica_id: str
    zone: str
    port: int
    model: str
    generation: int
    state: ReplicaState
    started_at: float
    is_running: bool  # the backend reports its process alive
    exit_status: int | None = None
    is_ready: bool | None = None  # this pass's /ready probe; None: not probed this pass
    port_free: bool = True  # a server could listen on its port now (looked at for stopped processes)
    restarts: int = 0
    crash_times: tuple[float, ...] = ()  # recent crashes, for the backoff and the crash-loop report
    restart_at: float | None = None  # when a crashed replica is due to be restarted
    ready_failures: int = 0  # consecutive failed /ready probes
    drain_started: float | None = None
    version: str = ""  # a canary's version; "" for the stable fleet


@dataclass(frozen=True, slots=True)
class Canary:
    """Replicas of a candidate version beside the stable fleet (a canary release): not counted in the
    fleet's replicas nor replaced by a rolling update, labelled with their version so that the gateways
    send them the canary's share of traffic."""

    version: str
    model: str
    replicas: int = 1

    def __post_init__(self) -> None:
        if not self.version:
            raise ValueError("version: a canary needs a version name")
        if self.replicas < 1:
            raise ValueError(f"replicas: a canary needs at least 1, got {self.replicas}")


@dataclass(frozen=True, slots=True)
class Rollout:
    """A rolling update in progress: one new replica (the surge) at a time replaces an old one."""

    model: str
    generation: int
    previous_model: str
    previous_generation: int
    started_at: float
    surge: str | None = None  # the new replica being waited on
    surge_started: float | None = None
    surge_ready_at: float | None = None  # when it became ready: it is watched for errors from then on


@dataclass(frozen=True, slots=True)
class Desired:
    """What the operator asked for: how many replicas, which model, and a rolling update if one runs."""

    replicas: int
    model: str
    generation: int
    rollout: Rollout | None = None
    canary: Canary | None = None

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas: must be >= 0, got {self.replicas}")


@dataclass(frozen=True, slots=True)
class Observation:
    now: float  # the fleet's clock (monotonic seconds), read after the probes
    replicas: tuple[ObservedReplica, ...]
    reserved_ports: frozenset[int] = frozenset()  # the control plane's own listeners
    error_rates: Mapping[str, float | None] = field(default_factory=lambda: MappingProxyType({}))
    """A replica's recent 5xx share, read while a rollout's new replica is watched (None: unknown)."""
    zones_down: frozenset[str] = frozenset()
    """Zones of the fleet with no live node (a backend that places replicas reports them)."""


# ---- what the plan says ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MarkCrashed:
    replica_id: str
    exit_status: int | None
    crash_times: tuple[float, ...]
    restart_at: float
    restart_in_s: float
    reason: str = "process exited"


@dataclass(frozen=True, slots=True)
class ReportCrashLoop:
    replica_id: str
    crashes: int
    window_s: float
    reason: str = "crashed too often"


@dataclass(frozen=True, slots=True)
class RecordProbe:
    """Keep the count of consecutive failed /ready probes (0: the last one passed)."""

    replica_id: str
    failures: int


@dataclass(frozen=True, slots=True)
class MarkReady:
    replica_id: str
    seconds_to_ready: float
    reason: str = "/ready passed"


@dataclass(frozen=True, slots=True)
class MarkUnready:
    replica_id: str
    failures: int
    reason: str = "/ready failed"


@dataclass(frozen=True, slots=True)
class Restart:
    """Start a crashed replica again under its id; on another port when its own is taken now."""

    replica_id: str
    restarts: int
    move_port: bool = False
    reason: str = "restart backoff elapsed"


@dataclass(frozen=True, slots=True)
class Spawn:
    """Start a new replica (the port is picked when it is applied: the first free one)."""

    replica_id: str
    zone: str
    model: str
    generation: int
    reason: str
    version: str = ""  # a canary's replica


@dataclass(frozen=True, slots=True)
class Drain:
    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Kill:
    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Remove:
    """Forget a replica whose process is gone and delete it from the store."""

    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class StepRollout:
    surge: str
    replacing: str
    reason: str = "next replica of the rollout"


@dataclass(frozen=True, slots=True)
class CompleteRollout:
    model: str
    generation: int
    reason: str = "no replica of an older generation left"


@dataclass(frozen=True, slots=True)
class RollBack:
    model: str
    reason: str


Action = (MarkCrashed | ReportCrashLoop | RecordProbe | MarkReady | MarkUnready | Restart | Spawn | Drain
          | Kill | Remove | StepRollout | CompleteRollout | RollBack)


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...]
    desired: Desired  # the desired state after the pass (a rollout stepped, completed or rolled back)

    def of(self, kind: type[A]) -> list[A]:
        """The actions of one kind, in order."""
        return [a for a in self.actions if isinstance(a, kind)]


# ---- planning --------------------------------------------------------------------------------------
def zone_targets(total: int, zones: list[str]) -> dict[str, int]:
    """Spread ``total`` replicas over zones, the first zones taking the remainder."""
    base, extra = divmod(total, len(zones))
    return {zone: base + (1 if i < extra else 0) for i, zone in enumerate(zones)}


def placement_zones(zones: list[str], down: frozenset[str], policy: str) -> list[str]:
    """The zones replicas are spread over: all of them, or with ``spill`` those that have a live node (all
    of them again when none has: there is nowhere to spill to)."""
    if policy != "spill":
        return list(zones)
    up = [zone for zone in zones if zone not in down]
    return up or list(zones)


def plan_pass(observed: Observation, desired: Desired, config: FleetConfig) -> Plan:
    """Everything one reconcile pass changes, in the order it is to be applied."""
    planner = _Planner(observed, desired, config)
    planner.observe_exits()
    planner.observe_readiness()
    planner.restart_due()
    planner.step_rollout()
    planner.converge_canary()
    planner.converge_counts()
    planner.finish_drains()
    return Plan(tuple(planner.actions), planner.desired)


class _Planner:
    """One pass's working copy: each step reads the replicas as the previous steps left them."""

    def __init__(self, observed: Observation, desired: Desired, config: FleetConfig) -> None:
        self.now = observed.now
        self.observed = observed
        self.config = config
        self.desired = desired
        self.replicas = {r.replica_id: r for r in observed.replicas}
        self.actions: list[Action] = []

    def observe_exits(self) -> None:
        window = self.config.crash_loop_window_s
        for r in list(self.replicas.values()):
            if r.state in (ReplicaState.CRASHED, *_GONE) or r.is_running:
                continue
            crashes = (*(t for t in r.crash_times if self.now - t < window), self.now)
            delay = min(self.config.restart_backoff_s * 2 ** (len(crashes) - 1),
                        self.config.restart_backoff_max_s)
            restart_at = self.now + delay
            self._act(MarkCrashed(r.replica_id, r.exit_status, crashes, restart_at, delay),
                      replace(r, state=ReplicaState.CRASHED, crash_times=crashes, restart_at=restart_at))
            if len(crashes) >= self.config.crash_loop_restarts:
                self.actions.append(ReportCrashLoop(r.replica_id, len(crashes), window))

    def observe_readiness(self) -> None:
        for r in list(self.replicas.values()):
            if r.is_ready is None or r.state is ReplicaState.CRASHED:
                continue
            failures = 0 if r.is_ready else r.ready_failures + 1
            if failures != r.ready_failures:
                self._act(RecordProbe(r.replica_id, failures), replace(r, ready_failures=failures))
                r = self.replicas[r.replica_id]
            if r.is_ready and r.state is not ReplicaState.READY:
                waited = round(self.now - r.started_at, 3)
                self._act(MarkReady(r.replica_id, waited), replace(r, state=ReplicaState.READY))
            elif r.state is ReplicaState.READY and failures >= UNREADY_AFTER_FAILURES:
                self._act(MarkUnready(r.replica_id, failures), replace(r, state=ReplicaState.UNREADY))

    def restart_due(self) -> None:
        spilling = self.config.on_node_loss == "spill"
        for r in list(self.replicas.values()):
            if r.state is not ReplicaState.CRASHED or r.restart_at is None or self.now < r.restart_at:
                continue
            if spilling and r.zone in self.observed.zones_down:
                continue  # re-placed in another zone by converge_counts, not restarted where no node is
            taken = r.port in self.observed.reserved_ports or not r.port_free
            self._act(Restart(r.replica_id, r.restarts + 1, move_port=taken),
                      replace(r, state=ReplicaState.STARTING, started_at=self.now, is_running=True,
                              restarts=r.restarts + 1, restart_at=None, ready_failures=0,
                              drain_started=None))

    def step_rollout(self) -> None:
        ro = self.desired.rollout
        if ro is None:
            return
        if ro.surge is not None:
            self._watch_surge(ro)
            return
        old = [r for r in self._stable() if r.generation != ro.generation and r.state not in _GONE]
        if not old:
            self.desired = replace(self.desired, model=ro.model, generation=ro.generation, rollout=None)
            self.actions.append(CompleteRollout(ro.model, ro.generation))
            return
        surge = self._spawn(old[0].zone, ro.model, ro.generation, f"rollout: replaces {old[0].replica_id}")
        self.desired = replace(self.desired, rollout=replace(ro, surge=surge, surge_started=self.now))
        self.actions.append(StepRollout(surge, old[0].replica_id))

    def converge_canary(self) -> None:
        """The canary's replicas: as many as it asks for, spread over the zones; a replica of a version
        that is no longer the canary's (it ended, or another began) drains."""
        canary = self.desired.canary
        mine = [r for r in self.replicas.values() if r.version and r.state not in _GONE]
        for r in mine:
            if canary is None or r.version != canary.version:
                self._drain(r, "canary ended")
        if canary is None:
            return
        live = [r for r in mine if r.version == canary.version]
        zones = placement_zones(self.config.zones, self.observed.zones_down, self.config.on_node_loss)
        for i in range(len(live), canary.replicas):
            self._spawn(zones[i % len(zones)], canary.model, self.desired.generation,
                        f"canary {canary.version}", version=canary.version)
        for r in _drain_candidates(live)[:max(len(live) - canary.replicas, 0)]:
            self._drain(r, "canary scaled down")

    def converge_counts(self) -> None:
        if self.desired.rollout is not None:
            return  # the rollout owns the counts until it ends
        zones = placement_zones(self.config.zones, self.observed.zones_down, self.config.on_node_loss)
        targets = zone_targets(self.desired.replicas, zones)
        for zone, want in targets.items():
            live = [r for r in self._stable() if r.zone == zone and r.state not in _GONE]
            spilled = zone not in self.observed.zones_down and len(zones) < len(self.config.zones)
            for _ in range(want - len(live)):
                self._spawn(zone, self.desired.model, self.desired.generation,
                            "spilled from a zone without nodes" if spilled else "scale up")
            for r in _drain_candidates(live)[:max(len(live) - want, 0)]:
                self._drain(r, "scale down")
        for r in self._stable():
            if r.zone not in targets and r.state not in _GONE:
                self._drain(r, "zone has no node" if r.zone in self.observed.zones_down else "zone removed")

    def finish_drains(self) -> None:
        for r in list(self.replicas.values()):
            if r.state is not ReplicaState.DRAINING:
                continue
            overdue = r.drain_started is not None and \
                self.now - r.drain_started > self.config.drain_timeout_s + DRAIN_GRACE_S
            if overdue and r.is_running:
                self.actions.append(Kill(r.replica_id, "drain timed out"))
                self._remove(r, "killed after its drain timed out")
            elif not r.is_running:
                self._remove(r, "exited after draining")

    # ---- rolling update --------------------------------------------------------------------------
    def _watch_surge(self, ro: Rollout) -> None:
        surge = self.replicas.get(ro.surge or "")
        if surge is not None and surge.state is ReplicaState.READY:
            ready_at = self.now if ro.surge_ready_at is None else ro.surge_ready_at
            ro = replace(ro, surge_ready_at=ready_at)
            self.desired = replace(self.desired, rollout=ro)
            worse = self._errs_more_than_old(ro, surge)
            if worse is not None:
                self._roll_back(ro, worse)
            elif self.now - ready_at >= self.config.rollout_observe_s:
                self._replace_old(ro, surge)
            return
        failed = surge is None or surge.state is ReplicaState.CRASHED
        started = self.now if ro.surge_started is None else ro.surge_started
        if failed or self.now - started > self.config.ready_timeout_s:
            self._roll_back(ro, "new replica crashed" if failed else "new replica not ready in time")

    def _errs_more_than_old(self, ro: Rollout, surge: ObservedReplica) -> str | None:
        rates = self.observed.error_rates
        new_rate = rates.get(surge.replica_id)
        if new_rate is None:
            return None
        old_rates = [rates.get(r.replica_id) for r in self._stable()
                     if r.generation != ro.generation and r.state is ReplicaState.READY]
        baseline = max((rate for rate in old_rates if rate is not None), default=0.0)
        if new_rate > baseline + self.config.rollout_max_error_increase:
            return f"new replica errors on {new_rate:.1%} of requests, the old ones on {baseline:.1%}"
        return None

    def _replace_old(self, ro: Rollout, surge: ObservedReplica) -> None:
        zone_old = [r for r in self._stable() if r.zone == surge.zone
                    and r.generation != ro.generation and r.state is not ReplicaState.DRAINING]
        if zone_old:
            self._drain(zone_old[0], f"replaced by {surge.replica_id}")
        self.desired = replace(self.desired, rollout=replace(ro, surge=None, surge_ready_at=None))

    def _roll_back(self, ro: Rollout, reason: str) -> None:
        for r in self._stable():
            if r.generation == ro.generation and r.state is not ReplicaState.DRAINING:
                self._drain(r, "rollback")
        self.desired = replace(self.desired, rollout=None)
        self.actions.append(RollBack(ro.model, reason))

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _stable(self) -> list[ObservedReplica]:
        """The stable fleet's replicas (a canary's are counted and replaced on their own)."""
        return [r for r in self.replicas.values() if not r.version]

    def _act(self, action: Action, after: ObservedReplica) -> None:
        self.actions.append(action)
        self.replicas[after.replica_id] = after

    def _spawn(self, zone: str, model: str, generation: int, reason: str, *, version: str = "") -> str:
        rid = _next_id(zone, self.replicas)
        self._act(Spawn(rid, zone, model, generation, reason, version),
                  ObservedReplica(rid, zone, 0, model, generation, ReplicaState.STARTING, self.now,
                                  is_running=True, version=version))
        return rid

    def _drain(self, r: ObservedReplica, reason: str) -> None:
        self._act(Drain(r.replica_id, reason),
                  replace(r, state=ReplicaState.DRAINING, drain_started=self.now))

    def _remove(self, r: ObservedReplica, reason: str) -> None:
        self.actions.append(Remove(r.replica_id, reason))
        del self.replicas[r.replica_id]


def _drain_candidates(live: list[ObservedReplica]) -> list[ObservedReplica]:
    """Not-ready replicas first, then the newest."""
    return sorted(live, key=lambda r: (r.state is ReplicaState.READY, -r.started_at))


def _next_id(zone: str, taken: Mapping[str, object]) -> str:
    n = 1
    while f"{zone}-{n}" in taken:
        n += 1
    return f"{zone}-{n}"
