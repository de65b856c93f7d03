"""rate() and histogram_quantile() as Prometheus computes them, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from controlplane.telemetry.scraper import extrapolated_rate, histogram_quantile

INF = math.inf


# ---- rate ---------------------------------------------------------------------------------------------
def test_rate_of_a_steady_counter_covering_the_window_is_its_slope() -> None:
    points = [(0.0, 0.0), (15.0, 15.0), (30.0, 30.0), (45.0, 45.0), (60.0, 60.0)]
    assert extrapolated_rate(points, start=0, end=60) == pytest.approx(1.0)


def test_counter_reset_adds_back_the_value_before_the_drop() -> None:
    # 10 -> 20, restart, 5 -> 15: increase = (15 - 10) + 20 = 25 over a 30 s window fully covered.
    points = [(0.0, 10.0), (10.0, 20.0), (20.0, 5.0), (30.0, 15.0)]
    assert extrapolated_rate(points, start=0, end=30) == pytest.approx(25 / 30)


def test_two_resets_in_one_window_are_both_counted() -> None:
    # 0 -> 8, reset to 2, -> 6, reset to 1: increase = (1 - 0) + 8 + 6 = 15.
    points = [(0.0, 0.0), (10.0, 8.0), (20.0, 2.0), (30.0, 6.0), (40.0, 1.0)]
    assert extrapolated_rate(points, start=0, end=40) == pytest.approx(15 / 40)


def test_rate_extrapolates_by_half_a_spacing_when_samples_stop_short_of_an_edge() -> None:
    # Samples 5..45 s every 10 s, +10 each, window [0, 60]: increase 40 over 40 s sampled.
    # Start gap 5 s < 1.1 x 10 s: extend by 5 s. End gap 15 s >= 11 s: extend by half a spacing, 5 s.
    points = [(5.0, 100.0), (15.0, 110.0), (25.0, 120.0), (35.0, 130.0), (45.0, 140.0)]
    assert extrapolated_rate(points, start=0, end=60) == pytest.approx(40 * (50 / 40) / 60)


def test_rate_never_extrapolates_a_counter_below_zero() -> None:
    # 1, 11, 21 at 10, 20, 30 s, window [0, 30]: the counter was 0 at 9 s, so the start extends by 1 s only.
    points = [(10.0, 1.0), (20.0, 11.0), (30.0, 21.0)]
    assert extrapolated_rate(points, start=0, end=30) == pytest.approx(20 * (21 / 20) / 30)


def test_flat_counter_has_zero_rate() -> None:
    assert extrapolated_rate([(0.0, 7.0), (10.0, 7.0)], start=0, end=10) == 0.0


def test_rate_needs_two_samples() -> None:
    assert extrapolated_rate([], start=0, end=30) is None
    assert extrapolated_rate([(10.0, 3.0)], start=0, end=30) is None


# ---- histogram_quantile ---------------------------------------------------------------------------------
BUCKETS = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]


@pytest.mark.parametrize(("q", "expected"), [
    (0.5, 0.1 + 0.4 * (10 / 20)),  # rank 20 falls in (0.1, 0.5] holding 20, 10 into it
    (0.99, 0.5 + 0.5 * (9.6 / 10)),  # rank 39.6 in (0.5, 1], 9.6 of its 10
    (0.25, 0.1 * 1.0),  # rank 10: the top of the first bucket
    (0.1, 0.1 * (4 / 10)),  # the first bucket starts at 0
])
def test_quantile_interpolates_linearly_inside_the_bucket(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_rank_in_the_inf_bucket_answers_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.9, [(0.1, 10.0), (0.5, 20.0), (INF, 40.0)]) == 0.5


def test_empty_low_buckets_are_skipped() -> None:
    buckets = [(0.1, 0.0), (0.5, 0.0), (1.0, 10.0), (INF, 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.75)


def test_bucket_order_does_not_matter() -> None:
    assert histogram_quantile(0.5, list(reversed(BUCKETS))) == pytest.approx(0.3)


def test_non_monotonic_bucket_rates_are_raised_to_the_running_maximum() -> None:
    # 10, 8, 20, 20 reads as 10, 10, 20, 20: rank 10 is the top of the first bucket.
    assert histogram_quantile(0.5, [(0.1, 10.0), (0.5, 8.0), (1.0, 20.0), (INF, 20.0)]) == pytest.approx(0.1)


def test_buckets_with_the_same_bound_are_added() -> None:
    halves = [(0.1, 5.0), (0.1, 5.0), (0.5, 15.0), (0.5, 15.0), (1.0, 40.0), (INF, 40.0)]
    assert histogram_quantile(0.5, halves) == pytest.approx(0.3)


def test_lowest_bucket_with_a_negative_bound_answers_that_bound() -> None:
    assert histogram_quantile(0.1, [(-1.0, 5.0), (INF, 10.0)]) == -1.0


@pytest.mark.parametrize("buckets", [
    [(0.1, 0.0), (INF, 0.0)],  # no observations
    [(0.1, 3.0), (0.5, 5.0)],  # no +Inf bucket
    [(INF, 5.0)],  # only +Inf
    [],
])
def test_undefined_quantiles_are_nan(buckets: list[tuple[float, float]]) -> None:
    assert math.isnan(histogram_quantile(0.5, buckets))


def test_quantile_outside_zero_one_is_infinite_like_prometheus() -> None:
    assert histogram_quantile(-0.1, BUCKETS) == -INF
    assert histogram_quantile(1.1, BUCKETS) == INF
    assert math.isnan(histogram_quantile(math.nan, BUCKETS))
