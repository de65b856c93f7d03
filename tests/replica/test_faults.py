"""``/admin/faults``: each fault kind does what it says while active and stops by itself when it expires."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from .harness import (
    DONE,
    LONG_MAX_TOKENS,
    BackgroundStream,
    ReplicaProcess,
    StartFresh,
    chat,
    completion,
    openai_error,
    sse_events,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _wait_expired(replica: ReplicaProcess, timeout: float = 5.0) -> None:
    wait_until(lambda: replica.active_faults() == [], timeout=timeout, what="the fault to expire")


def _timed_completion(replica: ReplicaProcess, max_tokens: int = 8) -> float:
    started = time.monotonic()
    response = replica.http.post("/v1/completions", json=completion(max_tokens=max_tokens, ignore_eos=True))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens
    return time.monotonic() - started


def _time_to_first_token(replica: ReplicaProcess,
                         headers: dict[str, str] | None = None) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds from it to the last) of an 8-token stream."""
    started = time.monotonic()
    arrivals = []
    with replica.http.stream("POST", "/v1/completions", headers=headers,
                             json=completion(max_tokens=8, ignore_eos=True, stream=True)) as response:
        assert response.status_code == 200
        for event in sse_events(response):
            if event != DONE and event["choices"] and event["choices"][0]["text"]:
                arrivals.append(time.monotonic())
    assert arrivals
    return arrivals[0] - started, arrivals[-1] - arrivals[0]


# ---- the admin endpoints ---------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path"), [("GET", "/admin/faults"), ("PUT", "/admin/faults"),
                                              ("DELETE", "/admin/faults"), ("DELETE", "/admin/faults/f1")])
@pytest.mark.parametrize("use_api_key", [True, False])
def test_admin_endpoints_refuse_the_api_key_and_a_missing_token(replica: ReplicaProcess, method: str,
                                                                path: str, use_api_key: bool) -> None:
    headers = replica.auth if use_api_key else {}
    body = {"kind": "error_rate", "duration_s": 30, "probability": 1.0} if method == "PUT" else None

    response = httpx.request(method, f"{replica.base_url}{path}", json=body, headers=headers, timeout=30)

    assert openai_error(response, 401)["code"] == "invalid_admin_token"
    assert replica.active_faults() == []


@pytest.mark.parametrize(("field", "body"), [
    ("kind", {"kind": "meteor", "duration_s": 1}),
    ("kind", {"duration_s": 1}),
    ("duration_s", {"kind": "hang"}),
    ("duration_s", {"kind": "hang", "duration_s": -1}),
    ("duration_s", {"kind": "hang", "duration_s": 0}),
    ("duration_s", {"kind": "hang", "duration_s": "1"}),
    ("probability", {"kind": "error_rate", "duration_s": 1, "probability": 2}),
    ("probability", {"kind": "error_rate", "duration_s": 1}),
    ("status_code", {"kind": "error_rate", "duration_s": 1, "probability": 0.5, "status_code": 404}),
    ("seconds", {"kind": "token_latency", "duration_s": 1, "seconds": -0.1}),
    ("seconds", {"kind": "prefill_delay", "duration_s": 1}),
    ("fraction", {"kind": "kv_pressure", "duration_s": 1, "fraction": 1.5}),
    ("colour", {"kind": "hang", "duration_s": 1, "colour": "red"}),
    ("body", ["hang", 1]),
])
def test_bad_fault_is_a_400_naming_the_field_and_injects_nothing(replica: ReplicaProcess, field: str,
                                                                 body: Any) -> None:
    response = replica.admin.put("/admin/faults", json=body)

    error = openai_error(response, 400)
    assert error["param"] == field
    assert replica.active_faults() == []


def test_listed_faults_show_their_remaining_time_and_delete_removes_them(replica: ReplicaProcess) -> None:
    slow = replica.add_fault("token_latency", 30, seconds=0.001)
    pressure = replica.add_fault("kv_pressure", 20, fraction=0.1)

    listed = {f["id"]: f for f in replica.active_faults()}
    removed_one = replica.admin.delete(f"/admin/faults/{slow['id']}")
    after_one = [f["id"] for f in replica.active_faults()]
    removed_again = replica.admin.delete(f"/admin/faults/{slow['id']}")
    removed_all = replica.admin.delete("/admin/faults")

    assert set(listed) == {slow["id"], pressure["id"]}
    assert listed[slow["id"]]["kind"] == "token_latency" and listed[slow["id"]]["seconds"] == 0.001
    assert 25 < listed[slow["id"]]["remaining_s"] <= 30
    assert listed[pressure["id"]]["kind"] == "kv_pressure" and listed[pressure["id"]]["fraction"] == 0.1
    assert 15 < listed[pressure["id"]]["remaining_s"] <= 20
    assert removed_one.status_code == 200 and removed_one.json() == {"removed": 1}
    assert after_one == [pressure["id"]]
    assert openai_error(removed_again, 404)["param"] == "fault_id"
    assert removed_all.json() == {"removed": 1}
    assert replica.active_faults() == []


# ---- each kind, until it expires -------------------------------------------------------------
def test_token_latency_slows_every_token_until_it_expires(replica: ReplicaProcess) -> None:
    before = _timed_completion(replica)

    replica.add_fault("token_latency", 2.0, seconds=0.1)
    slowed = _timed_completion(replica)  # 8 steps, 0.1 s each
    _wait_expired(replica)
    after = _timed_completion(replica)

    assert slowed >= before + 0.7
    assert after < slowed - 0.5


def test_prefill_delay_raises_time_to_first_token_until_it_expires(replica: ReplicaProcess) -> None:
    ttft_before, _ = _time_to_first_token(replica)

    replica.add_fault("prefill_delay", 2.0, seconds=0.5)
    ttft_delayed, decode_delayed = _time_to_first_token(replica)
    _wait_expired(replica)
    ttft_after, _ = _time_to_first_token(replica)

    assert ttft_delayed >= ttft_before + 0.45
    assert decode_delayed < 0.45  # only the prompt's step waits, not every token
    assert ttft_after < ttft_delayed - 0.3


def test_error_rate_fails_requests_with_openai_shaped_503_until_it_expires(replica: ReplicaProcess) -> None:
    replica.add_fault("error_rate", 1.5, probability=1.0, status_code=503)
    failed = [replica.http.post("/v1/completions", json=completion()),
              replica.http.post("/v1/chat/completions", json=chat()),
              replica.http.post("/v1/chat/completions", json=chat(stream=True))]
    with openai.OpenAI(base_url=f"{replica.base_url}/v1", api_key=replica.api_key, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as raised:
            client.completions.create(model="default", prompt="hi", max_tokens=2)
        _wait_expired(replica)
        recovered = client.completions.create(model="default", prompt="hi", max_tokens=2)

    for response in failed:
        error = openai_error(response, 503)
        assert error["type"] == "server_error" and error["code"] == "injected_fault"
        assert response.headers["x-replica-id"] == replica.replica_id
    assert raised.value.status_code == 503
    assert raised.value.code == "injected_fault"
    assert recovered.usage is not None and recovered.usage.completion_tokens == 2


# ---- coloured faults: only the slice of traffic that carries the colour ----------------------------
RED = {"x-llmsre-colour": "red"}
RED_BAGGAGE = {"baggage": "userid=7, llmsre.colour=red;prop=1"}


def test_coloured_error_rate_refuses_only_requests_of_its_colour(replica: ReplicaProcess) -> None:
    fault = replica.add_fault("error_rate", 30, probability=1.0, colour="red")
    coloured = [replica.http.post("/v1/completions", json=completion(), headers=headers)
                for headers in (RED, RED_BAGGAGE)]
    other = [replica.http.post("/v1/completions", json=completion(), headers=headers)
             for headers in ({}, {"x-llmsre-colour": "blue"}, {"baggage": "llmsre.colour=blue"})]

    assert fault["colour"] == "red"
    assert [openai_error(r, 500)["code"] for r in coloured] == ["injected_fault"] * 2
    assert [r.status_code for r in other] == [200, 200, 200]


def test_coloured_token_latency_slows_only_its_colours_streams(replica: ReplicaProcess) -> None:
    replica.add_fault("token_latency", 30, seconds=0.1, colour="red")

    started = time.monotonic()
    plain = replica.http.post("/v1/completions", json=completion(max_tokens=8, ignore_eos=True))
    plain_s = time.monotonic() - started
    started = time.monotonic()
    red = replica.http.post("/v1/completions", json=completion(max_tokens=8, ignore_eos=True), headers=RED)
    red_s = time.monotonic() - started
    ttft, decode = _time_to_first_token(replica, headers=RED)

    assert plain.status_code == red.status_code == 200
    assert red_s >= plain_s + 0.7  # 8 tokens, 0.1 s each, on the red request only
    assert plain_s < 0.7
    assert decode >= 0.65  # 7 gaps between the red stream's 8 tokens
    assert ttft >= 0.1


def test_kv_pressure_holds_back_its_fraction_of_the_cache_until_it_expires(replica: ReplicaProcess) -> None:
    [info] = [s for s in replica.metrics() if s.name == "vllm:cache_config_info"]
    one_block = 1 / int(info.labels["num_gpu_blocks"])
    assert replica.metric("vllm:kv_cache_usage_perc") == 0

    replica.add_fault("kv_pressure", 2.0, fraction=0.5)
    usage = wait_until(lambda: (v := replica.metric("vllm:kv_cache_usage_perc")) and v, timeout=2,
                       what="kv_cache_usage_perc to show the reserved blocks")
    served = replica.http.post("/v1/completions", json=completion())
    _wait_expired(replica)

    assert abs(usage - 0.5) <= one_block
    assert served.status_code == 200  # half the cache is still plenty for a short request
    wait_until(lambda: replica.metric("vllm:kv_cache_usage_perc") == 0, timeout=2,
               what="kv_cache_usage_perc to return to 0 after expiry")


def test_request_preempted_under_kv_pressure_completes_its_greedy_text_and_says_so(
        replica: ReplicaProcess) -> None:
    body = completion(max_tokens=64, ignore_eos=True, stream_options={"include_usage": True})
    expected = replica.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    preemptions_before = replica.metric("vllm:num_preemptions_total") or 0.0

    with replica.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = sse_events(response)
        head = [next(events) for _ in range(2)]
        replica.add_fault("kv_pressure", 1.0, fraction=1.0)  # preempted at its next block boundary
        events_list = head + list(events)
    payloads = [e for e in events_list if e != DONE]
    text = "".join(p["choices"][0]["text"] for p in payloads if p["choices"])
    final = payloads[-1]

    assert replica.metric("vllm:num_preemptions_total") == preemptions_before + 1
    assert text == expected  # recomputed after the fault, it picks up where it left off
    assert final["usage"]["completion_tokens"] == 64
    assert final["timings"]["preemptions"] == 1


def test_hang_stalls_requests_and_fails_liveness_until_it_expires(start_fresh: StartFresh) -> None:
    replica = start_fresh("--stall-seconds", "1", replica_id="hang")
    hang_s = 3.0
    put_at = time.monotonic()
    replica.add_fault("hang", hang_s)
    stream = BackgroundStream(replica, "/v1/completions", completion(
        max_tokens=8, ignore_eos=True, stream_options={"include_usage": True}))
    stream.start()

    unhealthy = wait_until(lambda: (r := replica.http.get("/health")).status_code == 503 and r,
                           timeout=hang_s - 0.5, what="/health to report the stall")
    events_while_hung = len(stream.events)
    not_ready = replica.http.get("/ready")
    stream.join(20)
    healthy_after = replica.http.get("/health")

    assert "no progress" in unhealthy.json()["reason"]
    assert events_while_hung == 0
    assert not_ready.status_code == 503
    assert stream.error is None and stream.status == 200
    assert stream.events[0][0] >= put_at + hang_s  # no token before the hang ended
    assert stream.payloads[-1] == DONE
    usage = stream.usage()
    assert usage is not None and usage["completion_tokens"] == 8
    assert healthy_after.status_code == 200


def test_device_failure_fails_in_flight_streams_and_readiness_until_it_expires(
        start_fresh: StartFresh) -> None:
    replica = start_fresh(replica_id="device")
    body = completion(max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool, replica.http.stream("POST", "/v1/completions",
                                                            json={**body, "stream": True}) as response:
        plain = pool.submit(httpx.post, f"{replica.base_url}/v1/completions", json=body,
                            headers=replica.auth, timeout=30)
        events = sse_events(response)
        assert all(isinstance(next(events), dict) for _ in range(2))
        wait_until(lambda: replica.metric("vllm:num_requests_running") == 2, timeout=5,
                   what="both requests running")
        replica.add_fault("device_failure", 3.0)
        rest = list(events)
        plain_response = plain.result(10)
    ready, health = replica.http.get("/ready"), replica.http.get("/health")
    refused = replica.http.post("/v1/completions", json=completion())
    running = replica.metric("vllm:num_requests_running")
    kv_usage = replica.metric("vllm:kv_cache_usage_perc")

    assert rest and DONE not in rest
    assert rest[-1]["error"]["code"] == "device_failure"
    assert openai_error(plain_response, 500)["code"] == "device_failure"
    assert ready.status_code == 503 and health.status_code == 503
    assert "device failure" in ready.json()["reason"]
    assert openai_error(refused, 503)["code"] == "device_failure"
    assert running == 0 and kv_usage == 0
    wait_until(lambda: replica.http.get("/ready").status_code == 200, timeout=6,
               what="/ready to recover after the fault expired")
    recovered = replica.http.post("/v1/completions", json=completion())
    assert recovered.status_code == 200
    assert recovered.json()["usage"]["completion_tokens"] == 8


def test_crash_kills_the_process_right_after_acknowledging_it(start_fresh: StartFresh) -> None:
    replica = start_fresh(replica_id="crash")

    response = replica.admin.put("/admin/faults", json={"kind": "crash", "duration_s": 60})
    exit_code = replica.proc.wait(5)

    assert response.status_code == 201 and response.json()["kind"] == "crash"
    assert exit_code == -signal.SIGKILL
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{replica.base_url}/health", timeout=2)
