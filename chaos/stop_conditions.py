"""Stop conditions: when a running experiment or drill must stop, and the guard that stops it.

Where it sits: the experiment runner (:mod:`chaos.experiment`), the drills and the REST API build
conditions from the limits a user gives; a monitor watches them while the work runs and, on a trip, the
work is cancelled and its faults reverted through a :class:`Reverter` (``chaos.safety.FaultManager``
satisfies it; this module does not import it). ``chaos.safety`` re-exports every public name here, so
``from chaos.safety import StopCondition`` keeps working.

A :class:`StopCondition` is a name, a probe (a callable, sync or async, returning a float, or None for "no
data", which never trips), a comparison and a threshold; it *trips* when ``value <comparison> threshold``
holds. Ready-made ones take callables, so the control plane feeds its telemetry in without chaos
importing it::

    conditions = [error_rate_above(lambda: summary().error_rate, 0.05),
                  p99_ttft_above(lambda: summary().ttft.p99, 2.0),
                  ready_replicas_below(lambda: fleet.num_ready(), 2)]
    # or, from any object with error_rate() / p99_ttft_s() / ready_replicas():
    conditions = fleet_conditions(signals, max_error_rate=0.05, max_p99_ttft_s=2.0, min_ready=2)

    monitor = StopMonitor(conditions, interval_s=1.0, clock=clock)
    outcome = await guard(run_the_drill(), monitor, manager=fault_manager, fault_ids=lambda: my_fault_ids)
    if outcome.trip is not None:       # the work was cancelled and every listed fault reverted
        print(outcome.trip.describe())  # "p99_ttft 2.31 > 2"

``StopMonitor.check()`` evaluates every condition once (the first trip wins, in list order);
``StopMonitor.watch()`` checks every ``interval_s`` on the clock until one trips. ``guard`` runs the work
and the watch side by side; on a trip it cancels the work, reverts the faults ``fault_ids()`` names through
the manager and returns a :class:`Guarded` with the trip and the revert results.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import operator
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from chaos.clock import Clock, MonotonicClock
from chaos.faults.base import RevertResult

logger = logging.getLogger(__name__)


Comparison = Literal[">", ">=", "<", "<="]
ProbeValue = float | int | None
Probe = Callable[[], ProbeValue | Awaitable[ProbeValue]]
T = TypeVar("T")

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
DEFAULT_CHECK_INTERVAL_S = 1.0


@dataclass(slots=True, frozen=True)
class StopCondition:
    """Trips when ``probe() <comparison> threshold``; a probe returning None (no data) never trips.

    A probe that raises counts as no data unless ``trip_on_error`` (then the error trips it, with value
    None and the error in the trip's ``detail``).
    """

    name: str
    probe: Probe
    comparison: Comparison
    threshold: float
    trip_on_error: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: required")
        if self.comparison not in _COMPARE:
            raise ValueError(f"comparison: must be one of {', '.join(_COMPARE)}, got {self.comparison!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold):
            raise ValueError(f"threshold: must be a finite number, got {self.threshold!r}")
        if not callable(self.probe):
            raise ValueError(f"probe: must be callable, got {self.probe!r}")

    def describe(self) -> str:
        return f"{self.name} {self.comparison} {self.threshold:g}"

    async def evaluate(self, at: float) -> StopTrip | None:
        """The trip when the condition holds now, else None."""
        try:
            value = self.probe()
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            logger.warning("stop condition %s: probe failed: %s", self.name, exc)
            if not self.trip_on_error:
                return None
            return StopTrip(self.name, None, self.comparison, self.threshold, at, f"probe failed: {exc}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            logger.warning("stop condition %s: probe returned %r, not a number", self.name, value)
            return None
        if not _COMPARE[self.comparison](float(value), self.threshold):
            return None
        return StopTrip(self.name, float(value), self.comparison, self.threshold, at)


@dataclass(slots=True, frozen=True)
class StopTrip:
    """Which condition tripped, with the value it saw, at what time on the monitor's clock."""

    name: str
    value: float | None
    comparison: Comparison
    threshold: float
    at: float
    detail: str = ""

    def describe(self) -> str:
        seen = "no value" if self.value is None else f"{self.value:g}"
        tail = f" ({self.detail})" if self.detail else ""
        return f"{self.name} {seen} {self.comparison} {self.threshold:g}{tail}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "comparison": self.comparison,
                "threshold": self.threshold, "at": self.at, "detail": self.detail,
                "description": self.describe()}


def error_rate_above(probe: Probe, threshold: float, *, name: str = "error_rate") -> StopCondition:
    """Trips when the share of failed requests (0..1) is above ``threshold``."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold: an error rate is a share in 0..1, got {threshold!r}")
    return StopCondition(name, probe, ">", threshold)


def p99_ttft_above(probe: Probe, threshold_s: float, *, name: str = "p99_ttft") -> StopCondition:
    """Trips when the P99 time to first token (seconds) is above ``threshold_s``."""
    if threshold_s <= 0:
        raise ValueError(f"threshold_s: must be positive, got {threshold_s!r}")
    return StopCondition(name, probe, ">", threshold_s)


def ready_replicas_below(probe: Probe, floor: int, *, name: str = "ready_replicas") -> StopCondition:
    """Trips when fewer than ``floor`` replicas are ready."""
    if floor < 1:
        raise ValueError(f"floor: must be at least 1, got {floor!r}")
    return StopCondition(name, probe, "<", float(floor))


class FleetSignals(Protocol):
    """What the ready-made conditions read; the control plane adapts its telemetry and fleet to it."""

    def error_rate(self) -> float | None: ...

    def p99_ttft_s(self) -> float | None: ...

    def ready_replicas(self) -> int | None: ...


def fleet_conditions(signals: FleetSignals, *, max_error_rate: float | None = None,
                     max_p99_ttft_s: float | None = None,
                     min_ready: int | None = None) -> list[StopCondition]:
    """The standard conditions for the limits given (None: that limit is not checked)."""
    conditions = []
    if max_error_rate is not None:
        conditions.append(error_rate_above(signals.error_rate, max_error_rate))
    if max_p99_ttft_s is not None:
        conditions.append(p99_ttft_above(signals.p99_ttft_s, max_p99_ttft_s))
    if min_ready is not None:
        conditions.append(ready_replicas_below(signals.ready_replicas, min_ready))
    return conditions


class StopMonitor:
    """Evaluates stop conditions every ``interval_s`` on ``clock``; remembers the first trip."""

    def __init__(self, conditions: Iterable[StopCondition], *, interval_s: float = DEFAULT_CHECK_INTERVAL_S,
                 clock: Clock | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be positive, got {interval_s!r}")
        self.conditions = tuple(conditions)
        self.interval_s = interval_s
        self._clock: Clock = clock or MonotonicClock()
        self.tripped: StopTrip | None = None
        self.num_checks = 0

    async def check(self) -> StopTrip | None:
        """Evaluate every condition once; the first that trips (in list order) is the trip."""
        self.num_checks += 1
        for condition in self.conditions:
            trip = await condition.evaluate(self._clock.now())
            if trip is not None:
                logger.warning("stop condition tripped: %s", trip.describe())
                self.tripped = trip
                return trip
        return None

    async def watch(self) -> StopTrip:
        """Check now and then every ``interval_s`` until a condition trips (cancel to stop watching)."""
        while True:
            trip = await self.check()
            if trip is not None:
                return trip
            await self._clock.sleep(self.interval_s)


class Reverter(Protocol):
    """What reverts a run's faults when a condition trips (``chaos.safety.FaultManager``)."""

    async def revert(self, fault_id: int) -> RevertResult: ...


@dataclass(slots=True, frozen=True)
class Guarded(Generic[T]):
    """What :func:`guard` saw: the work's result, or the trip that cancelled it and the reverts it did."""

    result: T | None
    trip: StopTrip | None = None
    reverts: tuple[RevertResult, ...] = ()

    @property
    def aborted(self) -> bool:
        return self.trip is not None


async def guard(work: Coroutine[Any, Any, T], monitor: StopMonitor, *, manager: Reverter | None = None,
                fault_ids: Callable[[], Iterable[int]] = tuple,
                on_trip: Callable[[StopTrip], Awaitable[None] | None] | None = None) -> Guarded[T]:
    """Run ``work`` while ``monitor`` watches; on a trip cancel it and revert the run's faults.

    With no conditions the work simply runs. An exception from the work propagates (after its faults are
    left to their own expiry, as without a guard).
    """
    task = asyncio.ensure_future(work)
    if not monitor.conditions:
        return Guarded(await task)
    watcher = asyncio.ensure_future(monitor.watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return Guarded(task.result())
    trip = watcher.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    reverts = await abort_run(trip, manager=manager, fault_ids=fault_ids())
    if on_trip is not None:
        outcome = on_trip(trip)
        if inspect.isawaitable(outcome):
            await outcome
    return Guarded(None, trip, reverts)


async def abort_run(trip: StopTrip, *, manager: Reverter | None,
                    fault_ids: Iterable[int]) -> tuple[RevertResult, ...]:
    """Revert every fault of a run that a stop condition aborted; failures come back as values."""
    ids = sorted(set(fault_ids))
    logger.warning("aborting run (%s): reverting faults %s", trip.describe(), ids)
    if manager is None or not ids:
        return ()
    return tuple(await asyncio.gather(*(manager.revert(fid) for fid in ids)))
