"""Replicas sharing a host's cores (``SimSettings.host_cores``): steps stretch by busy replicas per core,
less the cores the host's other processes take per request arriving (``host_cpu_per_request_s``); replicas
measured under a CPU limit (``ReplicaProfile.cpu_limit``) want that share of a core, not a whole one."""

from __future__ import annotations

import dataclasses

import pytest

from controlplane.autoscale.profile import ReplicaProfile
from controlplane.sim.fleet import FleetSim
from controlplane.sim.settings import PolicySpec, SimSettings
from controlplane.sim.simulator import simulate
from controlplane.sim.trace import SimRequest

STEP = 0.01


def fixed() -> ReplicaProfile:
    """Every step takes ``STEP`` seconds, whatever it holds."""
    return ReplicaProfile(step_base_s=STEP, per_seq_s=0.0, per_prefill_token_s=0.0, per_context_token_s=0.0,
                          start_s=5.0)


def two_at_once() -> list[SimRequest]:
    return [SimRequest(0, 0.0, 100, 5), SimRequest(1, 0.0, 100, 5)]  # one on each of two replicas


def finishes(host_cores: int | None, cpu_per_request_s: float = 0.0,
             profile: ReplicaProfile | None = None) -> list[float | None]:
    sim = FleetSim(profile or fixed(), two_at_once(), initial_replicas=2, policy=None, tick_s=15.0,
                   host_cores=host_cores, host_cpu_per_request_s=cpu_per_request_s).run()
    assert [r.step for r in sim.replicas] == [5, 5]  # each replica served one request in 5 steps
    return [o.finish for o in sim.outcomes]


def test_two_busy_replicas_on_one_core_take_twice_as_long_as_on_two_cores() -> None:
    assert finishes(2) == pytest.approx([5 * STEP, 5 * STEP])
    assert finishes(1) == pytest.approx([10 * STEP, 10 * STEP])


def test_no_host_cores_is_a_core_per_replica() -> None:
    assert finishes(None) == finishes(2) == finishes(8)


def test_a_lone_busy_replica_is_not_slowed_by_idle_ones() -> None:
    sim = FleetSim(fixed(), [SimRequest(0, 0.0, 100, 5)], initial_replicas=3, policy=None, tick_s=15.0,
                   host_cores=1).run()
    assert sim.outcomes[0].finish == pytest.approx(5 * STEP)


def test_settings_carry_host_cores_to_the_fleet() -> None:
    shared = simulate(two_at_once(), PolicySpec.parse("static:2"), profile=fixed(),
                      settings=SimSettings(initial_replicas=2, host_cores=1))
    own = simulate(two_at_once(), PolicySpec.parse("static:2"), profile=fixed(),
                   settings=SimSettings(initial_replicas=2))
    assert shared.tpot_p95_s == pytest.approx(2 * STEP) and own.tpot_p95_s == pytest.approx(STEP)
    with pytest.raises(ValueError, match="host_cores"):
        SimSettings(host_cores=0)


# Two requests in the 6 s short window are 1/3 request/s: 3 core-seconds each take one core of the host.
TAKES_ONE_CORE = 3.0


def test_the_cores_other_processes_take_per_request_are_not_the_replicas() -> None:
    assert finishes(2, TAKES_ONE_CORE) == pytest.approx([10 * STEP, 10 * STEP])  # two busy on one core left
    assert finishes(3, TAKES_ONE_CORE) == finishes(2) == pytest.approx([5 * STEP, 5 * STEP])  # two left
    # however much they take, a quarter of the host stays the replicas': two busy on half a core
    assert finishes(2, 100 * TAKES_ONE_CORE) == pytest.approx([20 * STEP, 20 * STEP])
    assert finishes(None, TAKES_ONE_CORE) == finishes(None)  # replicas with cores of their own


def test_a_lone_busy_replica_has_what_the_other_processes_leave() -> None:
    sim = FleetSim(fixed(), [SimRequest(0, 0.0, 100, 5)], initial_replicas=2, policy=None, tick_s=15.0,
                   host_cores=1, host_cpu_per_request_s=3.0).run()  # 1/6 request/s x 3 s: half the core
    assert sim.outcomes[0].finish == pytest.approx(10 * STEP)


def test_settings_carry_the_other_processes_cpu_to_the_fleet() -> None:
    taken = simulate(two_at_once(), PolicySpec.parse("static:2"), profile=fixed(),
                     settings=SimSettings(initial_replicas=2, host_cores=2,
                                          host_cpu_per_request_s=TAKES_ONE_CORE))
    assert taken.tpot_p95_s == pytest.approx(2 * STEP)
    with pytest.raises(ValueError, match="host_cpu_per_request_s"):
        SimSettings(host_cpu_per_request_s=-1.0)


def test_limited_replicas_run_at_their_profile_while_their_limits_fit_the_cores() -> None:
    # measured under half a core each, two busy replicas fit one core: the profile's speed, as two
    # containers with 0.5-core limits run on one core; two 0.75-core replicas want 1.5 cores of one
    half, three_quarters = (dataclasses.replace(fixed(), cpu_limit=c) for c in (0.5, 0.75))
    assert finishes(1, profile=half) == pytest.approx([5 * STEP, 5 * STEP])
    assert finishes(1, profile=three_quarters) == pytest.approx([7.5 * STEP, 7.5 * STEP])
    # a limit over a core is a core (one torch thread), and no host_cores is a core per replica
    assert finishes(1, profile=dataclasses.replace(fixed(), cpu_limit=2.0)) == finishes(1)
    assert finishes(None, profile=half) == finishes(None)
    with pytest.raises(ValueError, match="cpu_limit"):
        dataclasses.replace(fixed(), cpu_limit=0.0)
