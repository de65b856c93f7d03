"""The analysis of one canary step (or one slice experiment): the two sides' outcomes over the same window,
compared with tests that account for sample size. Pure: outcomes and thresholds in, an :class:`Analysis` out.

- **Errors**: Fisher's exact test, one-sided (is the candidate's failure rate higher?). Exact at any sample
  size, where a normal approximation misleads for the small counts a 5% canary collects.
- **Latency** (TTFT, and TPOT for streams of two tokens or more): the Mann-Whitney U test, one-sided (do the
  candidate's values tend to be larger?), which assumes no distribution (latencies are skewed and
  multi-modal); the P50/P95/P99 of both sides are reported beside it.

A metric fails only when its difference is both significant (p below ``alpha``) and larger than the
tolerance that matters to a user (``max_error_increase`` in absolute share, ``max_latency_ratio`` on the
median): with enough samples any difference becomes significant, and with too few none does. Fewer than
``min_samples`` on either side is *inconclusive*: the step waits for more traffic instead of deciding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane.gateway.slices import Outcome

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass(slots=True, frozen=True)
class Thresholds:
    alpha: float = 0.01  # significance of each one-sided test
    max_error_increase: float = 0.02  # candidate failure share above the baseline's, absolute
    max_latency_ratio: float = 1.25  # candidate median over the baseline's
    min_latency_increase_s: float = 0.005  # and at least this much slower (tiny medians)
    min_samples: int = 30  # per side, before a step may decide

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"alpha: must be in (0, 0.5), got {self.alpha!r}")
        if not 0 <= self.max_error_increase < 1:
            raise ValueError(f"max_error_increase: must be in [0, 1), got {self.max_error_increase!r}")
        if not self.max_latency_ratio >= 1:
            raise ValueError(f"max_latency_ratio: must be >= 1, got {self.max_latency_ratio!r}")
        if self.min_samples < 5:
            raise ValueError(f"min_samples: must be >= 5, got {self.min_samples!r}")


@dataclass(slots=True, frozen=True)
class SideFigures:
    requests: int
    failed: int
    p50: float | None
    p95: float | None
    p99: float | None

    @property
    def error_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "failed": self.failed, "error_rate": round(self.error_rate, 5),
                "p50": _ms(self.p50), "p95": _ms(self.p95), "p99": _ms(self.p99)}


@dataclass(slots=True, frozen=True)
class MetricVerdict:
    metric: str  # errors | ttft | tpot
    test: str  # fisher-exact (one-sided) | mann-whitney-u (one-sided)
    baseline: SideFigures
    candidate: SideFigures
    p_value: float | None  # None: not tested (too few samples)
    difference: float | None  # error share (absolute) or median ratio
    verdict: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "test": self.test, "baseline": self.baseline.to_json(),
                "candidate": self.candidate.to_json(),
                "p_value": None if self.p_value is None else float(f"{self.p_value:.3g}"),
                "difference": None if self.difference is None else round(self.difference, 4),
                "verdict": self.verdict, "reason": self.reason}


@dataclass(slots=True, frozen=True)
class Analysis:
    verdict: str  # pass | fail | inconclusive
    metrics: tuple[MetricVerdict, ...] = field(default_factory=tuple)

    @property
    def reasons(self) -> list[str]:
        return [f"{m.metric}: {m.reason}" for m in self.metrics if m.verdict == self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reasons": self.reasons,
                "metrics": [m.to_json() for m in self.metrics]}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _figures(outcomes: Sequence[Outcome], values: Sequence[float]) -> SideFigures:
    return SideFigures(len(outcomes), sum(1 for o in outcomes if not o.ok), _percentile(values, 0.5),
                       _percentile(values, 0.95), _percentile(values, 0.99))


def compare_errors(baseline: Sequence[Outcome], candidate: Sequence[Outcome], t: Thresholds) -> MetricVerdict:
    base, cand = _figures(baseline, []), _figures(candidate, [])
    test = "fisher-exact (one-sided)"
    if min(base.requests, cand.requests) < t.min_samples:
        return MetricVerdict("errors", test, base, cand, None, None, INCONCLUSIVE,
                             f"{min(base.requests, cand.requests)} requests on one side, fewer than "
                             f"{t.min_samples}")
    from scipy.stats import fisher_exact  # type: ignore[import-untyped]  # here: 0.6 s of the API's start

    table = [[cand.failed, cand.requests - cand.failed], [base.failed, base.requests - base.failed]]
    p = float(fisher_exact(table, alternative="greater").pvalue)
    increase = cand.error_rate - base.error_rate
    failed = p < t.alpha and increase > t.max_error_increase
    reason = (f"failure share {cand.error_rate:.1%} against {base.error_rate:.1%} (p={p:.2g}); "
              + ("higher beyond the tolerance" if failed else "within the tolerance or not significant"))
    return MetricVerdict("errors", test, base, cand, p, increase, FAIL if failed else PASS, reason)


def compare_latency(metric: str, baseline: Sequence[Outcome], candidate: Sequence[Outcome],
                    t: Thresholds) -> MetricVerdict:
    """``metric``: ttft or tpot, over the requests that succeeded and measured it."""
    base_values = [v for o in baseline if o.ok and (v := _value(o, metric)) is not None]
    cand_values = [v for o in candidate if o.ok and (v := _value(o, metric)) is not None]
    base, cand = _figures(baseline, base_values), _figures(candidate, cand_values)
    test = "mann-whitney-u (one-sided)"
    if min(len(base_values), len(cand_values)) < t.min_samples:
        return MetricVerdict(metric, test, base, cand, None, None, INCONCLUSIVE,
                             f"{min(len(base_values), len(cand_values))} measured requests on one side, "
                             f"fewer than {t.min_samples}")
    from scipy.stats import mannwhitneyu

    p = float(mannwhitneyu(cand_values, base_values, alternative="greater").pvalue)
    assert base.p50 is not None and cand.p50 is not None
    ratio = cand.p50 / base.p50 if base.p50 > 0 else math.inf
    slower = cand.p50 - base.p50
    failed = p < t.alpha and ratio > t.max_latency_ratio and slower > t.min_latency_increase_s
    reason = (f"median {cand.p50 * 1e3:.1f} ms against {base.p50 * 1e3:.1f} ms (x{ratio:.2f}, p={p:.2g}); "
              + ("slower beyond the tolerance" if failed else "within the tolerance or not significant"))
    return MetricVerdict(metric, test, base, cand, p, ratio, FAIL if failed else PASS, reason)


def _value(outcome: Outcome, metric: str) -> float | None:
    return outcome.ttft_s if metric == "ttft" else outcome.tpot_s


def analyse(baseline: Sequence[Outcome], candidate: Sequence[Outcome], thresholds: Thresholds) -> Analysis:
    """Fail when any metric fails; else inconclusive when any is; else pass."""
    metrics = (compare_errors(baseline, candidate, thresholds),
               compare_latency("ttft", baseline, candidate, thresholds),
               compare_latency("tpot", baseline, candidate, thresholds))
    verdicts = {m.verdict for m in metrics}
    verdict = FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    return Analysis(verdict, metrics)
