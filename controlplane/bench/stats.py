"""Statistics of ``python -m controlplane.bench gateway``: percentiles, and how far one run can be trusted.

The requests of a run are not independent draws: a closed loop of C streams keeps its streams in step
for a while, so neighbours in time share their queueing. The interval of :func:`added_interval` therefore
resamples whole rounds (a round is max(50, 4 C) consecutive requests on one route), not requests: what
varies from round to round is what would vary from run to run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 20261201  # fixed: the same samples give the same interval


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
    """Bootstrap intervals of (gateway percentile - direct percentile) at p50 and p99: each resample
    draws as many rounds as each route ran, with replacement, pools their values and takes the
    percentiles. Needs at least two non-empty rounds per route."""
    direct = [np.asarray(r, dtype=float) for r in direct_rounds if len(r)]
    gateway = [np.asarray(r, dtype=float) for r in gateway_rounds if len(r)]
    if len(direct) < 2 or len(gateway) < 2:
        return AddedIntervals(NO_INTERVAL, NO_INTERVAL)
    rng = np.random.default_rng(seed)
    diffs = np.empty((resamples, 2))
    for i in range(resamples):
        d = _pooled_percentiles(direct, rng)
        g = _pooled_percentiles(gateway, rng)
        diffs[i] = g - d
    tail = (1 - confidence) / 2 * 100
    (p50_low, p99_low), (p50_high, p99_high) = np.percentile(diffs, [tail, 100 - tail], axis=0)
    return AddedIntervals(Interval(float(p50_low), float(p50_high)),
                          Interval(float(p99_low), float(p99_high)))


def _pooled_percentiles(rounds: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    picked = rng.integers(0, len(rounds), size=len(rounds))
    pooled: np.ndarray = np.percentile(np.concatenate([rounds[i] for i in picked]), [50, 99])
    return pooled
