"""Through the gateway, a client sees what a replica would answer, and is refused before any stream.

Three real replicas; each test serves its own gateway over them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from .conftest import (
    Fleet,
    ServeGateway,
    StreamResult,
    chat,
    completion,
    run_streams,
    sse_payloads,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LONG = 1500  # tokens: a stream that outlives the check it keeps a slot busy for
MODEL_ID = "default"


def direct(fleet: Fleet, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{fleet.replicas['r0'].base_url}{path}", json=body, timeout=30)


def via(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)


def stream_summary(response: httpx.Response) -> dict[str, Any]:
    events = sse_payloads(response.text)
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks)
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return {"text": text, "finish": chunks[-1]["choices"][0]["finish_reason"], "done": events[-1] == "[DONE]",
            "token_ids": [t for c in chunks for t in c["choices"][0].get("token_ids", [])],
            "has_prompt_ids": any("prompt_token_ids" in e for e in events if isinstance(e, dict)),
            "usage": _counts(usage[-1]) if usage else None, "object": chunks[0]["object"]}


def full_summary(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    choice = body["choices"][0]
    return {"text": choice.get("text", choice.get("message", {}).get("content")),
            "finish": choice["finish_reason"], "token_ids": choice.get("token_ids"),
            "has_prompt_ids": "prompt_token_ids" in body, "usage": _counts(body["usage"]),
            "object": body["object"]}


def _counts(usage: dict[str, Any]) -> dict[str, int]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


@pytest.mark.parametrize("path, make", [("/v1/completions", completion), ("/v1/chat/completions", chat)])
@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("token_ids", [False, True])
def test_gateway_answers_what_a_replica_answers(fleet: Fleet, serve_gateway: ServeGateway, path: str,
                                                make: Any, streaming: bool, token_ids: bool) -> None:
    gw = serve_gateway()
    extra = {"return_token_ids": True} if token_ids else {}
    body = make("The gateway passes this through", max_tokens=12, stream=streaming,
                stream_options={"include_usage": True} if streaming else None, **extra)

    through, reference = via(gw.url, path, body), direct(fleet, path, body)

    assert through.status_code == reference.status_code == 200, through.text
    summary = stream_summary if streaming else full_summary
    assert summary(through) == summary(reference)
    assert through.headers["x-replica-id"] in fleet.replicas
    [trace] = gw.traces
    assert trace.status == 200 and trace.output_tokens == 12 and trace.endpoint == path
    assert trace.decode_s is not None and trace.gateway_s >= 0 and trace.replica_id in fleet.replicas


def test_stream_without_include_usage_ends_like_a_replicas(fleet: Fleet, serve_gateway: ServeGateway) -> None:
    gw = serve_gateway()
    body = completion("No usage asked", max_tokens=5, stream=True)

    events = sse_payloads(via(gw.url, "/v1/completions", body).text)

    assert events[-1] == "[DONE]" and not any(e.get("usage") for e in events[:-1])
    assert events[-2]["usage"] is None and events[-2]["choices"][0]["finish_reason"] == "length"
    assert not any("token_ids" in e["choices"][0] for e in events[:-1])


def test_models_are_aggregated_and_deduplicated(serve_gateway: ServeGateway) -> None:
    gw = serve_gateway()

    response = httpx.get(f"{gw.url}/v1/models", timeout=10)

    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [MODEL_ID]
    assert httpx.get(f"{gw.url}/health", timeout=10).json()["routable"] == ["r0", "r1", "r2"]


def test_api_key_is_required_when_configured(serve_gateway: ServeGateway) -> None:
    gw = serve_gateway(api_keys=["sk-gateway-test"])
    body = completion("Who are you?", max_tokens=2)

    missing = via(gw.url, "/v1/completions", body)
    wrong = via(gw.url, "/v1/completions", body, authorization="Bearer sk-wrong")
    right = via(gw.url, "/v1/completions", body, authorization="Bearer sk-gateway-test")

    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200
    assert gw.traces[-1].api_key_id and "sk-gateway-test" not in repr(gw.traces)


def test_replica_refusing_with_503_is_retried_elsewhere(fleet: Fleet, serve_gateway: ServeGateway) -> None:
    gw = serve_gateway(routing="least-request")  # idle fleet: ties go to r0, the faulty one
    fault = fleet.admin("r0", "PUT", {"kind": "error_rate", "probability": 1, "status_code": 503,
                                      "duration_s": 5})
    assert fault.status_code == 201, fault.text
    try:
        streamed = via(gw.url, "/v1/completions", completion("Retry me", max_tokens=4, stream=True))
        plain = via(gw.url, "/v1/chat/completions", chat("Retry me", max_tokens=4))
    finally:
        fleet.admin("r0", "DELETE")

    for response in (streamed, plain):
        assert response.status_code == 200, response.text
        assert response.headers["x-replica-id"] != "r0"
    assert [t.retries for t in gw.traces] == [1, 1]
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert 'llmsre_gateway_retries_total{reason="status_503",replica="r0"} 2.0' in metrics


def test_saturated_fleet_sheds_batch_first_with_429_before_any_stream(fleet: Fleet,
                                                                      serve_gateway: ServeGateway) -> None:
    gw = serve_gateway(max_inflight_per_replica=4, retry_after_s=2)  # batch shed at 2, the others at 4
    short = completion("Am I admitted?", max_tokens=2)

    async def scenario() -> None:
        async def hold(n: int) -> asyncio.Task[list[StreamResult]]:
            results = [StreamResult("/v1/completions", completion(f"hold {i}", max_tokens=LONG,
                                                                  ignore_eos=True),
                                    headers={"x-priority": "interactive"}) for i in range(n)]
            task = asyncio.create_task(run_streams(gw.url, results))
            await asyncio.to_thread(wait_until, lambda: all(r.events for r in results), timeout=30,
                                    what="the holding streams to flow")
            return task

        holders = [await hold(6)]  # two in flight on every replica
        try:
            assert sorted(gw.gateway.inflight().values()) == [2, 2, 2]
            batch = await asyncio.to_thread(via, gw.url, "/v1/completions", short, **{"x-priority": "batch"})
            standard = await asyncio.to_thread(via, gw.url, "/v1/completions", short)
            interactive = await asyncio.to_thread(via, gw.url, "/v1/completions", short,
                                                  **{"x-priority": "interactive"})
            assert batch.status_code == 429 and batch.headers["retry-after"] == "2"
            assert batch.json()["error"]["type"] == "rate_limit_error"
            assert standard.status_code == 200 and interactive.status_code == 200
            holders.append(await hold(6))  # four on every replica: full for everyone
            assert sorted(gw.gateway.inflight().values()) == [4, 4, 4]
            streamed = await asyncio.to_thread(via, gw.url, "/v1/completions", {**short, "stream": True},
                                               **{"x-priority": "interactive"})
            assert streamed.status_code == 429 and streamed.headers["retry-after"] == "2"
            assert streamed.headers["content-type"].startswith("application/json")
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)

    asyncio.run(scenario())
    wait_until(lambda: not gw.gateway.inflight(), timeout=10, what="cancelled streams to be released")
    shed = [t for t in gw.traces if t.status == 429]
    assert sorted(t.priority for t in shed) == ["batch", "interactive"]


def running_on(fleet: Fleet, replica_id: str) -> float:
    page = httpx.get(f"{fleet.replicas[replica_id].base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("vllm:num_requests_running"))


def test_client_leaving_mid_stream_stops_the_replica_request(fleet: Fleet,
                                                             serve_gateway: ServeGateway) -> None:
    gw = serve_gateway()
    body = completion("Stop generating when I leave", max_tokens=LONG, ignore_eos=True, stream=True)
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", f"{gw.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        replica = response.headers["x-replica-id"]
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")), "no first chunk"
        assert running_on(fleet, replica) == 1
    # the client closed its connection after one chunk of LONG: the gateway notices, ends its upstream
    # stream (the replica aborts the request) and records the request as left by its client
    wait_until(lambda: not gw.gateway.inflight(), timeout=10, what="the gateway to release the stream")
    wait_until(lambda: running_on(fleet, replica) == 0, timeout=10, what="the replica to abort it")
    wait_until(lambda: len(gw.traces) == 1, timeout=10, what="the request's trace")
    trace = gw.traces[0]
    assert trace.status == 200 and trace.error == "client disconnected"
    assert 0 < trace.output_tokens < LONG
