"""Health, readiness, cancellation on disconnect, and the SIGTERM drain."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
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

# Long enough that three requests sharing one CPU thread are still running after the drain checks
# (a few tenths of a second), short enough to wait for (a few seconds).
DRAIN_MAX_TOKENS = 400


def test_health_and_ready_are_200_on_an_idle_replica(replica: ReplicaProcess) -> None:
    health = replica.http.get("/health")
    ready = replica.http.get("/ready")

    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "replica": replica.replica_id, "zone": replica.zone}


def test_closing_a_stream_cancels_its_request_and_frees_its_kv_blocks(replica: ReplicaProcess) -> None:
    body = completion(max_tokens=LONG_MAX_TOKENS, ignore_eos=True, stream=True)
    with replica.http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
        assert all(isinstance(next(events), dict) for _ in range(3))
        assert replica.metric("vllm:num_requests_running") == 1
        kv_in_use = replica.metric("vllm:kv_cache_usage_perc")
        assert kv_in_use is not None and kv_in_use > 0
    # Leaving the block closed the connection after 3 of 1500 tokens.

    wait_until(lambda: replica.metric("vllm:num_requests_running") == 0, timeout=3,
               what="the abandoned request to stop running")
    wait_until(lambda: replica.metric("vllm:kv_cache_usage_perc") == 0, timeout=3,
               what="the abandoned request's KV blocks to be freed")
    after = replica.http.post("/v1/completions", json=completion())
    assert after.status_code == 200
    assert after.json()["usage"]["completion_tokens"] == 8


def test_giving_up_on_a_non_streaming_request_cancels_it(replica: ReplicaProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and closes the connection
        httpx.post(f"{replica.base_url}/v1/completions", headers=replica.auth, timeout=1.0,
                   json=completion(max_tokens=LONG_MAX_TOKENS, ignore_eos=True))

    wait_until(lambda: replica.metric("vllm:num_requests_running") == 0, timeout=3,
               what="the abandoned request to stop running")
    assert replica.metric("vllm:kv_cache_usage_perc") == 0
    assert replica.http.post("/v1/completions", json=completion()).status_code == 200


def test_sigterm_drains_in_flight_requests_without_losing_any_and_exits_zero(start_fresh: StartFresh) -> None:
    replica = start_fresh("--drain-timeout", "30", replica_id="drain")
    long = {"max_tokens": DRAIN_MAX_TOKENS, "ignore_eos": True, "stream_options": {"include_usage": True}}
    streams = [BackgroundStream(replica, "/v1/completions", completion(**long)),
               BackgroundStream(replica, "/v1/chat/completions", chat(**long))]
    with ThreadPoolExecutor(1) as pool:
        for stream in streams:
            stream.start()
        plain = pool.submit(httpx.post, f"{replica.base_url}/v1/completions", headers=replica.auth,
                            json=completion(max_tokens=DRAIN_MAX_TOKENS, ignore_eos=True), timeout=60)
        wait_until(lambda: replica.metric("vllm:num_requests_running") == 3, timeout=10,
                   what="three requests running")

        replica.terminate()
        ready = wait_until(lambda: (r := replica.http.get("/ready")).status_code == 503 and r, timeout=5,
                           what="/ready to refuse once SIGTERM arrived")
        refused = replica.http.post("/v1/completions", json=completion())
        refused_stream = replica.http.post("/v1/chat/completions", json=chat(stream=True))
        health = replica.http.get("/health")
        still_running = replica.metric("vllm:num_requests_running")
        plain_response = plain.result(timeout=60)
    for stream in streams:
        stream.join(60)
    exit_code = replica.proc.wait(30)

    assert ready.json()["reason"] == "draining"
    for response in (refused, refused_stream):
        error = openai_error(response, 503)
        assert error["code"] == "draining"
    assert health.status_code == 200  # draining is not dead: liveness stays up
    assert still_running == 3  # the checks above ran while all three were in flight
    for stream in streams:
        assert stream.error is None and stream.status == 200
        assert stream.payloads[-1] == DONE
        usage = stream.usage()
        assert usage is not None and usage["completion_tokens"] == DRAIN_MAX_TOKENS
    assert plain_response.status_code == 200
    assert plain_response.json()["usage"]["completion_tokens"] == DRAIN_MAX_TOKENS
    assert exit_code == 0, replica.log()
    assert "0 requests aborted" in replica.log()
