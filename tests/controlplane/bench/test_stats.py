"""The gateway benchmark's statistics: percentiles, and the round-resampling interval of an added latency."""

from __future__ import annotations

import math

import numpy as np

from controlplane.bench.stats import Interval, Percentiles, added_interval


def _rounds(rng: np.random.Generator, *, count: int, size: int, centre: float, spread: float,
            round_spread: float) -> list[list[float]]:
    """Rounds whose level moves by ``round_spread`` from round to round, as a closed loop's do."""
    return [list(rng.normal(centre + rng.normal(0, round_spread), spread, size)) for _ in range(count)]


def test_percentiles_and_their_difference() -> None:
    values = [float(v) for v in range(1, 101)]
    p = Percentiles.of(values)
    assert p.p50 == 50.5 and math.isclose(p.p99, 99.01)
    assert math.isnan(Percentiles.of([]).p50) and math.isnan(Percentiles.of([]).p99)  # no values
    assert Percentiles(3.0, 9.0).minus(Percentiles(1.0, 4.0)) == Percentiles(2.0, 5.0)


def test_an_added_millisecond_lies_inside_the_interval_and_zero_outside() -> None:
    rng = np.random.default_rng(1)
    direct = _rounds(rng, count=16, size=200, centre=0.040, spread=0.005, round_spread=0.0003)
    gateway = _rounds(rng, count=16, size=200, centre=0.041, spread=0.005, round_spread=0.0003)
    interval = added_interval(direct, gateway, resamples=500).p50
    assert interval.contains(0.001)
    assert not interval.contains(0.0)
    assert interval.high - interval.low < 0.001


def test_the_interval_widens_when_rounds_drift_though_requests_do_not_change() -> None:
    """The same number of requests, but rounds whose levels wander: the interval must say so (resampling
    single requests would not)."""
    rng = np.random.default_rng(2)

    def interval(round_spread: float) -> Interval:
        routes = [_rounds(rng, count=16, size=200, centre=0.040, spread=0.005, round_spread=round_spread)
                  for _ in range(2)]
        return added_interval(*routes, resamples=500).p50

    steady, drifting = interval(0.0), interval(0.003)
    assert drifting.contains(0.0)
    assert drifting.high - drifting.low > 3 * (steady.high - steady.low)


def test_the_same_samples_give_the_same_interval_and_too_few_rounds_give_none() -> None:
    rng = np.random.default_rng(3)
    direct = _rounds(rng, count=4, size=50, centre=0.02, spread=0.002, round_spread=0.001)
    gateway = _rounds(rng, count=4, size=50, centre=0.02, spread=0.002, round_spread=0.001)
    assert added_interval(direct, gateway) == added_interval(direct, gateway)
    none = added_interval(direct[:1], gateway)
    assert math.isnan(none.p50.low) and math.isnan(none.p99.high)
    assert math.isnan(added_interval(direct, [[], []]).p50.low)  # empty rounds do not count
