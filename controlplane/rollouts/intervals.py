"""Confidence intervals of the difference between two slices: what a slice experiment reports beside its
verdict, so that a reader sees how large the effect is and how sure the run is of it. Pure: counts or
samples in, an :class:`Interval` out.

- **A difference of failure shares** (experiment minus control): Newcombe's hybrid score interval (his
  method 10, from the two Wilson score intervals). It stays inside [-1, 1], behaves at 0 or 100% failures
  and for the few dozen requests a small slice collects, where the normal (Wald) interval collapses to a
  point or leaves the range.
- **A difference of medians** (TTFT, TPOT): a percentile bootstrap with a fixed seed (the same samples give
  the same interval), each side resampled independently; the samples are capped, so an interval costs a few
  milliseconds however long the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

BOOTSTRAP_RESAMPLES = 1_000
BOOTSTRAP_CAP = 2_000  # the latest samples of a side a bootstrap uses
BOOTSTRAP_SEED = 20_231


@dataclass(slots=True, frozen=True)
class Interval:
    """``estimate`` (experiment minus control) with its two-sided ``confidence`` interval."""

    metric: str  # error_rate | ttft_p50_s | tpot_p50_s
    estimate: float
    low: float
    high: float
    confidence: float
    method: str

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "estimate": round(self.estimate, 6), "low": round(self.low, 6),
                "high": round(self.high, 6), "confidence": self.confidence, "method": self.method,
                "excludes_zero": self.excludes_zero}


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence!r}")
    return NormalDist().inv_cdf(1 - (1 - confidence) / 2)


def wilson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a share; (0, 1) for no trials."""
    if trials < 0 or not 0 <= successes <= max(trials, 0):
        raise ValueError(f"wilson: need 0 <= successes <= trials, got {successes} of {trials}")
    if trials == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exactly, not to a rounding of the z value
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def share_difference(failed_a: int, n_a: int, failed_b: int, n_b: int, *, confidence: float = 0.95,
                     metric: str = "error_rate") -> Interval | None:
    """Newcombe's hybrid score interval of ``failed_a/n_a - failed_b/n_b``; None when a side is empty."""
    if n_a <= 0 or n_b <= 0:
        return None
    p_a, p_b = failed_a / n_a, failed_b / n_b
    l_a, u_a = wilson(failed_a, n_a, confidence)
    l_b, u_b = wilson(failed_b, n_b, confidence)
    diff = p_a - p_b
    low = diff - math.sqrt((p_a - l_a) ** 2 + (u_b - p_b) ** 2)
    high = diff + math.sqrt((u_a - p_a) ** 2 + (p_b - l_b) ** 2)
    return Interval(metric, diff, max(-1.0, low), min(1.0, high), confidence, "newcombe-wilson")


def median_difference(a: Sequence[float], b: Sequence[float], *, metric: str, confidence: float = 0.95,
                      resamples: int = BOOTSTRAP_RESAMPLES, cap: int = BOOTSTRAP_CAP,
                      seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """A percentile-bootstrap interval of ``median(a) - median(b)``; None when a side has fewer than two
    values."""
    _z(confidence)  # checks it
    if len(a) < 2 or len(b) < 2:
        return None
    xa, xb = np.asarray(a[-cap:], dtype=float), np.asarray(b[-cap:], dtype=float)
    rng = np.random.default_rng(seed)
    ma = np.median(rng.choice(xa, size=(resamples, len(xa)), replace=True), axis=1)
    mb = np.median(rng.choice(xb, size=(resamples, len(xb)), replace=True), axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ma - mb, [tail, 100 - tail])
    return Interval(metric, float(np.median(xa) - np.median(xb)), float(low), float(high), confidence,
                    f"bootstrap ({resamples} resamples)")
