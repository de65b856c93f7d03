"""Slice experiments, pure parts and the run against a recording fault kind and scripted gateway outcomes: the
intervals of a difference, the sides of the merged outcomes (the uncoloured rest by subtraction), the spec's
checks, and a run that stops itself on the deviation, runs its whole duration without one, or is aborted,
reverting its fault and clearing its colours every time."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from chaos.catalogue import Catalogue
from chaos.faults.base import FaultKindInfo, ParamInfo
from chaos.safety import FaultManager
from controlplane.gateway.slices import Outcome
from controlplane.rollouts.experiment import (
    Bounds,
    ExperimentBusy,
    ExperimentSpec,
    SliceExperiments,
    sides,
)
from controlplane.rollouts.intervals import median_difference, share_difference, wilson
from controlplane.rollouts.traffic import TrafficSlices
from controlplane.store.database import Store
from tests.chaos.fakes import RecordingFault, fleet


# ---- intervals ------------------------------------------------------------------------------------
def test_wilson_matches_the_published_values() -> None:
    low, high = wilson(81, 263)  # Newcombe (1998), table I: 0.2553 .. 0.3662
    assert (round(low, 4), round(high, 4)) == (0.2553, 0.3662)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    assert wilson(0, 0) == (0.0, 1.0)


def test_newcombe_interval_matches_the_published_example() -> None:
    diff = share_difference(56, 70, 48, 80)  # Newcombe (1998), method 10: 0.0524 .. 0.3339
    assert diff is not None
    assert round(diff.estimate, 4) == 0.2
    assert (round(diff.low, 4), round(diff.high, 4)) == (0.0524, 0.3339)
    assert diff.excludes_zero


def test_a_slice_that_always_fails_against_one_that_never_does() -> None:
    diff = share_difference(12, 12, 0, 11)
    assert diff is not None and diff.estimate == 1.0
    assert 0.6 < diff.low < 1.0 and diff.high == 1.0  # inside [-1, 1], away from 0
    assert share_difference(0, 0, 0, 5) is None


def test_the_bootstrap_interval_of_medians_is_repeatable_and_holds_the_estimate() -> None:
    a = [0.2 + 0.001 * i for i in range(200)]
    b = [0.1 + 0.001 * i for i in range(200)]
    first = median_difference(a, b, metric="ttft_p50_s")
    assert first is not None and first == median_difference(a, b, metric="ttft_p50_s")
    assert first.low <= first.estimate <= first.high
    assert first.estimate == pytest.approx(0.1)
    assert first.excludes_zero
    assert median_difference([0.1], b, metric="ttft_p50_s") is None


# ---- sides and spec -------------------------------------------------------------------------------
def ok(at: float = 1.0, ttft: float = 0.05) -> Outcome:
    return Outcome(at, True, ttft, 0.01)


def failed(at: float = 1.0) -> Outcome:
    return Outcome(at, False, None, None)


SPEC = ExperimentSpec(share=0.1, fault="error_rate", params={"probability": 1.0}, duration_s=5.0,
                      check_interval_s=0.1, bounds=Bounds(min_samples=5))


def test_the_uncoloured_rest_is_every_request_less_the_two_colours() -> None:
    chaos, control = [failed()] * 3, [ok()] * 4
    outcomes = {"version:stable": [*chaos, *control, *[ok()] * 20, failed()], "version:v2": [ok()] * 5,
                "colour:chaos": chaos, "colour:control": control}
    s = sides(outcomes, SPEC)
    assert (len(s.experiment), len(s.control), s.total) == (3, 4, 33)
    assert (s.uncoloured, s.uncoloured_failed) == (26, 1)


@pytest.mark.parametrize(("change", "field"), [
    ({"share": 0.6}, "share"), ({"share": 0.0}, "share"), ({"fault": "kill"}, "fault"),
    ({"duration_s": 0}, "duration_s"), ({"check_interval_s": 0.01}, "check_interval_s"),
    ({"control": "chaos"}, "control"), ({"colour": "Bad"}, "colour"),
    ({"params": {"colour": "other"}}, "params.colour"),
    ({"bounds": Bounds(alpha=0.7)}, "alpha"),
])
def test_a_spec_the_run_cannot_take_names_its_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SPEC, **change)


def test_the_fault_goes_on_every_replica_with_the_experiment_colour() -> None:
    spec = SPEC.fault_spec()
    assert spec.params == {"probability": 1.0, "colour": "chaos"}
    assert spec.selector.describe().startswith("ALL") and spec.duration_s > SPEC.duration_s
    assert ExperimentSpec.from_json(SPEC.to_json()) == SPEC


# ---- runs -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class ColouredFault(RecordingFault):
    """A recording fault kind named and shaped as the replicas' coloured error_rate."""

    def describe(self) -> FaultKindInfo:
        return dataclasses.replace(super().describe(), params=(
            ParamInfo("probability", "number", "share refused"),
            ParamInfo("colour", "string", "only this colour", required=False)))


class Gateway:
    """Scripted outcomes per slice: each call to the source adds ``per_call`` requests of each kind."""

    def __init__(self, experiment_fails: bool, per_call: int = 4) -> None:
        self.experiment_fails, self.per_call = experiment_fails, per_call
        self.rows: dict[str, list[Outcome]] = {}

    async def __call__(self, since: float) -> Mapping[str, Mapping[str, list[Outcome]]]:
        now = time.time()
        for _ in range(self.per_call):
            chaos = failed(now) if self.experiment_fails else ok(now)
            control, rest = ok(now), [ok(now) for _ in range(8)]
            self.rows.setdefault("colour:chaos", []).append(chaos)
            self.rows.setdefault("colour:control", []).append(control)
            self.rows.setdefault("version:stable", []).extend([chaos, control, *rest])
        return {"gw-0": {k: [o for o in v if o.at >= since] for k, v in self.rows.items()}}


def run(tmp_path: Path, gateway: Gateway, body: Callable[[SliceExperiments], Any]) -> tuple[Any, Store,
                                                                                             ColouredFault]:
    fault = ColouredFault(name="error_rate")
    with Store(tmp_path / "state.db") as store:
        async def main() -> Any:
            manager = FaultManager(Catalogue([fault]), store)
            experiments = SliceExperiments(TrafficSlices(store, gateway), manager, lambda: fleet(2), store)
            return await body(experiments)

        return asyncio.run(main()), store, fault


def test_a_run_stops_itself_on_the_deviation_and_undoes_everything(tmp_path: Path) -> None:
    async def body(experiments: SliceExperiments) -> dict[str, Any]:
        experiment_id = experiments.start(SPEC, "tester")
        await asyncio.sleep(0.02)  # the fault goes in, then the colours
        assert experiments.slices.plan().to_json()["colours"] == {"chaos": 0.1, "control": 0.1}
        with pytest.raises(ExperimentBusy):
            experiments.start(SPEC, "tester")
        record = await experiments.wait(experiment_id)
        assert record is not None
        assert experiments.slices.plan().colours == ()
        return record

    record, _, fault = run(tmp_path, Gateway(experiment_fails=True), body)
    assert record["status"] == "deviated" and record["stopped"]["reason"] == "deviation"
    assert record["stopped"]["after_s"] < SPEC.duration_s
    assert record["faults_reverted"] and record["colours_cleared"]
    assert sorted(e.split(":")[0] for e in fault.events) == ["inject"] * 2 + ["revert"] * 2
    report = record["report"]
    assert report["experiment"]["failed"] == report["experiment"]["requests"] >= 5
    assert report["control"]["failed"] == 0 and report["uncoloured"]["failed"] == 0
    assert report["uncoloured"]["requests"] == 8 * report["experiment"]["requests"]
    error = next(d for d in report["differences"] if d["metric"] == "error_rate")
    assert error["estimate"] == 1.0 and error["excludes_zero"] and error["confidence"] == 0.95
    assert record["checks"] and record["checks"][-1]["verdict"] == "fail"


def test_a_run_without_a_deviation_lasts_its_duration(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, duration_s=0.5)

    async def body(experiments: SliceExperiments) -> dict[str, Any] | None:
        return await experiments.wait(experiments.start(spec, "tester"))

    record, _, _ = run(tmp_path, Gateway(experiment_fails=False), body)
    assert record is not None
    assert record["status"] == "completed" and record["stopped"]["reason"] == "duration"
    assert record["report"]["analysis"]["verdict"] == "pass"
    assert record["faults_reverted"] and record["colours_cleared"]


def test_an_aborted_run_reverts_its_fault_and_clears_its_colours(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, duration_s=60.0)

    async def body(experiments: SliceExperiments) -> dict[str, Any] | None:
        experiment_id = experiments.start(spec, "tester")
        await asyncio.sleep(0.3)
        assert experiments.abort(experiment_id) and not experiments.abort(experiment_id + 1)
        record = await experiments.wait(experiment_id)
        assert experiments.slices.plan().colours == ()
        return record

    record, _, fault = run(tmp_path, Gateway(experiment_fails=False), body)
    assert record is not None and record["status"] == "aborted"
    assert record["stopped"]["reason"] == "abort" and record["faults_reverted"]
    assert len(fault.reverted) == 2


def test_a_run_left_running_by_a_dead_control_plane_is_interrupted_and_its_colours_cleared(
        tmp_path: Path) -> None:
    with Store(tmp_path / "state.db") as store:
        slices = TrafficSlices(store)
        slices.set_colours({"chaos": 0.1, "control": 0.1})
        store.add_record("slice_experiments", {"status": "running", "spec": SPEC.to_json(),
                                               "started_at": time.time()})
        manager = FaultManager(Catalogue([ColouredFault(name="error_rate")]), store)
        experiments = SliceExperiments(slices, manager, lambda: fleet(2), store)
        assert experiments.recent()[0]["status"] == "interrupted"
        assert slices.plan().colours == ()
