"""A canary step's analysis: a slower or failing candidate fails with its numbers, an identical one passes,
and too little traffic decides nothing."""

from __future__ import annotations

import random

import pytest

from controlplane.gateway.slices import Outcome
from controlplane.rollouts.analysis import FAIL, INCONCLUSIVE, PASS, Thresholds, analyse


def _side(n: int, *, ttft: float, tpot: float, failure: float = 0.0, seed: int = 0) -> list[Outcome]:
    rng = random.Random(seed)
    return [Outcome(float(i), rng.random() >= failure, rng.lognormvariate(0, 0.3) * ttft,
                    rng.lognormvariate(0, 0.2) * tpot) for i in range(n)]


T = Thresholds()


def test_identical_versions_pass_on_every_metric() -> None:
    result = analyse(_side(200, ttft=0.05, tpot=0.02, seed=1), _side(60, ttft=0.05, tpot=0.02, seed=2), T)
    assert result.verdict == PASS
    assert [m.verdict for m in result.metrics] == [PASS, PASS, PASS]


def test_a_candidate_slower_per_token_fails_on_tpot_with_both_sides_figures() -> None:
    result = analyse(_side(200, ttft=0.05, tpot=0.02, seed=1), _side(60, ttft=0.05, tpot=0.12, seed=2), T)
    tpot = next(m for m in result.metrics if m.metric == "tpot")
    assert result.verdict == FAIL and tpot.verdict == FAIL
    assert tpot.p_value is not None and tpot.p_value < T.alpha
    assert tpot.difference is not None and tpot.difference > 5
    assert tpot.baseline.p95 is not None and tpot.candidate.p95 is not None
    assert tpot.candidate.p95 > tpot.baseline.p95
    assert result.reasons == [f"tpot: {tpot.reason}"]
    assert result.to_json()["metrics"][2]["candidate"]["p50"] > 100  # milliseconds in the record


def test_a_candidate_that_fails_requests_fails_on_errors() -> None:
    result = analyse(_side(300, ttft=0.05, tpot=0.02, seed=1),
                     _side(100, ttft=0.05, tpot=0.02, failure=0.2, seed=2), T)
    errors = result.metrics[0]
    assert errors.metric == "errors" and errors.verdict == FAIL and result.verdict == FAIL
    assert errors.candidate.error_rate > 0.1 and errors.baseline.error_rate == 0


def test_a_difference_within_the_tolerance_passes_however_many_samples() -> None:
    """Significant with 20,000 samples a side, but 10% slower is inside the 25% tolerance."""
    result = analyse(_side(20_000, ttft=0.05, tpot=0.02, seed=1),
                     _side(20_000, ttft=0.055, tpot=0.02, seed=2), T)
    ttft = result.metrics[1]
    assert ttft.p_value is not None and ttft.p_value < T.alpha
    assert ttft.verdict == PASS


def test_too_few_requests_is_inconclusive_not_a_pass() -> None:
    result = analyse(_side(200, ttft=0.05, tpot=0.02), _side(10, ttft=0.5, tpot=0.5), T)
    assert result.verdict == INCONCLUSIVE
    assert "fewer than 30" in result.metrics[0].reason


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Thresholds(alpha=0.7)
    with pytest.raises(ValueError, match="max_latency_ratio"):
        Thresholds(max_latency_ratio=0.9)
