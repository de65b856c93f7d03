"""The per-token histograms of ``inference.metrics``: each inter-token latency lands once in vLLM's
``vllm:inter_token_latency_seconds`` and once in its deprecated ``vllm:time_per_output_token_seconds``,
through series labelled when the replica starts (not looked up again per token, on the event loop)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from inference.metrics import CacheConfigInfo, EngineGauges, ReplicaMetrics

LABELS = {"model_name": "m", "engine": "0", "replica": "r-1", "zone": "az-a"}


def _metrics() -> ReplicaMetrics:
    return ReplicaMetrics(model_name="m", replica="r-1", zone="az-a", max_model_len=64,
                          read_engine=lambda: EngineGauges(0, 0, 0.0, 0, 0, 0, 1, 2, 0.5),
                          cache_info=CacheConfigInfo(16, 8, "auto", True))


def _value(registry: CollectorRegistry, name: str, **extra: str) -> float:
    value = registry.get_sample_value(name, {**LABELS, **extra})
    assert value is not None, name
    return value


def test_both_inter_token_series_count_the_same_observations() -> None:
    metrics = _metrics()
    gaps = [0.02, 0.03, 0.2, 1.5]

    metrics.observe_token(True, 0.4)
    for gap in gaps:
        metrics.observe_token(False, gap)

    r = metrics.registry
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert _value(r, f"{name}_count") == len(gaps)
        assert _value(r, f"{name}_sum") == pytest.approx(sum(gaps))
        assert _value(r, f"{name}_bucket", le="0.05") == 2
    assert _value(r, "vllm:time_to_first_token_seconds_count") == 1


def test_a_token_or_a_step_looks_up_no_labelled_series(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = _metrics()

    def no_lookup(*_: str) -> None:
        raise AssertionError("labels() looked up per token")

    for histogram in (metrics.ttft, metrics.itl, metrics.tpot, metrics.iteration_tokens):
        monkeypatch.setattr(histogram, "labels", no_lookup)

    metrics.observe_token(True, 0.1)
    metrics.observe_token(False, 0.01)
    metrics.observe_step(8)

    assert _value(metrics.registry, "vllm:time_per_output_token_seconds_count") == 1
    assert _value(metrics.registry, "vllm:iteration_tokens_total_count") == 1
