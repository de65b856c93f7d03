"""FaultManager on an in-memory ledger and a simulated clock: ledger order, expiry, halt, blast radius."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from chaos.catalogue import Catalogue
from chaos.faults.base import FaultSpec, FaultUnavailable
from chaos.safety import BlastRadiusExceeded, FaultManager, Halted
from chaos.targets import Selector

from .fakes import FakeClock, MemoryLedger, RecordingFault, fleet


def make_manager(*faults: RecordingFault, max_fraction_down: float = 0.5,
          halt_deadline_s: float = 2.0) -> tuple[FaultManager, MemoryLedger, FakeClock]:
    events = faults[0].events if faults else []
    ledger, clock = MemoryLedger(events), FakeClock()
    manager = FaultManager(Catalogue(faults), ledger, clock=clock, max_fraction_down=max_fraction_down,
                           halt_deadline_s=halt_deadline_s)
    return manager, ledger, clock


def spec(kind: str = "record", selector: str = "ALL", duration_s: float = 10.0, **kw: Any) -> FaultSpec:
    return FaultSpec(kind=kind, duration_s=duration_s, selector=Selector.parse(selector, **kw))


def test_revert_record_is_registered_before_the_fault_is_injected() -> None:
    fault = RecordingFault()
    manager, ledger, _ = make_manager(fault)

    async def scenario() -> None:
        [active] = await manager.inject(spec(selector="ALL", replica_ids=["r1"]), fleet(3))
        assert active.ok and active.fault_id == 1
        await manager.aclose()

    asyncio.run(scenario())
    assert fault.events == ["register:1", "inject:r1", "mark:1:injected"]
    row = ledger.rows[1]
    assert row.revert["data"] == {"stage": "registered"}
    assert json.loads(row.detail)["token"]["data"] == {"stage": "injected"}


def test_fault_reverts_itself_when_its_duration_ends() -> None:
    fault = RecordingFault()
    manager, ledger, clock = make_manager(fault)

    async def scenario() -> None:
        await manager.inject(spec(duration_s=10), fleet(2))
        await clock.advance(9.9)
        assert [ledger.state(i) for i in (1, 2)] == ["injected", "injected"]
        await clock.advance(0.2)
        assert [ledger.state(i) for i in (1, 2)] == ["reverted", "reverted"]
        assert manager.active() == []

    asyncio.run(scenario())
    assert [t.data["stage"] for t in fault.reverted] == ["injected", "injected"]


def test_failed_revert_at_expiry_is_retried_then_recorded() -> None:
    fault = RecordingFault(revert_mode="fail_retryable")
    manager, ledger, clock = make_manager(fault)

    async def scenario() -> None:
        await manager.inject(spec(duration_s=5, replica_ids=["r0"]), fleet(2))
        await clock.advance(5)
        await clock.advance(1)
        await clock.advance(1)
        assert fault.events.count("revert:r0:injected") == 3
        await manager.aclose()

    asyncio.run(scenario())
    assert ledger.state(1) == "revert_failed"
    assert "cannot revert" in json.loads(ledger.rows[1].detail)["error"]


def test_halt_all_reverts_every_fault_concurrently_within_the_deadline() -> None:
    fault = RecordingFault(revert_delay_s=0.3)
    manager, ledger, _ = make_manager(fault)

    async def scenario() -> float:
        await manager.inject(spec(), fleet(5))
        started = time.monotonic()
        report = await manager.halt_all()
        assert report.ok and sorted(report.reverted) == [1, 2, 3, 4, 5]
        return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    assert elapsed < 1.0  # five 0.3 s reverts side by side, not one after another
    assert {r.state for r in ledger.rows.values()} == {"reverted"}


def test_halt_all_returns_by_the_deadline_when_a_revert_hangs() -> None:
    hanging = RecordingFault(name="stuck", revert_mode="hang")
    fine = RecordingFault(name="fine", events=hanging.events)
    manager, ledger, _ = make_manager(hanging, fine, halt_deadline_s=0.3)

    async def scenario() -> float:
        await manager.inject(spec("stuck", replica_ids=["r0"]), fleet(3))
        await manager.inject(spec("fine", replica_ids=["r1"]), fleet(3))
        started = time.monotonic()
        report = await manager.halt_all()
        elapsed = time.monotonic() - started
        assert report.reverted == (2,) and list(report.failed) == [1]
        assert "did not finish within 0.3s" in report.failed[1]
        await manager.aclose()
        return elapsed

    assert asyncio.run(scenario()) < 1.0
    assert ledger.state(1) == "revert_failed" and ledger.state(2) == "reverted"


def test_new_faults_are_refused_while_halted_until_release() -> None:
    fault = RecordingFault()
    manager, ledger, _ = make_manager(fault)

    async def scenario() -> None:
        await manager.halt_all()
        with pytest.raises(Halted, match="release"):
            await manager.inject(spec(), fleet(2))
        assert not manager.plan(spec(), fleet(2)).allowed
        assert ledger.rows == {}
        manager.release()
        assert len(await manager.inject(spec(), fleet(2))) == 2
        await manager.aclose()

    asyncio.run(scenario())


def test_blast_radius_refuses_taking_down_every_replica_unless_allowed() -> None:
    fault = RecordingFault(name="kill", takes_down=True)
    manager, ledger, _ = make_manager(fault, max_fraction_down=1.0)

    async def scenario() -> None:
        with pytest.raises(BlastRadiusExceeded, match="all 2 replicas"):
            await manager.inject(spec("kill"), fleet(2))
        assert ledger.rows == {} and fault.events == []
        assert len(await manager.inject(spec("kill"), fleet(2), allow_all=True)) == 2
        await manager.aclose()

    asyncio.run(scenario())


def test_blast_radius_counts_replicas_already_down() -> None:
    fault = RecordingFault(name="kill", takes_down=True)
    manager, _, _ = make_manager(fault, max_fraction_down=0.5)

    async def scenario() -> None:
        targets = fleet(4)
        assert not manager.plan(spec("kill", "COUNT(3)"), targets).allowed
        await manager.inject(spec("kill", replica_ids=["r0", "r1"]), targets)
        plan = manager.plan(spec("kill", replica_ids=["r2"]), targets)
        assert plan.num_down_after == 3 and "max_fraction_down=0.5" in plan.reasons[0]
        await manager.aclose()

    asyncio.run(scenario())


def test_faults_that_keep_replicas_serving_are_not_limited_by_blast_radius() -> None:
    manager, _, _ = make_manager(RecordingFault(takes_down=False))
    assert manager.plan(spec(), fleet(3)).allowed


def test_dry_run_changes_nothing() -> None:
    fault = RecordingFault(takes_down=True)
    manager, ledger, _ = make_manager(fault)
    plan = manager.plan(spec(selector="COUNT(1)", seed=3), fleet(3))
    assert plan.allowed and len(plan.targets) == 1 and plan.duration_s == 10
    assert plan.info.kind == "record" and plan.num_down_after == 1 and plan.num_targets == 3
    assert ledger.rows == {} and fault.events == [] and manager.active() == []


def test_revert_is_idempotent() -> None:
    fault = RecordingFault()
    manager, ledger, _ = make_manager(fault)

    async def scenario() -> None:
        [active] = await manager.inject(spec(replica_ids=["r0"]), fleet(2))
        assert active.fault_id is not None
        first, second = await asyncio.gather(manager.revert(active.fault_id), manager.revert(active.fault_id))
        third = await manager.revert(active.fault_id)
        unknown = await manager.revert(99)
        assert first.ok and second.ok and third.ok and unknown.ok

    asyncio.run(scenario())
    assert len(fault.reverted) == 1 and ledger.state(1) == "reverted"


def test_revert_failure_is_recorded_in_the_ledger_not_raised() -> None:
    fault = RecordingFault(revert_mode="fail")
    manager, ledger, _ = make_manager(fault)

    async def scenario() -> None:
        [active] = await manager.inject(spec(replica_ids=["r0"]), fleet(2))
        assert active.fault_id is not None
        result = await manager.revert(active.fault_id)
        assert not result.ok and not result.retryable and "cannot revert" in result.detail
        await manager.aclose()

    asyncio.run(scenario())
    detail = json.loads(ledger.rows[1].detail)
    assert ledger.state(1) == "revert_failed" and "cannot revert" in detail["error"]
    assert detail["token"]["data"] == {"stage": "injected"}  # still there for the next attempt


def test_failed_inject_is_reverted_with_the_registered_record_and_reported() -> None:
    fault = RecordingFault(inject_fails=True)
    manager, ledger, _ = make_manager(fault)

    async def scenario() -> None:
        [active] = await manager.inject(spec(replica_ids=["r0"]), fleet(2))
        assert not active.ok and "refused" in (active.error or "")

    asyncio.run(scenario())
    assert fault.events == ["register:1", "inject:r0", "revert:r0:registered", "mark:1:reverted"]
    assert ledger.state(1) == "reverted"


def test_leftovers_are_reverted_by_the_next_manager() -> None:
    fault = RecordingFault()
    ledger, clock = MemoryLedger(fault.events), FakeClock()

    async def scenario() -> None:
        first = FaultManager(Catalogue([fault]), ledger, clock=clock)
        await first.inject(spec(replica_ids=["r0"]), fleet(2))
        await first.aclose()  # the process "dies": no revert, the ledger still says injected
        ledger.register_fault("record", "r1", {}, {"kind": "record", "target": "r1", "action": "record",
                                                   "data": {"stage": "registered"}})  # crashed mid-inject
        second = FaultManager(Catalogue([fault]), ledger, clock=clock)
        results = await second.revert_leftovers()
        assert [r.ok for r in results] == [True, True]

    asyncio.run(scenario())
    assert [(t.target, t.data["stage"]) for t in fault.reverted] == [("r0", "injected"), ("r1", "registered")]
    assert ledger.active_faults() == []


def test_leftover_of_an_unavailable_kind_is_recorded_as_revert_failed() -> None:
    ledger = MemoryLedger()
    ledger.register_fault("gone", "r0", {}, {"kind": "gone", "target": "r0", "action": "x", "data": {}})
    catalogue = Catalogue()
    catalogue.register_unavailable("gone", "no bcc here")
    manager = FaultManager(catalogue, ledger, clock=FakeClock())
    [result] = asyncio.run(manager.revert_leftovers())
    assert not result.ok and "unavailable: no bcc here" in result.detail
    assert ledger.state(1) == "revert_failed"


def test_unavailable_kind_cannot_be_injected() -> None:
    catalogue = Catalogue()
    catalogue.register_unavailable("network", "bcc is not installed")
    manager = FaultManager(catalogue, MemoryLedger(), clock=FakeClock())
    with pytest.raises(FaultUnavailable, match="unavailable: bcc is not installed"):
        asyncio.run(manager.inject(spec("network"), fleet(2)))
