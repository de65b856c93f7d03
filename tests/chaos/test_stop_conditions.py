"""Stop conditions on fake probes and a simulated clock: what trips, when it is checked, and that a trip
cancels the run and reverts every fault of it (and only those)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from chaos.catalogue import Catalogue
from chaos.faults.base import FaultSpec
from chaos.safety import (
    FaultManager,
    StopCondition,
    StopMonitor,
    error_rate_above,
    fleet_conditions,
    guard,
    p99_ttft_above,
    ready_replicas_below,
)
from chaos.targets import Selector

from .fakes import FakeClock, MemoryLedger, RecordingFault, fleet


class Series:
    """A probe that returns the next value of a script each time it is read (the last one repeats)."""

    def __init__(self, *values: float | None) -> None:
        self.values = list(values)
        self.reads = 0

    def __call__(self) -> float | None:
        self.reads += 1
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def test_each_comparison_trips_only_past_its_threshold() -> None:
    async def value(cond: StopCondition) -> float | None:
        trip = await cond.evaluate(0.0)
        return None if trip is None else trip.value

    assert asyncio.run(value(error_rate_above(lambda: 0.05, 0.05))) is None  # equal is not above
    assert asyncio.run(value(error_rate_above(lambda: 0.051, 0.05))) == 0.051
    assert asyncio.run(value(ready_replicas_below(lambda: 2, 2))) is None
    assert asyncio.run(value(ready_replicas_below(lambda: 1, 2))) == 1.0
    assert asyncio.run(value(StopCondition("x", lambda: 3, ">=", 3))) == 3.0
    assert asyncio.run(value(StopCondition("x", lambda: 3, "<=", 2))) is None


def test_no_data_never_trips_and_a_failing_probe_trips_only_when_asked() -> None:
    def broken() -> float:
        raise RuntimeError("telemetry down")

    async def run() -> None:
        assert await p99_ttft_above(lambda: None, 1.0).evaluate(0) is None
        assert await StopCondition("ttft", broken, ">", 1.0).evaluate(0) is None
        trip = await StopCondition("ttft", broken, ">", 1.0, trip_on_error=True).evaluate(5.0)
        assert trip is not None and trip.value is None and "telemetry down" in trip.describe()

    asyncio.run(run())


def test_async_probes_are_awaited() -> None:
    async def probe() -> float:
        return 0.9

    trip = asyncio.run(error_rate_above(probe, 0.5).evaluate(1.0))
    assert trip is not None and trip.describe() == "error_rate 0.9 > 0.5"


def test_bad_conditions_are_refused() -> None:
    with pytest.raises(ValueError, match="comparison"):
        StopCondition("x", lambda: 1, "==", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold"):
        error_rate_above(lambda: 0, 1.5)
    with pytest.raises(ValueError, match="floor"):
        ready_replicas_below(lambda: 0, 0)
    with pytest.raises(ValueError, match="interval_s"):
        StopMonitor([], interval_s=0)


@dataclass
class Signals:
    errors: float | None = 0.0
    ttft: float | None = 0.2
    ready: int | None = 3

    def error_rate(self) -> float | None:
        return self.errors

    def p99_ttft_s(self) -> float | None:
        return self.ttft

    def ready_replicas(self) -> int | None:
        return self.ready


def test_fleet_conditions_read_the_signals_live() -> None:
    signals = Signals()
    conditions = fleet_conditions(signals, max_error_rate=0.1, max_p99_ttft_s=1.0, min_ready=2)
    assert [c.describe() for c in conditions] == ["error_rate > 0.1", "p99_ttft > 1", "ready_replicas < 2"]
    monitor = StopMonitor(conditions, clock=FakeClock())
    assert asyncio.run(monitor.check()) is None
    signals.ready = 1
    trip = asyncio.run(monitor.check())
    assert trip is not None and trip.name == "ready_replicas" and trip.value == 1.0
    assert fleet_conditions(signals) == []


def test_monitor_checks_every_interval_on_the_clock_and_reports_when_it_tripped() -> None:
    ttft = Series(0.3, 0.4, 0.5, 2.5)
    clock = FakeClock()
    monitor = StopMonitor([p99_ttft_above(ttft, 1.0)], interval_s=5.0, clock=clock)

    async def run() -> None:
        watcher = asyncio.ensure_future(monitor.watch())
        await clock.advance(0)
        assert ttft.reads == 1 and not watcher.done()
        await clock.advance(4.9)
        assert ttft.reads == 1
        await clock.advance(0.1)
        await clock.advance(5)
        assert ttft.reads == 3 and not watcher.done()
        await clock.advance(5)
        assert watcher.done()
        trip = watcher.result()
        assert (trip.name, trip.value, trip.at) == ("p99_ttft", 2.5, 15.0)
        assert trip.to_json()["description"] == "p99_ttft 2.5 > 1"

    asyncio.run(run())
    assert monitor.tripped is not None and monitor.num_checks == 4


def test_trip_cancels_the_run_and_reverts_every_fault_of_it_but_no_other() -> None:
    fault = RecordingFault()
    ledger, clock = MemoryLedger(fault.events), FakeClock()
    manager = FaultManager(Catalogue([fault]), ledger, clock=clock, max_fraction_down=1.0)
    errors = Series(0.0, 0.0, 0.4)
    ours: list[int] = []
    reached_the_end = False

    async def drill() -> str:
        nonlocal reached_the_end
        for rid in ("r0", "r1"):
            spec = FaultSpec("record", {}, 600, Selector.parse("ALL", replica_ids=[rid]))
            [active] = await manager.inject(spec, fleet(3))
            ours.append(active.fault_id or 0)
            await clock.sleep(10)
        reached_the_end = True
        return "done"

    async def run() -> None:
        other = FaultSpec("record", {}, 600, Selector.parse("ALL", replica_ids=["r2"]))
        [unrelated] = await manager.inject(other, fleet(3))
        monitor = StopMonitor([error_rate_above(errors, 0.1)], interval_s=5, clock=clock)
        task = asyncio.ensure_future(guard(drill(), monitor, manager=manager, fault_ids=lambda: ours))
        for _ in range(4):
            await clock.advance(5)
        outcome = await task
        assert outcome.aborted and outcome.result is None
        assert outcome.trip is not None and outcome.trip.describe() == "error_rate 0.4 > 0.1"
        assert [r.fault_id for r in outcome.reverts] == [2, 3] and all(r.ok for r in outcome.reverts)
        assert [a.fault_id for a in manager.active()] == [unrelated.fault_id]
        await manager.aclose()

    asyncio.run(run())
    assert not reached_the_end
    assert [ledger.state(i) for i in (1, 2, 3)] == ["injected", "reverted", "reverted"]


def test_guard_returns_the_result_when_nothing_trips() -> None:
    clock = FakeClock()
    monitor = StopMonitor([error_rate_above(lambda: 0.0, 0.1)], interval_s=1, clock=clock)

    async def work() -> int:
        await clock.sleep(3)
        return 42

    async def run() -> None:
        task = asyncio.ensure_future(guard(work(), monitor))
        for _ in range(4):
            await clock.advance(1)
        outcome = await task
        assert (outcome.result, outcome.trip, outcome.reverts) == (42, None, ())

    asyncio.run(run())
    assert monitor.num_checks >= 3
