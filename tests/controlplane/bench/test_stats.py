"""The gateway benchmark's statistics: percentiles, and the round-resampling interval of an added latency."""

from __future__ import annotations

import math

import numpy as np

from controlplane.bench.stats import MIN_ROUNDS, Interval, Percentiles, added_interval


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
    direct = _rounds(rng, count=MIN_ROUNDS, size=50, centre=0.02, spread=0.002, round_spread=0.001)
    gateway = _rounds(rng, count=MIN_ROUNDS, size=50, centre=0.02, spread=0.002, round_spread=0.001)
    assert added_interval(direct, gateway) == added_interval(direct, gateway)
    assert not math.isnan(added_interval(direct, gateway).p99.high)
    none = added_interval(direct[:MIN_ROUNDS - 1], gateway)  # a bootstrap over a few rounds is too narrow
    assert math.isnan(none.p50.low) and math.isnan(none.p99.high)
    assert math.isnan(added_interval(direct, [*gateway[:-1], []]).p50.low)  # empty rounds do not count


def test_a_swing_both_routes_share_falls_out_of_the_pairs_of_neighbouring_rounds() -> None:
    """The k-th round of each route ran next to each other (ABBA): a machine swing moves both. Resampled by
    pairs, the swing cancels; the same rounds with the pairs broken give a wider interval."""
    rng = np.random.default_rng(4)
    swings = rng.normal(0, 0.003, 16)
    direct = [list(rng.normal(0.040 + s, 0.002, 100)) for s in swings]
    gateway = [list(rng.normal(0.041 + s, 0.002, 100)) for s in swings]
    paired = added_interval(direct, gateway, resamples=500).p50
    assert paired.contains(0.001) and not paired.contains(0.0)
    broken = added_interval(direct, gateway[1:] + gateway[:1], resamples=500).p50
    assert broken.contains(0.0)
    assert broken.high - broken.low > 3 * (paired.high - paired.low)


def test_a_route_with_one_more_round_keeps_it_as_a_unit_of_its_own() -> None:
    rng = np.random.default_rng(5)
    direct = _rounds(rng, count=MIN_ROUNDS + 1, size=50, centre=0.02, spread=0.002, round_spread=0.0)
    gateway = _rounds(rng, count=MIN_ROUNDS, size=50, centre=0.02, spread=0.002, round_spread=0.0)
    interval = added_interval(direct, gateway, resamples=500)
    assert interval.p50.contains(0.0) and interval.p99.high - interval.p99.low < 0.01
