"""A live replica's ``/metrics`` against vLLM's documented list (``data/vllm_metrics.json``, with its
sources): every vLLM series we claim is there, with vLLM's type, its labels (``model_name``, ``engine``)
beside ours, and its bucket boundaries; no ``vllm:`` name is made up; the series vLLM added for request
parameters and per-request timing move with the traffic."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from inference.metrics import buckets_1_2_5

from .harness import MODEL, ReplicaProcess, completion, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REFERENCE = json.loads((Path(__file__).parent / "data" / "vllm_metrics.json").read_text())
DOCUMENTED: dict[str, dict[str, Any]] = REFERENCE["metrics"]
ONE_TWO_FIVE = "1-2-5 up to max_model_len"


def _families(text: str) -> dict[str, tuple[str, list[Sample]]]:
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def _bounds(samples: list[Sample]) -> list[float]:
    return sorted({float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")})


def _expected_bounds(spec: dict[str, Any], max_model_len: int) -> list[float]:
    buckets = spec["buckets"]
    finite = buckets_1_2_5(max_model_len) if buckets == ONE_TWO_FIVE else buckets
    return [float(b) for b in finite] + [math.inf]


def test_every_documented_vllm_series_is_there_with_vllms_type_labels_and_buckets(
        replica: ReplicaProcess) -> None:
    assert replica.http.post("/v1/completions", json=completion()).status_code == 200
    max_model_len = replica.http.get("/v1/models").json()["data"][0]["max_model_len"]
    families = _families(replica.http.get("/metrics").text)

    problems = []
    for name, spec in DOCUMENTED.items():
        if name not in families:
            problems.append(f"{name}: missing")
            continue
        kind, samples = families[name]
        if kind != spec["type"]:
            problems.append(f"{name}: a {kind}, vLLM's is a {spec['type']}")
        for sample in samples:
            labels = sample.labels
            if labels.get("model_name") != MODEL or labels.get("engine") != REFERENCE["engine_label_value"]:
                problems.append(f"{name}: labels {labels}")
            if (labels.get("replica"), labels.get("zone")) != (replica.replica_id, replica.zone):
                problems.append(f"{name}: our labels missing from {labels}")
        if spec["type"] == "histogram" and _bounds(samples) != _expected_bounds(spec, max_model_len):
            problems.append(f"{name}: buckets {_bounds(samples)}")
    assert problems == []


def test_no_vllm_name_on_the_page_is_missing_from_vllms_list(replica: ReplicaProcess) -> None:
    families = _families(replica.http.get("/metrics").text)

    ours = {name for name in families if name.startswith("vllm:")}
    assert sorted(ours - DOCUMENTED.keys()) == []
    unprefixed = {name for name in families if not name.startswith(("vllm:", "llmsre_"))}
    assert unprefixed == set()  # the project's own series all carry its namespace


def test_request_parameters_and_per_request_timings_move_with_the_traffic(replica: ReplicaProcess) -> None:
    before = replica.metrics()
    for max_tokens in (5, 3):
        body = completion(max_tokens=max_tokens, ignore_eos=True)
        assert replica.http.post("/v1/completions", json=body).status_code == 200
    after = replica.metrics()

    def delta(name: str) -> float:
        return (metric_value(after, name) or 0.0) - (metric_value(before, name) or 0.0)

    assert delta("vllm:request_params_max_tokens_sum") == 8
    assert delta("vllm:request_max_num_generation_tokens_sum") == 8
    assert delta("vllm:request_params_n_count") == 2 and delta("vllm:request_params_n_sum") == 2
    assert delta("vllm:request_inference_time_seconds_count") == 2
    assert delta("vllm:request_inference_time_seconds_sum") > 0
    assert delta("vllm:request_time_per_output_token_seconds_count") == 2
    assert delta("vllm:request_time_per_output_token_seconds_sum") > 0
    # the deprecated name observes exactly what the inter-token latency does: every token but the first
    assert delta("vllm:time_per_output_token_seconds_count") == 4 + 2
    assert delta("vllm:inter_token_latency_seconds_count") == 4 + 2
    assert metric_value(after, "vllm:gpu_cache_usage_perc") == metric_value(after, "vllm:kv_cache_usage_perc")
