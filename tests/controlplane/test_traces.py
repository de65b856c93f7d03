"""Which request traces the store keeps: the tail above the running P95, errors, and a sample of the rest."""

from __future__ import annotations

import random

from controlplane.traces import TraceRecord, TraceSampler


def trace(e2e: float, error: str | None = None) -> TraceRecord:
    return TraceRecord("r", 0.0, "/v1/completions", "default", 200, "az-a-1", "az-a", "standard", 10, 10,
                       0.01, e2e, 0.001, 0.0, 0.01, e2e, 0.0, 0.0, error=error)


def test_sampler_keeps_every_tail_request_and_about_the_sample_rate_of_the_rest() -> None:
    sampler = TraceSampler(0.01, rng=random.Random(0))
    rng = random.Random(1)
    kept_fast = kept_slow = fast = 0
    for _ in range(20_000):
        slow = rng.random() < 0.02
        e2e = 5.0 + rng.random() if slow else rng.random()
        kept = sampler.keep(trace(e2e))
        if slow:
            kept_slow += kept
        else:
            fast += 1
            kept_fast += kept
    slow_total = 20_000 - fast
    assert kept_slow == slow_total  # every request above the P95 is kept
    # The rest: the few fast ones above the P95 (slow ones are only 2%) plus a 1% sample; not all of them.
    assert 0.01 <= kept_fast / fast <= 0.08


def test_sampler_keeps_errors_and_everything_until_it_knows_the_tail() -> None:
    sampler = TraceSampler(0.0)
    assert all(sampler.keep(trace(0.1)) for _ in range(19))
    for _ in range(100):
        sampler.keep(trace(1.0))
    assert not sampler.keep(trace(0.5))
    assert sampler.keep(trace(0.5, error="stream_cut"))


def test_the_running_p95_is_that_of_the_last_window_of_requests() -> None:
    sampler = TraceSampler(0.0, window=50)
    rng = random.Random(2)
    values = [rng.choice([rng.random(), 0.5, 0.5]) for _ in range(400)]  # ties included
    for i, value in enumerate(values):
        sampler.keep(trace(value))
        last = sorted(values[max(0, i + 1 - 50):i + 1])
        expected = None if len(last) < 20 else last[min(len(last) - 1, int(0.95 * len(last)))]
        assert sampler.p95() == expected
    assert len(sampler.recent) == 50
