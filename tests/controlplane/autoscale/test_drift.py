"""Profile drift: the replicas' engine time against what their profile predicts for the same steps, from the
replicas' busy-time and step-work counters (``controlplane.autoscale.drift``), in each decision record, on
the control plane's metrics page and in the console."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.autoscale.drift import (
    ENGINE_BUSY,
    ENGINE_STEP_CPU,
    ENGINE_STEP_RUNQUEUE,
    ENGINE_TURN,
    STEP_WORK,
    ProfileDrift,
    drift_from,
    predicted_seconds,
)
from controlplane.autoscale.profile import ReplicaProfile
from controlplane.store.database import Store
from tests.controlplane.conftest import FakeClock

from .test_loop import PROFILE, FixedTelemetry, RecordingFleet, busy_telemetry, endpoint, make, observe

# Costs in powers of two, so that predictions come out exact.
STEPS = ReplicaProfile(step_base_s=2.0**-7, per_seq_s=2.0**-10, per_prefill_token_s=2.0**-12,
                       per_context_token_s=2.0**-16, per_prefill_pair_s=2.0**-20, start_s=1.0)


def work(steps: float, decode: float = 0, prefill: float = 0, context: float = 0,
         pairs: float = 0) -> dict[str, float]:
    return {"steps": steps, "decode_sequences": decode, "prefill_tokens": prefill, "context_tokens": context,
            "prefill_pairs": pairs}


def test_the_prediction_is_the_profiles_step_time_summed_over_the_steps() -> None:
    steps = [dict(num_decode=16, num_prefill_tokens=0, context_tokens=16 * 512, prefill_pairs=0),
             dict(num_decode=4, num_prefill_tokens=256, context_tokens=4 * 300, prefill_pairs=256 * 257 // 2),
             dict(num_decode=1, num_prefill_tokens=0, context_tokens=40, prefill_pairs=0)]
    summed = work(3, 21, 256, 16 * 512 + 4 * 300 + 40, 256 * 257 // 2)
    assert predicted_seconds(STEPS, summed) == pytest.approx(sum(STEPS.step_time(**s) for s in steps))


def test_drift_is_busy_over_predicted_fleet_wide_and_per_replica_and_names_a_stale_profile() -> None:
    # r1 runs on its profile; r2 takes 1.5x the time its steps should
    busy = {"r1": 0.5, "r2": 0.75}
    per_replica = {"r1": work(64), "r2": work(64)}  # 64 steps/s x 2^-7 s = 0.5 engine s/s predicted each
    drift = drift_from(STEPS, busy, per_replica)
    assert drift is not None
    assert drift.replicas == {"r1": 1.0, "r2": 1.5}
    assert drift.ratio == pytest.approx(1.25) and not drift.is_stale and drift.note() is None

    slow = drift_from(STEPS, {"r1": 0.65}, per_replica)
    assert slow is not None and slow.is_stale
    note = slow.note()
    assert note is not None
    assert note.startswith("profile drift 1.30: the replicas ran slower than their profile")
    assert "controlplane calibrate" in note
    fast = ProfileDrift(0.3, 0.5)
    assert fast.is_stale and "faster" in (fast.note() or "")
    assert drift_from(STEPS, {"r1": 0.5}, {}) is None  # no work counters: nothing to judge by
    assert drift is not None and drift.on_cpu is None and "on_cpu" not in drift.as_dict()


def test_the_share_on_a_core_takes_waiting_for_cores_out_of_the_drift() -> None:
    """r1 and r2 both take 1.5x their predicted time. r1's engine ran on a core the whole of its steps
    (it is slower on a core: a slower host, or a profile from a faster day); r2 ran on one for two thirds
    of them and waited for a core the rest (other processes on its cores): on a core it holds the profile."""
    per_replica = {"r1": work(64), "r2": work(64)}  # 0.5 engine s/s predicted each
    busy, turn = {"r1": 0.75, "r2": 0.75}, {"r1": 0.0625, "r2": 0.0625}  # steps: 0.6875 s/s each
    alone = drift_from(STEPS, {"r1": 0.75}, per_replica, step_cpu={"r1": 0.6875}, turn=turn)
    assert alone is not None and alone.ratio == 1.5 and alone.on_cpu == 1.0 and alone.cpu_ratio == 1.5
    note = alone.note() or ""
    assert note.startswith("profile drift 1.50") and "waited" not in note

    waiting = drift_from(STEPS, {"r2": 0.75}, per_replica, step_cpu={"r2": 0.6875 * 2 / 3}, turn=turn)
    assert waiting is not None and waiting.ratio == 1.5
    assert waiting.on_cpu == pytest.approx(2 / 3) and waiting.cpu_ratio == pytest.approx(1.0)
    assert ("the engines ran on a core 67% of their steps' time and waited for one or for the interpreter "
            "lock the rest, 1.00x the profile on a core") in (waiting.note() or "")
    assert waiting.waiting_core is None and waiting.waiting_lock is None  # no run-queue counter

    both = drift_from(STEPS, busy, per_replica, step_cpu={"r1": 0.6875, "r2": 0.6875 * 2 / 3}, turn=turn)
    assert both is not None and both.on_cpu == pytest.approx(5 / 6)
    assert both.as_dict()["on_cpu"] == 0.8333
    # a replica without the CPU counter (an older build) leaves the share to those that have it
    mixed = drift_from(STEPS, busy, per_replica, step_cpu={"r2": 0.6875 * 2 / 3}, turn=turn)
    assert mixed is not None and mixed.on_cpu == pytest.approx(2 / 3)


def test_the_run_queue_splits_the_wait_into_cores_and_the_interpreter_lock() -> None:
    """r2 ran on a core two thirds of its steps' time; of the third it did not, it waited for a core a
    quarter (its run delay: other processes on its cores) and slept the rest, on the lock its HTTP server
    held. More cores would give back the quarter, not the rest."""
    per_replica = {"r1": work(64), "r2": work(64)}
    turn = {"r1": 0.0625, "r2": 0.0625}  # steps: 0.6875 s/s each
    split = drift_from(STEPS, {"r2": 0.75}, per_replica, step_cpu={"r2": 0.6875 * 2 / 3}, turn=turn,
                       runqueue={"r2": 0.6875 / 12})
    assert split is not None and split.ratio == 1.5
    assert split.on_cpu == pytest.approx(2 / 3) and split.waiting_core == pytest.approx(1 / 12)
    assert split.waiting_lock == pytest.approx(1 / 4)
    assert ("the engines ran on a core 67% of their steps' time, waited for one 8% (other processes or "
            "replicas on these cores) and for the interpreter lock 25% (their own HTTP servers), 1.00x the "
            "profile on a core") in (split.note() or "")
    assert split.as_dict()["waiting_core"] == 0.0833
    # the share waiting for a core is over the replicas that count it: r1 (an older build) does not
    both = drift_from(STEPS, {"r1": 0.75, "r2": 0.75}, per_replica,
                      step_cpu={"r1": 0.6875, "r2": 0.6875 * 2 / 3}, turn=turn, runqueue={"r2": 0.6875 / 12})
    assert both is not None and both.on_cpu == pytest.approx(5 / 6)
    assert both.waiting_core == pytest.approx(1 / 12)


def drifting_telemetry(busy: dict[str, float]) -> FixedTelemetry:
    """``busy_telemetry`` plus engine counters: each replica ran 32 steps/s of 2^-5 s by ``PROFILE``
    (1 engine second per second predicted)."""
    telemetry = busy_telemetry()
    telemetry.rate_values[ENGINE_BUSY] = {(r,): v for r, v in busy.items()}
    telemetry.rate_values[STEP_WORK] = {(r, term): (32.0 if term == "steps" else 0.0)
                                  for r in ("r1", "r2") for term in work(0)}
    return telemetry


def test_the_observation_judges_only_replicas_busy_enough_and_notes_a_stale_profile() -> None:
    eps = [endpoint("r1"), endpoint("r2")]
    o = observe(drifting_telemetry({"r1": 1.4, "r2": 0.02}), eps, 2)  # r2: 2% busy, too few steps
    assert o.drift is not None and o.drift.replicas == {"r1": pytest.approx(1.4)}
    assert any(n.startswith("profile drift 1.40: the replicas ran slower") for n in o.notes)
    assert o.drift.on_cpu is None  # replicas that do not count their steps' CPU time

    counted = drifting_telemetry({"r1": 1.4, "r2": 0.02})
    counted.rate_values[ENGINE_TURN] = {("r1",): 0.4, ("r2",): 0.0}
    counted.rate_values[ENGINE_STEP_CPU] = {("r1",): 0.7, ("r2",): 0.02}
    counted.rate_values[ENGINE_STEP_RUNQUEUE] = {("r1",): 0.1, ("r2",): 0.0}
    o = observe(counted, eps, 2)
    assert o.drift is not None and o.drift.on_cpu == pytest.approx(0.7)  # r1 alone: 0.7 of its 1.0 step s
    assert o.drift.waiting_core == pytest.approx(0.1)
    assert any("ran on a core 70% of their steps' time, waited for one 10%" in n and "lock 20%" in n
               for n in o.notes)

    idle = observe(drifting_telemetry({"r1": 0.01, "r2": 0.02}), eps, 2)
    assert idle.drift is None and not any("drift" in n for n in idle.notes)
    assert observe(busy_telemetry(), eps, 2).drift is None  # replicas without the counters


def test_the_decision_record_carries_the_drift_fleet_wide_and_per_replica(store: Store,
                                                                           clock: FakeClock) -> None:
    fleet = RecordingFleet(2, [endpoint("r1"), endpoint("r2")])
    scaler = make(store, clock, fleet, drifting_telemetry({"r1": 1.2, "r2": 1.0}))
    record = asyncio.run(scaler.tick())
    assert record is not None
    assert record["inputs"]["profile_drift"] == {
        "ratio": 1.1, "stale": False, "busy_s_per_s": 2.2, "predicted_s_per_s": 2.0,
        "replicas": {"r1": 1.2, "r2": 1.0}}
    assert PROFILE.step_base_s == 2.0**-5  # what the telemetry above was written for
