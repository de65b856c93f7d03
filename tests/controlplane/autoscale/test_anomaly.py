"""The anomaly source (controlplane.autoscale.anomaly): a clean seasonal series proposes nothing, a spike
proposes
+1 after three points and +2 after five, with a cooldown, an idle fleet waking is not an anomaly, and
the fit stays bounded."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import numpy as np
import pytest

from controlplane.autoscale.anomaly import AnomalyReading, AnomalySettings, AnomalyState, observe
from controlplane.autoscale.policies import Proposal

MONDAY_NOON_UTC = datetime(2026, 11, 30, 12, 0, tzinfo=UTC).timestamp()  # a Monday


# ---- anomaly source -----------------------------------------------------------------------------
def seasonal(t: int, rng: np.random.Generator) -> tuple[float, float]:
    return (20 + 8 * math.sin(2 * math.pi * t / 12) + rng.normal(0, 0.8),
            0.4 + 0.1 * math.sin(2 * math.pi * t / 12) + rng.normal(0, 0.02))


Points = list[tuple[float, float | None]] | list[tuple[float, float]]


def feed(state: AnomalyState, points: Points, *, start: int = 0,
         current: int = 2) -> list[tuple[Proposal | None, AnomalyReading]]:
    """Each point's proposal and reading, one tick every 5 s, each on the state the last one left."""
    out = []
    for i, (rate, ttft) in enumerate(points):
        proposal, reading, state = observe(state, (start + i) * 5.0, current, rate, ttft)
        out.append((proposal, reading))
    return out


def test_clean_seasonal_series_proposes_nothing() -> None:
    for seed in range(2):
        rng = np.random.default_rng(seed)
        state = AnomalyState(AnomalySettings(period=12, history=48))
        out = feed(state, [seasonal(t, rng) for t in range(160)])
        assert [p for p, _ in out if p is not None] == []
        assert max(r.consecutive for _, r in out) < 3


def spiked(points: list[tuple[float, float]], start: int, length: int) -> None:
    points[start:start + length] = [(r + 60, q + 1.5) for r, q in points[start:start + length]]


def test_a_spike_proposes_one_replica_after_three_points_and_two_after_five() -> None:
    rng = np.random.default_rng(7)
    state = AnomalyState(AnomalySettings(period=12, history=48))
    points = [seasonal(t, rng) for t in range(90)]
    spiked(points, 70, 6)
    out = feed(state, points)
    proposals = {i: p.replicas for i, (p, _) in enumerate(out) if p is not None}
    assert proposals == {72: 3, 73: 3, 74: 4, 75: 4}
    reading = out[72][1]
    assert reading.residual_rate > 40 and reading.score < reading.threshold and reading.z_rate > 3
    assert reading.as_dict()["consecutive"] == 3


def test_anomaly_cooldown_blocks_a_second_episode_then_lets_it_fire() -> None:
    rng = np.random.default_rng(3)
    state = AnomalyState(AnomalySettings(period=12, history=48, cooldown_s=300))
    points = [seasonal(t, rng) for t in range(150)]
    for start in (70, 90, 140):
        spiked(points, start, 3)
    out = feed(state, points)
    fired = [i for i, (p, _) in enumerate(out) if p is not None]
    episodes = [i for i in fired if i - 1 not in fired]
    assert episodes == [72, 142]  # 92 is 100 s after the first firing: inside the 300 s cooldown
    assert out[92][1].note == "anomalous, but in cooldown for 200s more"


def test_an_idle_fleets_first_requests_are_not_an_anomaly_but_a_burst_is() -> None:
    trickle: list[tuple[float, float | None]] = [(0.0, None)] * 70 + [(0.25, 0.3)] * 6
    out = feed(AnomalyState(AnomalySettings(period=12, history=48)), trickle)
    assert [p for p, _ in out if p is not None] == [] and out[-1][1].z_rate == pytest.approx(1.25, abs=0.01)
    burst: list[tuple[float, float | None]] = [(0.0, None)] * 70 + [(20.0, 0.3)] * 3
    out = feed(AnomalyState(AnomalySettings(period=12, history=48)), burst, current=1)
    assert out[-1][0] is not None and out[-1][0].replicas == 2


def test_anomaly_fit_is_bounded_and_the_forest_is_refit_only_every_k_ticks() -> None:
    rng = np.random.default_rng(1)
    state = AnomalyState(AnomalySettings(period=12, history=48, refit_every=10))
    # the forests themselves, kept alive: a freed forest's id() can be given to the next, and ids undercount
    forests = []
    for t in range(86):
        _, _, state = observe(state, t * 5.0, 2, *seasonal(t, rng))
        forests.append(state.forest)
    assert len(state.rates) == 48 and len(state.errors) <= 48
    scored = forests[60:]  # scoring starts after 3 periods of history and 2 periods of residuals
    assert len({id(forest) for forest in scored}) == math.ceil(len(scored) / 10)


def test_observing_a_point_leaves_the_state_it_was_given_as_it_was() -> None:
    rng = np.random.default_rng(7)
    points = [seasonal(t, rng) for t in range(74)]
    spiked(points, 70, 4)  # as in the test above: the fourth anomalous point proposes +1
    state = AnomalyState(AnomalySettings(period=12, history=48))
    for t, (rate, ttft) in enumerate(points[:-1]):
        _, _, state = observe(state, t * 5.0, 2, rate, ttft)
    before = (state.rates, state.errors, state.consecutive, state.fired_step, state.forest)
    first = observe(state, 73 * 5.0, 2, *points[-1])
    second = observe(state, 73 * 5.0, 2, *points[-1])
    assert (state.rates, state.errors, state.consecutive, state.fired_step, state.forest) == before
    assert first[:2] == second[:2] and first[0] is not None  # the same proposal from the same state
