"""``/metrics``: vLLM's names with our replica and zone labels, valid for promtool, moving with traffic."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from inference.metrics import ENGINE_INFO
from inference.run_delay import unavailable_reason as run_delay_unavailable

from .harness import MODEL, ReplicaProcess, StartFresh, chat, completion, full_queue, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# Every vLLM metric that inference/metrics.py exports, by family name and type.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}
# promtool's lints that vLLM's own naming trips, and nothing else is tolerated:
# - the `vllm:` prefix: colons are reserved for recording rules, but they are vLLM's public names;
# - `vllm:iteration_tokens_total` is a histogram whose name ends in `_total` (vLLM's name for it), which
#   promtool reserves for counters. Dashboards query these names, so they are kept as vLLM spells them.
ALLOWED_LINTS = (
    re.compile(r"^vllm:\w+ metric names should not contain ':'$"),
    re.compile(r'^vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix$'),
)


def _families(text: str) -> dict[str, tuple[str, list[Sample]]]:
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def _assert_labelled(samples: list[Sample], replica: ReplicaProcess) -> None:
    assert samples
    for sample in samples:
        assert sample.labels["model_name"] == MODEL, sample
        assert sample.labels["engine"] == "0", sample  # vLLM's engine index: one engine per replica
        assert sample.labels["replica"] == replica.replica_id, sample
        assert sample.labels["zone"] == replica.zone, sample


def test_promtool_reports_nothing_but_vllm_naming_lints(replica: ReplicaProcess) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make apt` installs it)")
    assert replica.http.post("/v1/completions", json=completion()).status_code == 200  # every series exists
    page = replica.http.get("/metrics").text

    result = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, text=True,
                            timeout=30)

    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.strip() and not any(p.match(line.strip()) for p in ALLOWED_LINTS)]
    assert problems == []
    assert result.returncode in (0, 3)  # 3: lint findings only; 1 would be a malformed page


def test_every_vllm_metric_carries_model_replica_and_zone_labels(replica: ReplicaProcess) -> None:
    assert replica.http.post("/v1/completions", json=completion()).status_code == 200

    families = _families(replica.http.get("/metrics").text)

    for name, kind in VLLM_METRICS.items():
        assert name in families, f"{name} is missing"
        assert families[name][0] == kind, name
        _assert_labelled(families[name][1], replica)


def test_the_page_says_how_the_engine_runs(replica: ReplicaProcess) -> None:
    """``llmsre_engine_info``: a CPU replica of the float32 model, on the C++ decode kernel and with its
    linear weights packed for oneDNN by default (``make test`` builds the kernel before any replica
    starts)."""
    samples = _families(replica.first_metrics)[ENGINE_INFO][1]
    _assert_labelled(samples, replica)
    assert [(s.labels["device"], s.labels["dtype"], s.labels["cpu_decode_kernel"], s.labels["packed_weights"],
             s.value) for s in samples] == [("cpu", "float32", "on", "on", 1.0)]


def test_every_vllm_series_is_exported_from_startup_before_any_request(replica: ReplicaProcess) -> None:
    """vLLM creates its labelled series at start, so a quiet replica reads 0, not "no data"."""
    families = _families(replica.first_metrics)

    missing = [name for name in VLLM_METRICS if not families.get(name, ("", []))[1]]
    assert not missing, f"absent until the first request: {', '.join(missing)}"
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"][1]}
    assert {"stop", "length", "abort"} <= reasons


def test_counters_and_histograms_move_by_exactly_the_traffic_served(replica: ReplicaProcess) -> None:
    before = replica.metrics()
    bodies = [("/v1/completions", completion(max_tokens=5, ignore_eos=True)),
              ("/v1/completions", completion(prompt="Another prompt", max_tokens=3, ignore_eos=True)),
              ("/v1/chat/completions", chat(max_tokens=4, ignore_eos=True))]
    usages = []
    for path, body in bodies:
        response = replica.http.post(path, json=body)
        assert response.status_code == 200
        usages.append(response.json()["usage"])
    after = replica.metrics()

    def delta(name: str, **labels: str) -> float:
        return (metric_value(after, name, **labels) or 0.0) - (metric_value(before, name, **labels) or 0.0)

    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 12
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("llmsre_prompt_tokens_squared_total") == sum(u["prompt_tokens"] ** 2 for u in usages)
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("llmsre_generation_tokens_squared_total") == sum(u["completion_tokens"] ** 2 for u in usages)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == generated
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"vllm:{histogram}_count") == 3, histogram
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 3  # every token but the first
    assert delta("vllm:iteration_tokens_total_count") >= 5  # at least the longest request's steps
    assert delta("vllm:iteration_tokens_total_sum") >= prompt + generated - 3
    assert delta("vllm:prefix_cache_queries_total") >= prompt
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0


def test_engine_time_and_step_work_move_with_the_steps_served(replica: ReplicaProcess) -> None:
    """What the control plane prices with the replica profile (controlplane.autoscale.drift): prompts no
    earlier test sent (no prefix-cache hit), one at a time, so each token after the first is one decode
    step attending to the prompt and every token before it."""
    before = replica.metrics()
    started = time.monotonic()
    usages = []
    for words in ("violet harbour lantern", "seven quiet engines measure", "granite orchard"):
        response = replica.http.post("/v1/completions", json=completion(prompt=f"{words} {time.time_ns()}",
                                                                         max_tokens=6, ignore_eos=True))
        assert response.status_code == 200
        usages.append(response.json()["usage"])
    elapsed = time.monotonic() - started
    after = replica.metrics()

    def work(term: str) -> float:
        name = "llmsre_engine_step_work_total"
        return (metric_value(after, name, term=term) or 0.0) - (metric_value(before, name, term=term) or 0.0)

    prompts = [u["prompt_tokens"] for u in usages]
    assert work("prefill_tokens") == sum(prompts)
    assert work("prefill_pairs") == sum(p * (p + 1) // 2 for p in prompts)
    assert work("decode_sequences") == 3 * 5
    assert work("context_tokens") == sum(5 * p + sum(range(1, 6)) for p in prompts)
    assert work("steps") >= 3 * 6  # a prompt this short is one step, then five decode steps
    def moved(name: str) -> float:
        return (metric_value(after, name) or 0.0) - (metric_value(before, name) or 0.0)

    busy = moved("llmsre_engine_busy_seconds_total")
    assert 0 < busy < elapsed
    # the engine thread's CPU time within its steps: some, and never more than the steps' wall time
    cpu = moved("llmsre_engine_step_cpu_seconds_total")
    stepping = busy - moved("llmsre_engine_turn_seconds_total")
    assert 0 < cpu <= stepping + 1e-6
    # and the seconds it waited for a core within them: the rest of its steps' time, at most; not exported
    # where the kernel does not count run delays (tests/inference/test_run_delay.py)
    if run_delay_unavailable() is not None:
        assert metric_value(after, "llmsre_engine_step_runqueue_seconds_total") is None
    else:
        assert metric_value(after, "llmsre_engine_step_runqueue_seconds_total") is not None
        assert 0 <= moved("llmsre_engine_step_runqueue_seconds_total") <= stepping - cpu + 1e-6


def test_refusals_are_counted_by_status_and_by_reason(start_fresh: StartFresh) -> None:
    replica = start_fresh("--max-num-seqs", "1", "--max-waiting-requests", "1", replica_id="counted")
    before = replica.metrics()

    with full_queue(replica):
        statuses = [replica.http.post("/v1/completions", json=completion()).status_code,
                    replica.http.post("/v1/completions", json=completion(stream=True)).status_code,
                    replica.http.post("/v1/chat/completions", json=chat()).status_code]
    unauthorized = httpx.post(f"{replica.base_url}/v1/completions", json=completion(), timeout=30)
    after = replica.metrics()

    def delta(name: str, **labels: str) -> float:
        return (metric_value(after, name, **labels) or 0.0) - (metric_value(before, name, **labels) or 0.0)

    assert statuses == [429, 429, 429] and unauthorized.status_code == 401
    assert delta("llmsre_http_requests_total", path="/v1/completions", status_code="429") == 2
    assert delta("llmsre_http_requests_total", path="/v1/chat/completions", status_code="429") == 1
    assert delta("llmsre_http_requests_total", path="/v1/completions", status_code="401") == 1
    # the two streams
    assert delta("llmsre_http_requests_total", path="/v1/completions", status_code="200") == 2
    assert delta("llmsre_rejected_requests_total", reason="queue_full") == 3
    assert delta("llmsre_rejected_requests_total", reason="unauthorized") == 1


def test_kv_blocks_in_use_return_to_zero_when_streams_end_and_tasks_are_counted(
        replica: ReplicaProcess) -> None:
    """The exact blocks-in-use gauge (what the soak checks after a drain) is 0 once every request ended,
    however it ended: run to its length, or cut by the client mid-stream."""
    with replica.http.stream("POST", "/v1/completions",
                             json=completion(max_tokens=200, ignore_eos=True, stream=True)) as cut:
        assert cut.status_code == 200
        for line in cut.iter_lines():
            if line.startswith("data: {"):
                break  # the client leaves after its first token
    assert replica.http.post("/v1/completions", json=completion(max_tokens=6)).status_code == 200

    def settled() -> list[Sample]:
        for _ in range(100):  # a cancelled request frees its blocks within one engine step
            samples = replica.metrics()
            if metric_value(samples, "vllm:num_requests_running") == 0:
                return samples
            time.sleep(0.05)
        raise AssertionError("a request still runs after its client left")

    samples = settled()
    assert metric_value(samples, "llmsre_kv_cache_blocks_in_use") == 0
    tasks = metric_value(samples, "llmsre_asyncio_tasks")
    assert tasks is not None and tasks >= 1  # at least the task serving /metrics
