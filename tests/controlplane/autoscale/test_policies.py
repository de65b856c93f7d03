"""Every autoscaling rule on synthetic snapshots, with time passed in: no processes, no sleeps."""

from __future__ import annotations

import pytest

from controlplane.autoscale.policies import (
    Decision,
    History,
    MetricTarget,
    PanicState,
    PolicyConfig,
    Snapshot,
    applied,
    decide,
    target_tracking,
)

ONE = (MetricTarget("waiting_per_replica", 4.0),)
TWO = (MetricTarget("waiting_per_replica", 4.0), MetricTarget("kv_cache_usage", 0.8))


def snap(now: float = 0.0, *, current: int = 4, ready: int | None = None, waiting: float | None = 4.0,
         kv: float | None = 0.8, demand: float | None = None, capacity: float | None = None) -> Snapshot:
    return Snapshot(now, current, current if ready is None else ready, 0,
                    {"waiting_per_replica": waiting, "kv_cache_usage": kv}, demand, capacity)


def run(config: PolicyConfig, snapshots: list[Snapshot]) -> list[Decision]:
    history, state, out = History(config.scale_down_stabilization_s), PanicState(), []
    for s in snapshots:
        decision, state = decide(s, config, history.items, state)
        history = history.added(s.now, decision.recommendation)
        out.append(decision)
    return out


def first(snapshot: Snapshot, config: PolicyConfig) -> Decision:
    """A decision with no history and no panic state."""
    decision, _ = decide(snapshot, config, [], PanicState())
    return decision


def test_hpa_formula_scales_up_to_the_largest_metric_ratio() -> None:
    p = target_tracking(snap(waiting=8.0, kv=0.4), PolicyConfig(targets=TWO))
    assert p.replicas == 8 and "waiting_per_replica at 2.00x" in p.reason


def test_within_tolerance_nothing_changes_in_either_direction() -> None:
    config = PolicyConfig(targets=ONE, tolerance=0.1)
    assert target_tracking(snap(waiting=4.3), config).replicas == 4
    assert target_tracking(snap(waiting=3.7), config).replicas == 4
    assert target_tracking(snap(waiting=4.5), config).replicas == 5


def test_a_missing_metric_forbids_scale_down_but_not_scale_up() -> None:
    config = PolicyConfig(targets=TWO)
    down = target_tracking(snap(waiting=1.0, kv=None), config)
    assert down.replicas == 4 and "kv_cache_usage unknown" in down.reason
    assert target_tracking(snap(waiting=12.0, kv=None), config).replicas == 12


def test_not_ready_replicas_count_at_zero_for_scale_up_and_full_for_scale_down() -> None:
    config = PolicyConfig(targets=ONE)
    # 2 of 4 ready at 3x target: only the ready half is loaded, so 4 x 1.5 = 6, not 12.
    assert target_tracking(snap(waiting=12.0, ready=2), config).replicas == 6
    # 2 of 4 ready at a quarter of the target: the not-ready ones count as fully loaded.
    assert target_tracking(snap(waiting=1.0, ready=2), config).replicas == 3


def test_scale_down_waits_for_the_stabilization_window() -> None:
    config = PolicyConfig(targets=ONE, scale_down_stabilization_s=300, scale_down_max_step=10)
    busy = [snap(t, waiting=4.0) for t in range(0, 60, 5)]
    quiet = [snap(t, waiting=1.0) for t in range(60, 400, 5)]
    decisions = run(config, busy + quiet)
    first_down = next(s.now for s, d in zip(busy + quiet, decisions) if d.replicas < 4)
    assert first_down > 55 + 300 - 5  # the last busy recommendation has to leave the window
    held = decisions[len(busy)]
    assert held.replicas == 4 and any(c.startswith("stabilization") for c in held.clamps)


def test_rate_limits_bound_each_step_in_both_directions() -> None:
    config = PolicyConfig(targets=ONE, scale_up_max_step=2, scale_up_max_percent=25, scale_down_max_step=1,
                          scale_down_stabilization_s=0)
    up = first(snap(waiting=20.0), config)
    assert up.recommendation == 10 and up.replicas == 6 and "rate limit: 10 -> 6" in up.clamps
    down = first(snap(waiting=0.5), config)
    assert down.replicas == 3


def test_min_and_max_bound_the_result() -> None:
    config = PolicyConfig(targets=ONE, min_replicas=2, max_replicas=5, scale_up_max_step=10,
                          scale_down_stabilization_s=0, scale_down_max_step=10)
    assert first(snap(waiting=40.0), config).replicas == 5
    assert first(snap(waiting=0.0), config).replicas == 2


def test_panic_scales_to_demand_at_once_and_never_down_while_it_lasts() -> None:
    config = PolicyConfig(targets=ONE, max_replicas=20, panic_window_s=6, scale_up_max_step=20,
                          scale_down_stabilization_s=0, scale_down_max_step=10)
    burst, state = decide(snap(0, waiting=4.0, demand=100, capacity=8), config, [], PanicState())
    assert burst.panic and burst.replicas == 13 and state.until == 6  # ceil(100 / 8)
    calm, state = decide(snap(3, current=13, waiting=0.1, demand=5, capacity=8), config, [], state)
    assert calm.panic and calm.replicas == 13
    assert [(p.source, p.replicas) for p in calm.proposals] == [("target", 1), ("panic", 13)]
    later, state = decide(snap(7, current=13, waiting=0.1, demand=5, capacity=8), config, [], state)
    assert not later.panic and later.replicas < 13 and state.until is None


def test_a_scale_down_period_runs_from_the_last_applied_scale_down() -> None:
    config = PolicyConfig(targets=ONE, scale_down_stabilization_s=0, scale_down_period_s=60)
    down, state = decide(snap(0, waiting=1.0), config, [], PanicState())
    assert down.replicas == 3 and state == PanicState()  # decided, not applied: nothing remembered
    state = applied(state, current=4, replicas=3, now=0)
    held, _ = decide(snap(30, current=3, waiting=1.0), config, [], state)
    assert held.replicas == 3 and held.clamps[-1].startswith("scale-down period: 2 -> 3 (last scale-down 30s")
    assert applied(state, current=3, replicas=5, now=40) == state  # scaling up leaves the period running


def test_every_decision_explains_its_number() -> None:
    config = PolicyConfig(targets=ONE, scale_up_max_step=1, scale_up_max_percent=0)
    d = first(snap(waiting=8.0), config)
    assert [p.source for p in d.proposals] == ["target"] and "ceil(4 x 2.00) = 8" in d.proposals[0].reason
    assert d.replicas == 5 and d.clamps == ("rate limit: 8 -> 5",)


@pytest.mark.parametrize("bad", [{"min_replicas": 3, "max_replicas": 2}, {"tolerance": 1.0},
                                 {"panic_threshold": 1.0}, {"scale_up_max_step": 0}])
def test_bad_policy_values_are_refused_with_the_field_name(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError) as err:
        PolicyConfig(**bad)  # type: ignore[arg-type]
    assert next(iter(bad)).split("_")[0] in str(err.value)
