"""Autoscaling decisions as pure functions: a snapshot and a policy in, a decision with its reasons out.

The autoscaler loop observes a :class:`Snapshot`, calls :func:`decide`, applies the decision once and
stores it. Nothing here does I/O, reads a clock or changes its arguments: time comes in with the snapshot,
history comes in as the recent recommendations, the remembered :class:`PanicState` comes in and its next
value goes out (and :func:`applied` once the caller scaled), so every rule is unit-tested on synthetic
snapshots.

Sources propose a replica count: target tracking (the Kubernetes HPA formula ``ceil(current * metric /
target)`` over several metrics, with a per-direction tolerance and conservative handling of missing
metrics and not-ready replicas) and panic mode (Knative KPA: scale up fast when demand exceeds twice the
ready capacity, never down while panicking). The merge takes the largest proposal, then clamps: min/max,
the scale-down stabilization window (the highest recommendation in the window wins) and per-direction
rate limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


@dataclass(slots=True, frozen=True)
class MetricTarget:
    """Scale so that ``value`` per ready replica stays near ``target`` (HPA's AverageValue)."""

    name: str  # e.g. "waiting_per_replica", "kv_cache_usage", "ttft_p95_s", "tokens_per_s_per_replica"
    target: float
    # A guard does not size the fleet, it only forbids scaling down while over its target. P95 TTFT has a
    # floor (the prefill time) and lags its window, and a queue is a backlog that more replicas drain rather
    # than a rate they serve: ceil(current * metric / target) overshoots on both. Load metrics size the fleet.
    guard: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: required")
        if not math.isfinite(self.target) or self.target <= 0:
            raise ValueError(f"{self.name}.target: must be > 0, got {self.target!r}")


DEFAULT_TARGETS = (
    MetricTarget("waiting_per_replica", 4.0),
    MetricTarget("kv_cache_usage", 0.8),
    MetricTarget("ttft_p95_s", 1.0),
    MetricTarget("tokens_per_s_per_replica", 400.0),
)


@dataclass(slots=True, frozen=True)
class PolicyConfig:
    min_replicas: int = 1
    max_replicas: int = 10
    targets: tuple[MetricTarget, ...] = DEFAULT_TARGETS
    tolerance: float = 0.1  # no change while every ratio is within 1 +- tolerance
    scale_down_stabilization_s: float = 300.0
    scale_up_max_step: int = 4  # replicas added per decision at most
    scale_up_max_percent: float = 100.0  # or this percent of current, whichever allows more
    scale_down_max_step: int = 1  # replicas removed per decision at most
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0  # demand over ready capacity that starts panic mode
    # At most one scale-down per period (0: every decision may scale down, by scale_down_max_step). Capacity
    # then declines gradually after a peak, so a burst that returns finds part of it still there instead of
    # scaling straight back up (HPA's scaleDown policy {type: Pods, value: 1, periodSeconds: 60}).
    scale_down_period_s: float = 0.0
    # KPA: panic mode goes straight to what demand needs; the rate limits then bound only steady tracking.
    panic_skips_rate_limit: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas/max_replicas: need 0 <= min <= max, got "
                             f"{self.min_replicas}/{self.max_replicas}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance: must be in [0, 1), got {self.tolerance!r}")
        if self.scale_down_stabilization_s < 0 or self.panic_window_s <= 0:
            raise ValueError("scale_down_stabilization_s must be >= 0 and panic_window_s > 0")
        if self.scale_up_max_step < 1 or self.scale_down_max_step < 1:
            raise ValueError("scale_up_max_step and scale_down_max_step: must be >= 1")
        if self.panic_threshold <= 1:
            raise ValueError(f"panic_threshold: must be > 1, got {self.panic_threshold!r}")
        if self.scale_down_period_s < 0:
            raise ValueError(f"scale_down_period_s: must be >= 0, got {self.scale_down_period_s!r}")


@dataclass(slots=True, frozen=True)
class Snapshot:
    """What the loop observed at ``now`` (seconds on the loop's clock)."""

    now: float
    current: int  # the fleet's desired replicas now
    ready: int
    starting: int
    metrics: Mapping[str, float | None]  # per MetricTarget.name; None when unknown
    # Panic mode's demand, fleet-wide, and what one ready replica serves, in the same unit (the live loop:
    # offered engine load in engine seconds per second, and its target per replica).
    demand: float | None = None
    capacity_per_replica: float | None = None


@dataclass(slots=True, frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(slots=True, frozen=True)
class Proposal:
    source: str
    replicas: int
    reason: str


@dataclass(slots=True, frozen=True)
class Decision:
    current: int
    replicas: int  # what to apply
    proposals: tuple[Proposal, ...]
    clamps: tuple[str, ...]  # each clamp that changed the number, with why
    panic: bool
    recommendation: int  # the merged proposal before stabilization and rate limits (kept for history)

    @property
    def changed(self) -> bool:
        return self.replicas != self.current


@dataclass(slots=True, frozen=True)
class PanicState:
    """Panic mode persists for ``panic_window_s`` after demand last exceeded the threshold."""

    until: float | None = None
    last_scale_down: float | None = None  # when the caller last applied a scale-down (scale_down_period_s)


def applied(state: PanicState, *, current: int, replicas: int, now: float) -> PanicState:
    """The state once the fleet was scaled from ``current`` to ``replicas`` at ``now``: a scale-down
    starts the next scale-down period. Only for a scale that happened (not observe-only, not failed)."""
    return replace(state, last_scale_down=now) if replicas < current else state


def target_tracking(snapshot: Snapshot, config: PolicyConfig) -> Proposal:
    """HPA's rule over every metric, the largest ratio wins; within tolerance nothing changes.

    As HPA does, replicas that are not ready count at 0% of the target when scaling up and at 100% when
    scaling down, so both directions stay conservative; a missing metric forbids scaling down.
    """
    current = max(snapshot.current, 1)
    ratios = [(t.name, v / t.target) for t in config.targets
              if not t.guard and (v := snapshot.metrics.get(t.name)) is not None]
    missing = [t.name for t in config.targets if snapshot.metrics.get(t.name) is None]
    if not ratios:
        return Proposal("target", snapshot.current, f"no metric known ({', '.join(missing)}): hold")
    name, ratio = max(ratios, key=lambda r: r[1])
    ready_share = min(snapshot.ready / current, 1.0) if snapshot.ready else 1.0
    if ratio > 1:
        effective = ratio * ready_share
    elif missing:
        return Proposal("target", snapshot.current, f"{', '.join(missing)} unknown: no scale-down")
    elif over := _guards_over(snapshot, config):
        return Proposal("target", snapshot.current, f"{over}: no scale-down")
    else:
        effective = ratio * ready_share + (1.0 - ready_share)
    if abs(effective - 1.0) <= config.tolerance:
        return Proposal("target", snapshot.current,
                        f"{name} at {ratio:.2f}x target ({effective:.2f}x counting not-ready replicas): "
                        f"within tolerance {config.tolerance:g}")
    wanted = math.ceil(current * effective)
    return Proposal("target", wanted, f"{name} at {ratio:.2f}x target: ceil({current} x {effective:.2f}) "
                                      f"= {wanted}")


def _guards_over(snapshot: Snapshot, config: PolicyConfig) -> str:
    over = [f"{t.name} at {v / t.target:.2f}x target" for t in config.targets
            if t.guard and (v := snapshot.metrics.get(t.name)) is not None and v > t.target]
    return ", ".join(over)


def panic(snapshot: Snapshot, config: PolicyConfig,
          state: PanicState) -> tuple[Proposal | None, bool, PanicState]:
    """KPA's panic mode: demand over ``panic_threshold`` x ready capacity scales straight to demand.
    (proposal, panicking, the state after this snapshot)."""
    if snapshot.demand is None or not snapshot.capacity_per_replica:
        return None, state.until is not None and snapshot.now < state.until, state
    capacity = max(snapshot.ready, 1) * snapshot.capacity_per_replica
    until = state.until
    if snapshot.demand > config.panic_threshold * capacity:
        until = snapshot.now + config.panic_window_s
    if until is None or snapshot.now >= until:
        return None, False, replace(state, until=None)
    wanted = max(math.ceil(snapshot.demand / snapshot.capacity_per_replica), snapshot.current)
    # three significant digits: demand may be requests (90) or engine seconds per second (1.63)
    reason = (f"demand {snapshot.demand:.3g} vs ready capacity {capacity:.3g}: panic for "
              f"{until - snapshot.now:.0f}s more, {wanted} replicas")
    return Proposal("panic", wanted, reason), True, replace(state, until=until)


def decide(snapshot: Snapshot, config: PolicyConfig, history: Sequence[Recommendation],
           state: PanicState, extra: Sequence[Proposal] = ()) -> tuple[Decision, PanicState]:
    """Merge every source's proposal and clamp it; ``history`` holds earlier recommendations. Returns the
    decision and the panic state after this snapshot (pass it through :func:`applied` once scaled)."""
    proposals = [target_tracking(snapshot, config), *extra]
    panic_proposal, panicking, state = panic(snapshot, config, state)
    if panic_proposal is not None:
        proposals.append(panic_proposal)
    recommendation = max(p.replicas for p in proposals)
    clamps: list[str] = []
    replicas = _clamp(recommendation, config.min_replicas, config.max_replicas, "min/max", clamps)
    if panicking and replicas < snapshot.current:
        clamps.append(f"panic: no scale-down ({replicas} -> {snapshot.current})")
        replicas = snapshot.current
    replicas = _stabilize(replicas, snapshot, config, history, clamps)
    if panicking and replicas > snapshot.current and config.panic_skips_rate_limit:
        clamps.append(f"panic: no rate limit on scale-up ({snapshot.current} -> {replicas})")
    else:
        replicas = _rate_limit(replicas, snapshot.current, config, clamps)
    replicas = _scale_down_period(replicas, snapshot, config, state, clamps)
    return Decision(snapshot.current, replicas, tuple(proposals), tuple(clamps), panicking,
                    _clamp(recommendation, config.min_replicas, config.max_replicas, "", [])), state


def _clamp(value: int, low: int, high: int, name: str, clamps: list[str]) -> int:
    clamped = min(max(value, low), high)
    if clamped != value and name:
        clamps.append(f"{name}: {value} -> {clamped} (bounds {low}..{high})")
    return clamped


def _stabilize(replicas: int, snapshot: Snapshot, config: PolicyConfig, history: Sequence[Recommendation],
               clamps: list[str]) -> int:
    """Scale down only to the highest recommendation of the stabilization window (HPA's behaviour)."""
    if replicas >= snapshot.current:
        return replicas
    window = [r.replicas for r in history if snapshot.now - r.at <= config.scale_down_stabilization_s]
    highest = max([replicas, *window])
    if highest > replicas:
        clamps.append(f"stabilization: {replicas} -> {min(highest, snapshot.current)} (highest "
                      f"recommendation in the last {config.scale_down_stabilization_s:g}s)")
    return min(highest, snapshot.current)


def _scale_down_period(replicas: int, snapshot: Snapshot, config: PolicyConfig, state: PanicState,
                       clamps: list[str]) -> int:
    if replicas >= snapshot.current or not config.scale_down_period_s:
        return replicas
    last = state.last_scale_down
    if last is not None and snapshot.now - last < config.scale_down_period_s:
        clamps.append(f"scale-down period: {replicas} -> {snapshot.current} (last scale-down "
                      f"{snapshot.now - last:.0f}s ago, one per {config.scale_down_period_s:g}s)")
        return snapshot.current
    return replicas


def _rate_limit(replicas: int, current: int, config: PolicyConfig, clamps: list[str]) -> int:
    if replicas > current:
        step = max(config.scale_up_max_step, math.ceil(current * config.scale_up_max_percent / 100))
        limited = min(replicas, current + step)
    else:
        limited = max(replicas, current - config.scale_down_max_step)
    if limited != replicas:
        clamps.append(f"rate limit: {replicas} -> {limited}")
    return limited


@dataclass(slots=True, frozen=True)
class History:
    """Recent recommendations, bounded by the stabilization window."""

    window_s: float
    items: tuple[Recommendation, ...] = ()

    def added(self, at: float, replicas: int) -> History:
        """This history with one more recommendation, less those that left the window by ``at``."""
        items = (*self.items, Recommendation(at, replicas))
        return History(self.window_s, tuple(r for r in items if at - r.at <= self.window_s))
