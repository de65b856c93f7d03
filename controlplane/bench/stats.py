"""Statistics of ``python -m controlplane.bench gateway``: percentiles, and how far one run can be trusted.

The requests of a run are not independent draws: a closed loop of C streams keeps its streams in step
for a while, so neighbours in time share their queueing. The interval of :func:`added_interval` therefore
resamples whole rounds (a round is max(50, 4 C) consecutive requests on one route), not requests: what
varies from round to round is what would vary from run to run.

The rounds alternate in ABBA order (direct, gateway, gateway, direct, ...), so the k-th round of each route
are neighbours in time: rounds 0 and 1, 3 and 2, 4 and 5. The resampling unit is that pair, as in any
crossover design: a slow swing of the machine moves both rounds of a pair alike and falls out of their
difference, where drawing each route's rounds on their own would count it twice. In the runs of 2026-12-05
the medians of a pair's two rounds correlated at 0.4-0.6 at 16 and 64 streams, and pairing narrowed the
p50 interval at 64 streams by a quarter to a third.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 20261201  # fixed: the same samples give the same interval
MIN_ROUNDS = 8  # per route, for an interval at all


@dataclass(slots=True, frozen=True)
class Percentiles:
    """p50 and p99 in seconds (NaN for no values); differences of two are still Percentiles."""

    p50: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls(math.nan, math.nan)
        p50, p99 = np.percentile(np.asarray(values, dtype=float), [50, 99])
        return cls(float(p50), float(p99))

    def minus(self, other: Percentiles) -> Percentiles:
        return Percentiles(self.p50 - other.p50, self.p99 - other.p99)


@dataclass(slots=True, frozen=True)
class Interval:
    """A confidence interval, in seconds (NaN bounds: too few rounds to say)."""

    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(slots=True, frozen=True)
class AddedIntervals:
    p50: Interval
    p99: Interval


NO_INTERVAL = Interval(math.nan, math.nan)


def added_interval(direct_rounds: Sequence[Sequence[float]], gateway_rounds: Sequence[Sequence[float]], *,
                   resamples: int = RESAMPLES, confidence: float = CONFIDENCE,
                   seed: int = SEED) -> AddedIntervals:
    """Bootstrap intervals of (gateway percentile - direct percentile) at p50 and p99. Each route's rounds
    come in run order; the k-th of each form a pair (neighbours in an ABBA run), and a round without a
    partner (one route ran one more) is a unit of its own. Each resample draws as many units as there are,
    with replacement, pools each route's values and takes the percentiles. Needs ``MIN_ROUNDS`` non-empty
    rounds per route: a bootstrap over fewer draws too narrow an interval to judge a target by."""
    direct = [np.asarray(r, dtype=float) for r in direct_rounds if len(r)]
    gateway = [np.asarray(r, dtype=float) for r in gateway_rounds if len(r)]
    if len(direct) < MIN_ROUNDS or len(gateway) < MIN_ROUNDS:
        return AddedIntervals(NO_INTERVAL, NO_INTERVAL)
    empty = np.empty(0)
    units = [(d if d is not None else empty, g if g is not None else empty)
             for d, g in itertools.zip_longest(direct, gateway)]
    rng = np.random.default_rng(seed)
    diffs = np.empty((resamples, 2))
    for i in range(resamples):
        picked = [units[k] for k in rng.integers(0, len(units), size=len(units))]
        d = _percentiles(np.concatenate([u[0] for u in picked]))
        g = _percentiles(np.concatenate([u[1] for u in picked]))
        diffs[i] = g - d
    tail = (1 - confidence) / 2 * 100
    (p50_low, p99_low), (p50_high, p99_high) = np.nanpercentile(diffs, [tail, 100 - tail], axis=0)
    return AddedIntervals(Interval(float(p50_low), float(p50_high)),
                          Interval(float(p99_low), float(p99_high)))


def _percentiles(values: np.ndarray) -> np.ndarray:
    """p50 and p99 of one resample's pooled values (NaN when it drew none of a route's rounds)."""
    if not len(values):
        return np.full(2, np.nan)
    found: np.ndarray = np.percentile(values, [50, 99])
    return found
