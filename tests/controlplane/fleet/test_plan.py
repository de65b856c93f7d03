"""The fleet's pure planning: from an observation and the desired state to the actions of one pass.

No backend, no store, no clock: each test writes down what was observed and asserts on the plan.
``test_reconcile.py`` drives the same rules through :class:`Fleet` on a simulated backend.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane.fleet.config import FleetConfig
from controlplane.fleet.plan import (
    Canary,
    CompleteRollout,
    Desired,
    Drain,
    Kill,
    MarkCrashed,
    MarkReady,
    MarkUnready,
    Observation,
    ObservedReplica,
    RecordProbe,
    Remove,
    ReportCrashLoop,
    Restart,
    RollBack,
    Rollout,
    Spawn,
    StepRollout,
    plan_pass,
    zone_targets,
)
from controlplane.replicas import ReplicaState

NOW = 1_000.0
READY, STARTING, CRASHED, DRAINING = (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.CRASHED,
                                      ReplicaState.DRAINING)


def replica(rid: str, state: ReplicaState = READY, *, started_at: float = 0.0, generation: int = 0,
            **observed: object) -> ObservedReplica:
    zone = rid.rsplit("-", 1)[0]
    base = ObservedReplica(rid, zone, 8100 + len(rid), "default" if generation == 0 else "v2", generation,
                           state, started_at, is_running=state is not CRASHED)
    return replace(base, **observed)  # type: ignore[arg-type]


def fleet(*replicas: ObservedReplica, now: float = NOW, **kw: object) -> Observation:
    return Observation(now, replicas, **kw)  # type: ignore[arg-type]


def desired(replicas: int = 3, rollout: Rollout | None = None) -> Desired:
    return Desired(replicas, "default", 0, rollout)


CONFIG = FleetConfig(restart_backoff_s=1.0, restart_backoff_max_s=8.0, crash_loop_restarts=3,
                     crash_loop_window_s=60.0, ready_timeout_s=30.0, drain_timeout_s=10.0,
                     rollout_observe_s=5.0, rollout_max_error_increase=0.05)
STEADY = (replica("az-a-1"), replica("az-b-1"), replica("az-c-1"))


def test_zone_targets_spread_replicas_evenly_first_zones_first() -> None:
    assert zone_targets(5, ["a", "b", "c"]) == {"a": 2, "b": 2, "c": 1}
    assert zone_targets(0, ["a"]) == {"a": 0}


def test_a_fleet_that_matches_its_desired_state_plans_nothing() -> None:
    plan = plan_pass(fleet(*STEADY), desired(), CONFIG)
    assert plan.actions == () and plan.desired == desired()


def test_an_empty_fleet_spawns_one_replica_per_zone() -> None:
    plan = plan_pass(fleet(), desired(), CONFIG)
    zones = ("az-a", "az-b", "az-c")
    assert plan.actions == tuple(Spawn(f"{z}-1", z, "default", 0, "scale up") for z in zones)


def test_scale_up_takes_the_first_free_id_in_each_zone() -> None:
    plan = plan_pass(fleet(replica("az-a-2"), replica("az-b-1"), replica("az-c-1")), desired(5), CONFIG)
    assert [(s.replica_id, s.zone) for s in plan.of(Spawn)] == [("az-a-1", "az-a"), ("az-b-2", "az-b")]


def test_scale_down_drains_unready_replicas_first_then_the_newest() -> None:
    observed = fleet(replica("az-a-1", started_at=1), replica("az-a-2", started_at=3),
                     replica("az-a-3", ReplicaState.UNREADY, started_at=2), replica("az-b-1"))
    plan = plan_pass(observed, desired(2), CONFIG)
    assert plan.actions == (Drain("az-a-3", "scale down"), Drain("az-a-2", "scale down"))


def test_a_replica_in_a_zone_no_longer_configured_is_drained() -> None:
    plan = plan_pass(fleet(*STEADY, replica("az-z-1")), desired(), CONFIG)
    assert plan.actions == (Drain("az-z-1", "zone removed"),)


def test_an_exited_replica_is_marked_crashed_with_a_doubling_backoff() -> None:
    earlier = (NOW - 30.0, NOW - 10.0)  # two recent crashes: the third waits 4 s
    crashed = replica("az-a-1", is_running=False, exit_status=-9, crash_times=earlier)
    plan = plan_pass(fleet(crashed, *STEADY[1:]), desired(), CONFIG)
    assert plan.actions[0] == MarkCrashed("az-a-1", -9, (*earlier, NOW), NOW + 4.0, 4.0)
    assert plan.actions[1] == ReportCrashLoop("az-a-1", 3, 60.0)
    assert not plan.of(Spawn)  # a crashed replica still counts towards its zone: restarted, not replaced


def test_crashes_older_than_the_window_do_not_count_towards_the_backoff() -> None:
    crashed = replica("az-a-1", is_running=False, crash_times=(NOW - 120.0, NOW - 90.0))
    [mark] = plan_pass(fleet(crashed, *STEADY[1:]), desired(), CONFIG).of(MarkCrashed)
    assert (mark.crash_times, mark.restart_in_s) == ((NOW,), 1.0)


def test_a_crashed_replica_restarts_once_its_backoff_has_elapsed() -> None:
    waiting = replica("az-a-1", CRASHED, restart_at=NOW + 0.5, restarts=2)
    assert plan_pass(fleet(waiting, *STEADY[1:]), desired(), CONFIG).actions == ()
    due = replace(waiting, restart_at=NOW)
    assert plan_pass(fleet(due, *STEADY[1:]), desired(), CONFIG).actions == (Restart("az-a-1", 3),)


@pytest.mark.parametrize("port_free, reserved", [(False, frozenset()), (True, frozenset({8106}))])
def test_a_replica_whose_port_is_taken_restarts_on_another_port(port_free: bool,
                                                                 reserved: frozenset[int]) -> None:
    due = replica("az-a-1", CRASHED, restart_at=NOW, port=8106, port_free=port_free)
    plan = plan_pass(fleet(due, *STEADY[1:], reserved_ports=reserved), desired(), CONFIG)
    assert plan.actions == (Restart("az-a-1", 1, move_port=True),)


def test_a_scale_down_sees_the_restarts_of_the_same_pass_as_starting_replicas() -> None:
    observed = fleet(replica("az-a-1", CRASHED, restart_at=NOW, started_at=1),
                     replica("az-a-2", started_at=5), replica("az-b-1"), replica("az-c-1"))
    assert plan_pass(observed, desired(3), CONFIG).actions == (Restart("az-a-1", 1),
                                                                Drain("az-a-1", "scale down"))


def test_a_starting_replica_that_passes_ready_is_marked_ready_with_its_start_up_time() -> None:
    starting = replica("az-a-1", STARTING, started_at=NOW - 2.5, is_ready=True, ready_failures=1)
    plan = plan_pass(fleet(starting, *STEADY[1:]), desired(), CONFIG)
    assert plan.actions == (RecordProbe("az-a-1", 0), MarkReady("az-a-1", 2.5))


def test_a_ready_replica_turns_unready_on_its_third_failed_probe_in_a_row() -> None:
    second = replica("az-a-1", is_ready=False, ready_failures=1)
    assert plan_pass(fleet(second, *STEADY[1:]), desired(), CONFIG).actions == (RecordProbe("az-a-1", 2),)
    third = replace(second, ready_failures=2)
    assert plan_pass(fleet(third, *STEADY[1:]), desired(), CONFIG).actions == (
        RecordProbe("az-a-1", 3), MarkUnready("az-a-1", 3))


def test_a_drained_replica_is_removed_once_it_exits_and_killed_when_it_overstays() -> None:
    exited = replica("az-a-2", DRAINING, is_running=False, drain_started=NOW - 1)
    lingering = replica("az-b-2", DRAINING, drain_started=NOW - 14)
    overdue = replica("az-c-2", DRAINING, drain_started=NOW - 16)
    plan = plan_pass(fleet(*STEADY, exited, lingering, overdue), desired(), CONFIG)
    assert plan.actions == (Remove("az-a-2", "exited after draining"), Kill("az-c-2", "drain timed out"),
                            Remove("az-c-2", "killed after its drain timed out"))


ROLLOUT = Rollout("v2", 1, "default", 0, started_at=NOW - 100)


def test_a_rollout_spawns_one_new_replica_in_the_zone_of_the_first_old_one() -> None:
    plan = plan_pass(fleet(*STEADY), desired(3, ROLLOUT), CONFIG)
    assert plan.actions == (Spawn("az-a-2", "az-a", "v2", 1, "rollout: replaces az-a-1"),
                            StepRollout("az-a-2", "az-a-1"))
    assert plan.desired.rollout == replace(ROLLOUT, surge="az-a-2", surge_started=NOW)


def test_a_rollout_does_not_scale_while_it_runs() -> None:
    plan = plan_pass(fleet(*STEADY), desired(6, ROLLOUT), CONFIG)
    assert [s.reason for s in plan.of(Spawn)] == ["rollout: replaces az-a-1"]


def test_a_new_replica_that_served_long_enough_replaces_the_old_one_in_its_zone() -> None:
    surge = replica("az-a-2", generation=1)
    watched = replace(ROLLOUT, surge="az-a-2", surge_started=NOW - 20, surge_ready_at=NOW - 5)
    plan = plan_pass(fleet(*STEADY, surge), desired(3, watched), CONFIG)
    assert plan.actions == (Drain("az-a-1", "replaced by az-a-2"),)
    assert plan.desired.rollout == replace(watched, surge=None, surge_ready_at=None)


def test_a_new_replica_is_watched_from_the_pass_it_is_first_seen_ready() -> None:
    watched = replace(ROLLOUT, surge="az-a-2", surge_started=NOW - 20)
    plan = plan_pass(fleet(*STEADY, replica("az-a-2", generation=1)), desired(3, watched), CONFIG)
    assert plan.actions == () and plan.desired.rollout == replace(watched, surge_ready_at=NOW)


def test_a_rollout_rolls_back_when_the_new_replica_errors_more_than_the_old_ones() -> None:
    watched = replace(ROLLOUT, surge="az-a-2", surge_started=NOW - 20, surge_ready_at=NOW - 1)
    rates = {"az-a-1": 0.01, "az-b-1": 0.0, "az-c-1": 0.02, "az-a-2": 0.30}
    plan = plan_pass(fleet(*STEADY, replica("az-a-2", generation=1), error_rates=rates),
                     desired(3, watched), CONFIG)
    assert plan.actions == (Drain("az-a-2", "rollback"), RollBack(
        "v2", "new replica errors on 30.0% of requests, the old ones on 2.0%"))
    assert plan.desired == desired(3)


@pytest.mark.parametrize("surge, reason", [
    (replica("az-a-2", CRASHED, generation=1, restart_at=NOW + 5), "new replica crashed"),
    (replica("az-a-2", STARTING, generation=1), "new replica not ready in time"),
])
def test_a_rollout_rolls_back_when_the_new_replica_fails_to_come_up(surge: ObservedReplica,
                                                                    reason: str) -> None:
    watched = replace(ROLLOUT, surge="az-a-2", surge_started=NOW - 31)
    plan = plan_pass(fleet(*STEADY, surge), desired(3, watched), CONFIG)
    assert plan.of(RollBack) == [RollBack("v2", reason)] and plan.of(Drain) == [Drain("az-a-2", "rollback")]
    assert plan.desired.rollout is None


def test_a_rollout_completes_when_no_old_replica_is_left_and_the_fleet_then_converges() -> None:
    new = (replica("az-a-2", generation=1), replica("az-b-2", generation=1))
    plan = plan_pass(fleet(*new), desired(3, ROLLOUT), CONFIG)
    assert plan.desired == Desired(3, "v2", 1)
    assert plan.actions == (CompleteRollout("v2", 1), Spawn("az-c-1", "az-c", "v2", 1, "scale up"))


def test_desired_replicas_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="replicas: must be >= 0"):
        Desired(-1, "default", 0)


# ---- a zone without nodes (a backend that places replicas reports it) -------------------------------
SPILL = replace(CONFIG, on_node_loss="spill")


def test_a_lost_zone_keeps_its_replica_waiting_in_the_zone_by_default() -> None:
    lost = replica("az-b-1", CRASHED, restart_at=NOW - 1)
    plan = plan_pass(fleet(replica("az-a-1"), lost, replica("az-c-1"), zones_down=frozenset({"az-b"})),
                     desired(), CONFIG)
    assert plan.of(Restart) == [Restart("az-b-1", 1)]  # placed again in az-b: it waits there for a node
    assert plan.of(Spawn) == [] and plan.of(Drain) == []


def test_spill_re_places_a_lost_zones_replica_in_a_zone_with_nodes() -> None:
    lost = replica("az-b-1", CRASHED, restart_at=NOW - 1)
    plan = plan_pass(fleet(replica("az-a-1"), lost, replica("az-c-1"), zones_down=frozenset({"az-b"})),
                     desired(), SPILL)
    assert plan.of(Restart) == []  # not where no node is
    assert [(s.zone, s.reason) for s in plan.of(Spawn)] == [("az-a", "spilled from a zone without nodes")]
    assert plan.of(Drain) == [Drain("az-b-1", "zone has no node")]
    assert plan.of(Remove) == [Remove("az-b-1", "exited after draining")]  # nothing ran: gone at once


def test_spilled_replicas_move_back_when_the_zone_has_a_node_again() -> None:
    spilled = (replica("az-a-1", started_at=1.0), replica("az-a-2", started_at=2.0), replica("az-c-1"))
    plan = plan_pass(fleet(*spilled), desired(), SPILL)
    assert [s.zone for s in plan.of(Spawn)] == ["az-b"]
    assert plan.of(Drain) == [Drain("az-a-2", "scale down")]  # the newest of the zone that has one extra


def test_spill_with_every_zone_down_waits_everywhere() -> None:
    down = frozenset({"az-a", "az-b", "az-c"})
    lost = tuple(replica(f"{z}-1", CRASHED, restart_at=NOW - 1) for z in ("az-a", "az-b", "az-c"))
    plan = plan_pass(fleet(*lost, zones_down=down), desired(), SPILL)
    assert plan.of(Drain) == [] and plan.of(Spawn) == []  # nowhere to spill to
    assert plan.of(Restart) == []  # and a restart where no node is would only wait: spill waits too


# ---- a canary beside the fleet ---------------------------------------------------------------
CANARY = Canary("v2", "/models/v2")


def test_a_canary_spawns_its_replica_beside_the_fleet_without_touching_the_stable_ones() -> None:
    plan = plan_pass(fleet(*STEADY), Desired(3, "default", 0, canary=CANARY), CONFIG)
    assert plan.actions == (Spawn("az-a-2", "az-a", "/models/v2", 0, "canary v2", "v2"),)


def test_canary_replicas_count_neither_for_the_fleet_nor_for_a_rolling_update() -> None:
    canary = replica("az-a-2", version="v2")
    steady = plan_pass(fleet(*STEADY, canary), Desired(3, "default", 0, canary=CANARY), CONFIG)
    rolling = plan_pass(fleet(*STEADY, canary), Desired(3, "default", 0, ROLLOUT, CANARY), CONFIG)
    assert steady.actions == ()  # 3 stable replicas and the canary's one: nothing to scale
    assert rolling.of(StepRollout) == [StepRollout("az-a-3", "az-a-1")]  # the canary is not replaced
    assert rolling.of(Drain) == []


def test_when_the_canary_ends_its_replicas_drain_and_the_fleet_is_untouched() -> None:
    canary = replica("az-a-2", version="v2")
    plan = plan_pass(fleet(*STEADY, canary), desired(3), CONFIG)
    assert plan.actions == (Drain("az-a-2", "canary ended"),)


def test_a_crashed_canary_replica_is_restarted_not_replaced() -> None:
    crashed = replica("az-a-2", CRASHED, version="v2", restart_at=NOW - 1)
    plan = plan_pass(fleet(*STEADY, crashed), Desired(3, "default", 0, canary=CANARY), CONFIG)
    assert [type(a).__name__ for a in plan.actions] == ["Restart"]


def test_a_canary_needs_a_version_and_a_replica() -> None:
    with pytest.raises(ValueError, match="version"):
        Canary("", "m")
    with pytest.raises(ValueError, match="replicas"):
        Canary("v2", "m", 0)
