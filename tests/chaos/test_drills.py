"""The drill runner's timing on a simulated clock: how long it waits for the load, when it stops observing
recovery, and that an abort cuts a wait short. No load process, no gateway, no sleeps: the runner takes
the clock it is given, and the port is a stand-in whose answers depend on that clock's time.
(The whole drill on real replicas runs in ``tests/controlplane/up/test_drills.py``.)
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from chaos.catalogue import Catalogue
from chaos.drills import (
    LOAD_START_TIMEOUT_S,
    SAMPLE_INTERVAL_S,
    SETTLE_S,
    STEADY_POLL_S,
    STREAM_WAIT_S,
    DrillAborted,
    DrillRunner,
    FleetSample,
    LoadNotFlowing,
    Timings,
    _Run,
    load_not_started,
)
from chaos.safety import FaultManager
from chaos.scenarios import scenario
from chaos.targets import Target

from .fakes import MemoryLedger

T_START = 1_700_000_000.0  # wall-clock seconds, as the drills' real clock gives them


class SteppingClock:
    """Simulated wall time that moves only when the runner sleeps: each sleep takes no real time."""

    def __init__(self) -> None:
        self.t = T_START
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


@dataclass
class ClockedPort:
    """The control plane as the runner sees it, answering from the simulated time since the start."""

    clock: SteppingClock
    streams_from: float = float("inf")  # seconds after the start when the gateway sees a stream
    capacity_back_at: float = float("inf")  # seconds after the start when ready == desired again
    az_b_streams_from: float = float("inf")  # seconds after the start when az-b-1 has a stream too

    @property
    def gateway_url(self) -> str:
        return "http://127.0.0.1:9"

    def elapsed(self) -> float:
        return self.clock.t - T_START

    def fleet_sample(self) -> FleetSample:
        return FleetSample(self.clock.t, 3 if self.elapsed() >= self.capacity_back_at else 2, 3)

    def inflight(self) -> Mapping[str, int]:
        return {"az-a-1": 1 if self.elapsed() >= self.streams_from else 0,
                "az-b-1": 1 if self.elapsed() >= self.az_b_streams_from else 0}

    async def refresh_inflight(self) -> None:
        return None  # computed from the clock: always fresh

    def targets(self) -> Sequence[Target]:
        return [Replica("az-a-1", "az-a"), Replica("az-b-1", "az-b")]

    def timings(self) -> Timings:  # pragma: no cover - not reached by these phases
        raise AssertionError("not used")

    def start_rollout(self) -> str:  # pragma: no cover
        raise AssertionError("not used")

    def resumes_between(self, start_wall: float, end_wall: float) -> int:  # pragma: no cover
        return 0

    def write_marks(self, drill_id: str, n: int) -> list[int]:  # pragma: no cover
        return []

    def count_marks(self, ids: Sequence[int]) -> int:  # pragma: no cover
        return 0


@dataclass(frozen=True)
class Replica:
    """A replica as chaos sees it, on no machine (the runner's waits only read its id and zone)."""

    replica_id: str
    zone: str
    pid: int | None = None
    port: int = 9
    admin_url: str = "http://127.0.0.1:9"
    admin_token: str | None = None


@dataclass
class FinishedLoad:
    """The load client's process once it has exited."""

    returncode: int = 0
    pid: int = 0


def drill(tmp_path: Path, port_changes: Mapping[str, float] | None = None,
          abort: asyncio.Event | None = None, **scenario_changes: Any) -> tuple[_Run, SteppingClock]:
    clock = SteppingClock()
    port = ClockedPort(clock, **(port_changes or {}))
    runner = DrillRunner(port, FaultManager(Catalogue([]), MemoryLedger(), clock=clock), clock=clock)
    sc = replace(scenario("replica-crash"), **scenario_changes)
    phases: list[tuple[str, float]] = []
    run = _Run(runner, "d-1", sc, tmp_path, lambda name, f: phases.append((name, f)),
               abort or asyncio.Event())
    return run, clock


def events(run: _Run) -> list[str]:
    return [e["what"] for e in run.report["events"]]


def test_the_drill_clock_stamps_the_report(tmp_path: Path) -> None:
    run, _ = drill(tmp_path)
    run.note("hello")
    assert run.report["started_at"] == T_START and run.report["events"][0]["t"] == T_START


def test_the_load_counts_as_flowing_when_the_gateway_first_sees_a_stream(tmp_path: Path) -> None:
    run, clock = drill(tmp_path, {"streams_from": 7.0})
    started = asyncio.run(run._load_flowing())
    assert started == pytest.approx(T_START + 7.0, abs=0.06) and clock.now() == started  # polled every 0.05 s
    assert run.report["events"][-1]["after_s"] == pytest.approx(7.0, abs=0.06)


def test_a_load_that_never_reaches_the_gateway_fails_the_drill_after_the_start_timeout(
        tmp_path: Path) -> None:
    run, clock = drill(tmp_path)
    with pytest.raises(LoadNotFlowing, match="the load never reached the gateway"):
        asyncio.run(run._load_flowing())
    assert clock.now() - T_START == pytest.approx(LOAD_START_TIMEOUT_S, abs=0.06)


def test_the_strike_waits_for_a_stream_on_the_named_target_not_anywhere(tmp_path: Path) -> None:
    """Streams on az-a-1 from the start, on az-b-1 from 1.5 s: a drill aimed at az-b-1 strikes at 1.5 s
    (streams elsewhere do not make its failover measurable); one aimed at the busiest strikes at once."""
    run, clock = drill(tmp_path, {"streams_from": 0.0, "az_b_streams_from": 1.5}, replicas=("az-b-1",))
    asyncio.run(run._streams_in_flight(T_START))
    assert clock.now() - T_START == pytest.approx(1.5, abs=0.03)
    assert "no stream in flight on the targets" not in events(run)

    run, clock = drill(tmp_path, {"streams_from": 0.0, "az_b_streams_from": 1.5})
    asyncio.run(run._streams_in_flight(T_START))
    assert clock.now() == T_START


def test_a_target_left_idle_past_the_stream_wait_is_struck_anyway_and_the_report_says_so(
        tmp_path: Path) -> None:
    run, clock = drill(tmp_path, {"streams_from": 0.0}, zones=("az-b",))
    asyncio.run(run._streams_in_flight(T_START))
    assert STREAM_WAIT_S <= clock.now() - T_START <= STREAM_WAIT_S + 0.03
    assert events(run)[-1] == "no stream in flight on the targets"


def recover(run: _Run, clock: SteppingClock, load: FinishedLoad | None) -> float:
    """Run the recovery phase with t0 at the start; how long it observed, in simulated seconds."""
    run.load = load  # type: ignore[assignment]
    asyncio.run(run._observe_recovery(T_START, T_START))
    return clock.now() - T_START


def test_recovery_ends_once_the_load_is_done_and_capacity_held_for_the_settle_time(tmp_path: Path) -> None:
    run, clock = drill(tmp_path, {"capacity_back_at": 5.0}, capacity_deadline_s=90.0)
    observed = recover(run, clock, FinishedLoad())
    # the fault lasts 1 s; capacity returns at 5 s (seen by the sampling every 0.2 s) and must hold
    # SETTLE_S after the last sample without it before the phase may end
    assert 5.0 + SETTLE_S - SAMPLE_INTERVAL_S <= observed <= 5.0 + SETTLE_S + SAMPLE_INTERVAL_S
    assert "deadline passed" not in events(run) and "load finished" in events(run)
    assert all(s.t <= clock.now() for s in run.samples) and run.samples[0].t == T_START


def test_recovery_is_observed_until_the_deadline_when_capacity_never_returns(tmp_path: Path) -> None:
    run, clock = drill(tmp_path, capacity_deadline_s=30.0)
    observed = recover(run, clock, FinishedLoad())
    assert 30.0 <= observed <= 30.25 and events(run)[-1] == "deadline passed"


def test_recovery_waits_for_the_load_to_finish_even_with_capacity_back(tmp_path: Path) -> None:
    run, clock = drill(tmp_path, {"capacity_back_at": 0.0}, capacity_deadline_s=12.0)
    observed = recover(run, clock, None)  # no load process to finish: only the deadline ends the phase
    assert observed >= 12.0 and events(run)[-1] == "deadline passed"


def test_an_abort_cuts_a_wait_short(tmp_path: Path) -> None:
    async def aborted_run() -> None:
        abort = asyncio.Event()
        run, clock = drill(tmp_path, abort=abort)
        asyncio.get_running_loop().call_soon(abort.set)  # an operator aborts while the runner waits
        with pytest.raises(DrillAborted, match="aborted by an operator"):
            await run._observe_until(clock.now() + 3600.0, clock.now())
        assert clock.now() - T_START < 1.0

    asyncio.run(aborted_run())


def probe_ready_after(clock: SteppingClock, seconds: float) -> Any:
    """The gateway probe (a real stream through the gateway, in a drill) as the simulated clock says: no
    model listed before ``seconds``, then a quick stream."""
    async def probe(_url: str, _max_tokens: int, _clock: Any) -> tuple[float, float, str | None]:
        if clock.t - T_START < seconds:
            return 0.0, 0.0, "the gateway lists no model (no replica routable yet)"
        return 0.05, 0.3, None

    return probe


def test_a_drill_waits_for_the_steady_state_and_says_what_it_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after ``controlplane up``: no replica ready, the gateway lists no model yet."""
    run, clock = drill(tmp_path, {"capacity_back_at": 20.0})
    monkeypatch.setattr("chaos.drill_steady_state._probe", probe_ready_after(clock, 25.0))
    steady = asyncio.run(run._wait_steady_state())
    assert steady["ok"] and 25.0 <= steady["waited_s"] <= 25.0 + STEADY_POLL_S
    assert steady["waited_for"] == ["fleet: 2 of 3 replicas ready",
                                    "gateway probe: the gateway lists no model (no replica routable yet)"]
    assert events(run) == ["waiting for steady state", "steady state reached"]


def test_a_steady_state_never_met_aborts_the_drill_at_its_deadline_with_the_reasons(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, clock = drill(tmp_path, steady_state_timeout_s=30.0)
    monkeypatch.setattr("chaos.drill_steady_state._probe", probe_ready_after(clock, 0.0))
    asyncio.run(run._drill())
    assert 30.0 <= clock.now() - T_START <= 30.0 + STEADY_POLL_S
    assert run.report["status"] == "aborted"
    assert run.report["error"] == "steady state not met after waiting 30s: fleet: 2 of 3 replicas ready"
    assert "t0" not in run.report and run.load is None  # no load was started, no fault injected


def test_a_steady_state_met_at_once_waits_for_nothing(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run, clock = drill(tmp_path, {"capacity_back_at": 0.0})
    monkeypatch.setattr("chaos.drill_steady_state._probe", probe_ready_after(clock, 0.0))
    steady = asyncio.run(run._wait_steady_state())
    assert steady["ok"] and steady["waited_s"] == 0.0 and steady["waited_for"] == []
    assert clock.now() == T_START and events(run) == []


async def _process(code: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-c", code)


def test_a_load_client_that_never_started_is_reported_as_still_starting(tmp_path: Path) -> None:
    """What a drill says when its load did not start: the client's exit, or how far its log got."""
    async def check() -> None:
        log = tmp_path / "load.log"
        log.write_text("")
        silent = await _process("import time; time.sleep(60)")
        try:
            why = load_not_started(silent, log, waited_s=60.0)
            assert why.startswith(f"the load client (pid {silent.pid}) was still starting after 60 s: it had "
                                  "written nothing") and "load average" in why
            log.write_text("12:00:01 load client: run x: asking http://127.0.0.1:8000/v1/models for the "
                           "model\n")
            assert "still asking the gateway for its model" in load_not_started(silent, log, waited_s=60)
            log.write_text("12:00:02 load client: run x: 66 requests to http://127.0.0.1:8000/v1/completions "
                           "(model default)\n")
            sending = load_not_started(silent, log, waited_s=60)
            assert "was sending, but the gateway showed no stream" in sending
        finally:
            silent.kill()
            await silent.wait()
        failed = await _process("import sys; print('error: cannot name a model'); sys.exit(1)")
        await failed.wait()
        log.write_text("error: cannot name a model\n")
        assert load_not_started(failed, log, waited_s=1.0) == (
            "the load client exited with status 1 before any stream; its last line: 'error: cannot name a "
            "model'")

    asyncio.run(check())
