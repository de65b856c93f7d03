"""The per-token histograms of ``inference.metrics``: each inter-token latency lands once in vLLM's
``vllm:inter_token_latency_seconds`` and once in its deprecated ``vllm:time_per_output_token_seconds``,
through series labelled when the replica starts (not looked up again per token, on the event loop); and the
engine's busy time and step work, which the control plane prices with the replica profile."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from inference.engine import StepStat
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
    metrics.observe_step(StepStat(0.0, 0.01, 6, 2, 2, 0), more_work=False)

    assert _value(metrics.registry, "vllm:time_per_output_token_seconds_count") == 1
    assert _value(metrics.registry, "vllm:iteration_tokens_total_count") == 1


def _step(start: float, duration: float, *, decode: int = 0, prefill: int = 0, context: int = 0,
          pairs: int = 0, cpu: float = 0.0, runqueue: float | None = None) -> StepStat:
    return StepStat(start, duration, prefill, decode, 0, 0, context, pairs, cpu, runqueue)


def test_engine_time_counts_the_turn_between_back_to_back_steps_and_not_the_idle_between() -> None:
    metrics = _metrics()
    metrics.observe_step(_step(10.0, 0.5, prefill=16, pairs=136, cpu=0.375, runqueue=0.0625),
                         more_work=True)
    metrics.observe_step(_step(10.6, 0.2, decode=1, context=17, cpu=0.125), more_work=False)  # 0.1 s turn
    metrics.observe_step(_step(50.0, 0.3, decode=1, context=18, cpu=0.25), more_work=False)  # idle: not

    busy = _value(metrics.registry, "llmsre_engine_busy_seconds_total")
    assert busy == pytest.approx(0.5 + 0.1 + 0.2 + 0.3)
    assert _value(metrics.registry, "llmsre_engine_turn_seconds_total") == pytest.approx(0.1)
    assert _value(metrics.registry, "llmsre_engine_step_cpu_seconds_total") == 0.75  # within steps only
    # a step whose run delay was not read adds none
    assert _value(metrics.registry, "llmsre_engine_step_runqueue_seconds_total") == 0.0625
    work = {term: _value(metrics.registry, "llmsre_engine_step_work_total", term=term) for term in
            ("steps", "decode_sequences", "prefill_tokens", "context_tokens", "prefill_pairs")}
    assert work == {"steps": 3, "decode_sequences": 2, "prefill_tokens": 16, "context_tokens": 35,
                    "prefill_pairs": 136}
