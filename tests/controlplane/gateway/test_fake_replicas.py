"""The gateway's behaviour against in-process fake replicas: fast, no processes, no sockets.

What the real-replica tests show end to end (test_passthrough, test_failover), shown here in every
variant cheaply: resumes after resets, stalls and error frames for both endpoints, streaming or not;
retries; ejection and re-admission; admission (keys, priorities, shedding, rate limits); traces.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from controlplane.gateway.admission import RetryBudget, TokenBucket, shed_limit
from controlplane.gateway.assembly import RequestParams, StreamAssembly
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.handler import Gateway
from controlplane.gateway.server import create_gateway_app
from controlplane.gateway.slices import SlicePlan
from controlplane.replicas import ReplicaState
from controlplane.traces import TraceRecord
from inference.logprobs import LogprobEntry, read_chat_logprobs, read_completion_logprobs

from .fakes import (
    MODEL,
    FakeFleet,
    encode,
    expected_completion,
    expected_logprobs,
    sse_payloads,
    stream_text,
    stream_token_ids,
)

COMPLETION = {"model": MODEL, "prompt": "Resume me, please", "max_tokens": 24, "temperature": 0.0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 24,
        "temperature": 0.0}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A gateway over a fake fleet, called in-process through ASGI."""

    def __init__(self, fleet: FakeFleet, slices: Callable[[], SlicePlan] = SlicePlan, **config: Any) -> None:
        self.fleet = fleet
        self.traces: list[TraceRecord] = []
        self.events: list[tuple[str, str, str]] = []
        self.clock = FakeClock()
        self.config = GatewayConfig(**{"stall_timeout_s": 0.2, "first_byte_timeout_s": 0.5, **config})
        self.gateway = Gateway(self.config, endpoints=fleet.endpoints, on_trace=self.traces.append,
                               on_event=lambda *event: self.events.append(event), clock=self.clock,
                               transport=fleet.transport, slices=slices)
        transport = httpx.ASGITransport(app=create_gateway_app(self.gateway))
        self.client = httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=10)

    async def post(self, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        return await self.client.post(path, json=body, headers=headers)

    async def close(self) -> None:
        await self.client.aclose()
        await self.gateway.stop()


def run(body: Callable[[Harness], Awaitable[None]], fleet: FakeFleet | None = None, **config: Any) -> None:
    """Run an async test body against a gateway over ``fleet`` (three healthy fakes by default)."""
    async def main() -> None:
        harness = Harness(fleet or FakeFleet(), **config)
        try:
            await body(harness)
        finally:
            await harness.close()
    asyncio.run(main())


def path_of(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def body_of(kind: str, **fields: Any) -> dict[str, Any]:
    return {**(CHAT if kind == "chat" else COMPLETION), **fields}


# ---- passthrough -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_passes_through_without_token_ids_unless_asked(kind: str) -> None:
    async def body(h: Harness) -> None:
        plain = await h.post(path_of(kind), body_of(kind, stream=True))
        with_ids = await h.post(path_of(kind), body_of(kind, stream=True, return_token_ids=True,
                                                       stream_options={"include_usage": True}))
        tokens, text = expected_completion(kind, body_of(kind))

        assert plain.status_code == 200 and plain.headers["x-replica-id"] in h.fleet.replicas
        events = sse_payloads(plain.text)
        assert events[-1] == "[DONE]" and stream_text(events) == text
        assert not any("token_ids" in c["choices"][0] for c in events[:-1] if c["choices"])
        assert events[-2]["usage"] is None and events[-2]["choices"][0]["finish_reason"] == "length"
        assert "timings" in events[-2]
        ids_events = sse_payloads(with_ids.text)
        assert stream_token_ids(ids_events) == tokens
        assert ids_events[-2]["usage"]["completion_tokens"] == len(tokens)
        assert "prompt_token_ids" in ids_events[0]
        sent = h.fleet["r0"].requests[0][1]
        assert sent["return_token_ids"] is True and sent["stream"] is True and sent["priority"] == 1
    run(body)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_non_streaming_request_is_assembled_from_the_stream(kind: str) -> None:
    async def body(h: Harness) -> None:
        response = await h.post(path_of(kind), body_of(kind))
        tokens, text = expected_completion(kind, body_of(kind))

        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == text
        assert "token_ids" not in choice and "prompt_token_ids" not in data
        assert data["usage"]["completion_tokens"] == len(tokens)
        assert data["object"] == ("chat.completion" if kind == "chat" else "text_completion")
        assert response.headers["x-replica-id"] == "r0"
    run(body)


# ---- resume ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("failure", ["break_after", "stall_after", "error_frame_after"])
@pytest.mark.parametrize("at", [0, 1, 7, 11])
def test_broken_stream_resumes_elsewhere_without_lost_or_duplicated_tokens(
        kind: str, stream: bool, failure: str, at: int) -> None:
    fleet = FakeFleet()
    setattr(fleet["r0"].behaviour, failure, at)

    async def body(h: Harness) -> None:
        request = body_of(kind, stream=stream, return_token_ids=True, stream_options={"include_usage": True})
        response = await h.post(path_of(kind), request)
        tokens, text = expected_completion(kind, body_of(kind))

        assert response.status_code == 200, response.text
        if stream:
            events = sse_payloads(response.text)
            assert events[-1] == "[DONE]"
            got_tokens, got_text, usage = stream_token_ids(events), stream_text(events), events[-2]["usage"]
            assert events[0]["prompt_token_ids"] == encode(kind, request)
            assert sum("prompt_token_ids" in e for e in events[:-1]) == 1
        else:
            data = response.json()
            choice = data["choices"][0]
            got_tokens, usage = choice["token_ids"], data["usage"]
            got_text = choice["message"]["content"] if kind == "chat" else choice["text"]
        assert got_tokens == tokens and got_text == text
        assert usage["completion_tokens"] == len(tokens)
        assert usage["prompt_tokens"] == len(encode(kind, request))
        [trace] = h.traces
        assert trace.replica_id == "r1" and trace.status == 200 and trace.error is None
        stalled = [("stalled", "r0")] if failure == "stall_after" else []  # a silence is told apart
        if at == 0:  # broken before the first token: an ordinary retry, the client saw nothing yet
            assert (trace.retries, trace.resumes) == (1, 0)
            assert [e[:2] for e in h.events] == stalled
        else:
            assert (trace.retries, trace.resumes) == (0, 1)
            assert [e[:2] for e in h.events] == [*stalled, ("resumed", "r0")]
        resumed_path, resumed = h.fleet["r1"].requests[0]
        if resumed.get("output_offset"):  # a continuation: a completion request even for chat
            assert resumed_path == "/v1/completions"
            assert resumed["prompt"][:len(encode(kind, request))] == encode(kind, request)
    run(body, fleet)


LOGPROBS = {"chat": {"logprobs": True, "top_logprobs": 2}, "completion": {"logprobs": 2}}
BAD_LOGPROBS: dict[str, dict[str, Any]] = {
    "chat": {"missing token": {"content": [{"logprob": -1.0}]},
             "null logprob": {"content": [{"token": "x", "logprob": None, "top_logprobs": []}]},
             "not an object": "garbage",
             "not one entry per token": {"content": []}},
    "completion": {"missing token": {"token_logprobs": [-1.0], "top_logprobs": [{}]},
                   "null logprob": {"tokens": ["x"], "token_logprobs": [None]},
                   "not an object": "garbage",
                   "not one entry per token": {"tokens": ["x", "y"], "token_logprobs": [-1.0, -2.0]}},
}


def shown_logprobs(kind: str, response: httpx.Response, *, stream: bool) -> list[LogprobEntry]:
    """Every token's logprobs as the client got them, read back in order."""
    if stream:
        events = sse_payloads(response.text)
        choices = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
    else:
        choices = [response.json()["choices"][0]]
    if kind == "chat":
        return [e for c in choices for e in read_chat_logprobs(c["logprobs"])]
    return [e for c in choices for e in read_completion_logprobs(c["logprobs"], 2)]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("malformed", list(BAD_LOGPROBS["chat"]))
def test_malformed_logprobs_from_a_replica_resume_the_stream_elsewhere(kind: str, stream: bool,
                                                                        malformed: str) -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.bad_logprobs_after = 7
    fleet["r0"].behaviour.bad_logprobs = BAD_LOGPROBS[kind][malformed]

    async def body(h: Harness) -> None:
        request = body_of(kind, stream=stream, return_token_ids=True, **LOGPROBS[kind])
        response = await h.post(path_of(kind), request)
        tokens, text = expected_completion(kind, request)

        assert response.status_code == 200, response.text
        if stream:
            events = sse_payloads(response.text)
            assert events[-1] == "[DONE]"
            got_tokens, got_text = stream_token_ids(events), stream_text(events)
        else:
            choice = response.json()["choices"][0]
            got_tokens = choice["token_ids"]
            got_text = choice["message"]["content"] if kind == "chat" else choice["text"]
        assert (got_tokens, got_text) == (tokens, text)
        # Each token's logprobs exactly once, those of the tokens before the bad chunk included.
        assert shown_logprobs(kind, response, stream=stream) == expected_logprobs(kind, request)
        [trace] = h.traces
        assert (trace.replica_id, trace.status, trace.error, trace.resumes) == ("r1", 200, None, 1)
        assert ("resumed", "r0") in [e[:2] for e in h.events]
        metrics = (await h.client.get("/metrics")).text
        assert 'llmsre_gateway_resumes_total{reason="bad_event",replica="r0"} 1.0' in metrics
    run(body, fleet)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [True, False])
def test_malformed_logprobs_from_every_replica_fail_in_the_openai_error_shape(kind: str,
                                                                              stream: bool) -> None:
    fleet = FakeFleet()
    for replica in fleet.replicas.values():
        replica.behaviour.bad_logprobs_after = 3

    async def body(h: Harness) -> None:
        response = await h.post(path_of(kind), body_of(kind, stream=stream, **LOGPROBS[kind]))

        if stream:
            events = sse_payloads(response.text)
            assert response.status_code == 200 and "[DONE]" not in events
            error = events[-1]["error"]
        else:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "service_unavailable"
        assert h.traces[-1].error is not None
        assert [e[:2] for e in h.events] == [("resumed", "r0"), ("resumed", "r1"), ("resumed", "r2")]
    run(body, fleet)


def test_continuation_starts_at_the_last_released_text_and_carries_sampling() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.break_after = 9

    async def body(h: Harness) -> None:
        request = body_of("chat", stream=True, seed=5, temperature=0.7, top_p=0.9, top_k=20, stop=["\n\n"],
                          ignore_eos=True, min_tokens=12)
        await h.post("/v1/chat/completions", request)

        path, sent = h.fleet["r1"].requests[0]
        first = h.fleet["r0"].requests[0][1]
        assert path == "/v1/completions"
        k = sent["output_offset"]
        assert 0 < k <= 9 and sent["max_tokens"] == 24 - k and sent["min_tokens"] == 12 - k
        assert {f: sent[f] for f in ("seed", "temperature", "top_p", "top_k", "stop", "ignore_eos")} == {
            "seed": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": ["\n\n"], "ignore_eos": True}
        assert first["stream_options"] == {"include_usage": True}
    run(body, fleet)


def test_unseeded_sampling_resumes_right_after_the_last_token_sent() -> None:
    params = RequestParams.parse("completion", {"prompt": "x", "max_tokens": 8, "temperature": 1.0})
    assembly = StreamAssembly(params)
    assembly.accept({"id": "c", "choices": [{"text": "a", "token_ids": [5]}], "prompt_token_ids": [1, 2]})
    assembly.accept({"id": "c", "choices": [{"text": "", "token_ids": [10]}]})

    _path, body = assembly.continuation(priority=1)

    assert not params.is_deterministic
    assert body["prompt"] == [1, 2, 5, 10] and body["output_offset"] == 2 and body["max_tokens"] == 6


def test_stop_strings_move_the_resume_point_back_by_what_the_replica_holds() -> None:
    params = RequestParams.parse("completion", {"prompt": "x", "max_tokens": 8, "temperature": 0,
                                                "stop": ["STOP!"]})
    assembly = StreamAssembly(params)
    assembly.accept({"id": "c", "choices": [{"text": "", "token_ids": [1]}], "prompt_token_ids": [9]})
    for token in (2, 3, 4, 5, 6):  # each token adds 2 characters; the replica holds 4 back
        assembly.accept({"id": "c", "choices": [{"text": "ab", "token_ids": [token]}]})

    num_done, chars = assembly.resume_point()

    assert params.hold == 4
    assert assembly.num_chars == 10 and chars <= 10
    assert (num_done, chars) == (4, 10)  # after token 4 the replica had decoded 6 + 4 = 10 characters


def test_a_stream_that_breaks_on_every_replica_ends_with_an_error_frame() -> None:
    fleet = FakeFleet()

    async def body(h: Harness) -> None:
        for r in h.fleet.replicas.values():
            r.behaviour.break_after = 3
        response = await h.post("/v1/completions", body_of("completion", stream=True))

        events = sse_payloads(response.text)
        assert response.status_code == 200
        assert "error" in events[-1] and "[DONE]" not in events
        assert h.traces[-1].error is not None
    run(body, fleet)


# ---- retries, ejection, re-admission -------------------------------------------------------
def test_5xx_before_the_first_byte_is_retried_on_another_replica() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.refuse_status = 503

    async def body(h: Harness) -> None:
        response = await h.post("/v1/completions", body_of("completion"))

        assert response.status_code == 200 and response.headers["x-replica-id"] == "r1"
        assert h.traces[-1].retries == 1
        metrics = (await h.client.get("/metrics")).text
        assert 'llmsre_gateway_retries_total{reason="status_503",replica="r0"} 1.0' in metrics
    run(body, fleet)


def test_a_4xx_is_the_clients_answer_and_is_not_retried() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.refuse_status = 400

    async def body(h: Harness) -> None:
        response = await h.post("/v1/completions", body_of("completion"))

        assert response.status_code == 400 and response.json()["error"]["message"] == "refused by r0"
        assert len(h.fleet["r1"].requests) == 0
    run(body, fleet)


def test_when_every_replica_refuses_the_client_gets_the_last_refusal() -> None:
    fleet = FakeFleet()

    async def body(h: Harness) -> None:
        for r in h.fleet.replicas.values():
            r.behaviour.refuse_status = 429
        response = await h.post("/v1/completions", body_of("completion", stream=True))

        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert set(response.json()) == {"error"}
        assert not h.gateway.ejected()  # busy is not broken
    run(body, fleet)


def test_retries_stop_when_the_budget_is_spent() -> None:
    clock = FakeClock()
    budget = RetryBudget(0.2, clock=clock, window_s=10, min_retries=1)
    for _ in range(10):
        budget.record_request()

    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    clock.now += 11
    assert budget.try_spend()  # the window moved on


def test_a_budget_that_never_retries_remembers_only_its_window() -> None:
    """Requests are forgotten as the window moves on, not only when a retry is asked for: a gateway whose
    replicas never fail would otherwise keep the time of every request it ever served."""
    clock = FakeClock()
    budget = RetryBudget(0.2, clock=clock, window_s=10, min_retries=1)
    for _ in range(2_000):
        budget.record_request()
        clock.now += 0.1
    assert budget.num_remembered <= 101
    assert budget.try_spend()


def test_a_spent_budget_stops_retries_of_refusals_but_not_moves_off_a_silent_replica() -> None:
    # ratio 0: only the floor of 3 retries per window. r0 is tried first on every request (least-request
    # ties go to r0, and it is never ejected here).
    def fleet_with(**behaviour: Any) -> FakeFleet:
        fleet = FakeFleet()
        for name, value in behaviour.items():
            setattr(fleet["r0"].behaviour, name, value)
        return fleet

    async def refused(h: Harness) -> None:
        codes = [(await h.post("/v1/completions", body_of("completion"))).status_code for _ in range(5)]

        assert codes == [200, 200, 200, 500, 500]  # the replica answered: a retry, within the budget
    run(refused, fleet_with(refuse_status=500), routing="least-request", retry_budget_ratio=0.0,
        eject_after_failures=100)

    async def silent(h: Harness) -> None:
        async def one() -> int:
            return (await h.post("/v1/completions", body_of("completion"))).status_code

        requests = asyncio.gather(*(one() for _ in range(5)))  # all to r0, the only one ready yet
        await asyncio.sleep(0.05)
        for rid in ("r1", "r2"):
            h.fleet[rid].state = ReplicaState.READY

        assert await requests == [200] * 5  # r0 went silent: all five moved at once, none refused
        assert len(h.fleet["r1"].requests) + len(h.fleet["r2"].requests) == 5
    fleet = fleet_with(unanswered=True)
    for rid in ("r1", "r2"):
        fleet[rid].state = ReplicaState.STARTING
    run(silent, fleet, retry_budget_ratio=0.0, eject_after_failures=100)


def test_consecutive_failures_eject_and_the_probe_readmits() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.unreachable = True

    async def body(h: Harness) -> None:
        for _ in range(3):
            assert (await h.post("/v1/completions", body_of("completion"))).status_code == 200

        assert h.gateway.ejected() == {"r0"}
        assert ("ejected", "r0") in [e[:2] for e in h.events]
        h.fleet["r0"].behaviour.unreachable = False
        h.fleet["r0"].behaviour.ready = False
        await h.gateway.probe_once()
        assert h.gateway.ejected() == {"r0"}
        h.fleet["r0"].behaviour.ready = True
        await h.gateway.probe_once()
        assert h.gateway.ejected() == set()
        assert ("readmitted", "r0") in [e[:2] for e in h.events]
        assert 'llmsre_gateway_ejections_total{replica="r0"} 1.0' in (await h.client.get("/metrics")).text
    run(body, fleet, routing="least-request", eject_after_failures=3)  # ties: r0 first


# ---- active health checks --------------------------------------------------------------------
def test_an_idle_replica_that_hangs_is_routed_around_before_a_request_finds_it() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.hang_after = 0  # nothing in flight there: only a probe can tell

    async def body(h: Harness) -> None:
        await h.gateway.probe_once()  # r0 leaves /ready unanswered for the stall timeout (0.2 s)
        started = asyncio.get_running_loop().time()
        response = await h.post("/v1/completions", body_of("completion", stream=True))

        assert response.status_code == 200 and response.headers["x-replica-id"] == "r1"
        assert asyncio.get_running_loop().time() - started < h.config.stall_timeout_s  # no wait on r0
        assert h.fleet["r0"].requests == []
        assert "x-gateway-tried" not in response.headers
        assert ("stalled", "r0", "it left a readiness probe unanswered for 0.2s") in h.events
    run(body, fleet, routing="least-request")  # ties: r0 first


def test_a_request_waiting_for_headers_moves_as_soon_as_its_replica_is_found_silent() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.unanswered = True  # a stopped process: takes connections, answers nothing

    async def body(h: Harness) -> None:
        probe = asyncio.create_task(h.gateway.probe_once())  # r0 is idle: asked now, found silent at 0.4 s
        await asyncio.sleep(0.1)
        response = await h.post("/v1/completions", body_of("completion"))  # its own header wait: to 0.5 s
        await probe

        assert response.headers["x-replica-id"] == "r1" and response.headers["x-gateway-tried"] == "r0"
        metrics = (await h.client.get("/metrics")).text
        # moved, not timed out
        assert 'llmsre_gateway_retries_total{reason="stall",replica="r0"} 1.0' in metrics
    run(body, fleet, routing="least-request", stall_timeout_s=0.4)


def test_an_idle_replica_that_says_it_cannot_serve_is_ejected_at_once_and_readmitted_when_ready() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.ready = False  # /ready answers 503 (a failed device)

    async def body(h: Harness) -> None:
        await h.gateway.probe_once()
        response = await h.post("/v1/completions", body_of("completion"))

        assert h.gateway.ejected() == {"r0"}
        assert ("ejected", "r0", "/ready failed: HTTP 503") in h.events
        assert response.headers["x-replica-id"] == "r1" and h.fleet["r0"].requests == []
        h.fleet["r0"].behaviour.ready = True
        await h.gateway.probe_once()
        assert h.gateway.ejected() == set()
        assert (await h.post("/v1/completions", body_of("completion"))).headers["x-replica-id"] == "r0"
    run(body, fleet, routing="least-request")


def test_a_stalled_replica_that_answers_its_probe_is_routed_to_again() -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.hang_after = 0

    async def body(h: Harness) -> None:
        first = await h.post("/v1/completions", body_of("completion", stream=True))
        assert first.headers["x-replica-id"] == "r1" and first.headers["x-gateway-tried"] == "r0"
        h.fleet["r0"].behaviour.hang_after = None  # the hang ends; nothing is sent to r0 meanwhile
        assert (await h.post("/v1/completions", body_of("completion"))).headers["x-replica-id"] == "r1"

        await h.gateway.probe_once()
        after = await h.post("/v1/completions", body_of("completion"))

        assert after.status_code == 200 and after.headers["x-replica-id"] == "r0"
        assert len(h.fleet["r0"].requests) == 2
        assert [e[:2] for e in h.events] == [("stalled", "r0"), ("recovered", "r0")]
        assert h.events[-1][2] == "it passed a readiness probe"
    run(body, fleet, routing="least-request")


# ---- admission -------------------------------------------------------------------------------
def test_api_keys_are_required_when_configured_and_traced_as_a_hash() -> None:
    async def body(h: Harness) -> None:
        missing = await h.post("/v1/completions", body_of("completion"))
        wrong = await h.post("/v1/completions", body_of("completion"), authorization="Bearer nope")
        models = await h.client.get("/v1/models")
        ok = await h.post("/v1/completions", body_of("completion"), authorization="Bearer sk-right")

        for response in (missing, wrong, models):
            assert response.status_code == 401
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert ok.status_code == 200
        assert h.traces[-1].api_key_id == hashlib.sha256(b"sk-right").hexdigest()[:12]
        assert all("sk-right" not in repr(t) for t in h.traces)
    run(body, api_keys=["sk-other", "sk-right"])


def test_models_are_aggregated_over_routable_replicas() -> None:
    async def body(h: Harness) -> None:
        response = await h.client.get("/v1/models")

        assert response.status_code == 200
        assert [m["id"] for m in response.json()["data"]] == [MODEL]
    run(body)


def test_priority_header_maps_to_the_replica_priority_and_bad_values_are_refused() -> None:
    async def body(h: Harness) -> None:
        for header, expected in (("interactive", 0), ("standard", 1), ("batch", 2)):
            response = await h.post("/v1/completions", body_of("completion"), **{"x-priority": header})
            assert response.status_code == 200
            assert h.fleet["r0"].requests[-1][1]["priority"] == expected
            assert h.traces[-1].priority == header
        bad = await h.post("/v1/completions", body_of("completion"), **{"x-priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-priority"
    run(body)


def test_shed_limits_put_batch_first_and_interactive_last() -> None:
    assert [shed_limit(p, 64) for p in ("batch", "standard", "interactive")] == [32, 58, 64]
    assert [shed_limit(p, 1) for p in ("batch", "standard", "interactive")] == [1, 1, 1]


def test_no_routable_replica_is_503() -> None:
    fleet = FakeFleet()
    for r in fleet.replicas.values():
        r.state = ReplicaState.DRAINING

    async def body(h: Harness) -> None:
        response = await h.post("/v1/completions", body_of("completion", stream=True))

        assert response.status_code == 503 and response.json()["error"]["code"] == "no_replica"
        assert h.traces[-1].status == 503 and h.traces[-1].replica_id is None
    run(body, fleet)


def test_request_rate_limit_answers_429_with_retry_after_per_key() -> None:
    async def body(h: Harness) -> None:
        first = await h.post("/v1/completions", body_of("completion"), authorization="Bearer a")
        second = await h.post("/v1/completions", body_of("completion"), authorization="Bearer a")
        other_key = await h.post("/v1/completions", body_of("completion"), authorization="Bearer b")
        h.clock.now += 2.0
        later = await h.post("/v1/completions", body_of("completion"), authorization="Bearer a")

        assert first.status_code == 200 and other_key.status_code == 200 and later.status_code == 200
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
        assert second.json()["error"]["code"] == "rate_limit_exceeded"
    run(body, rate_limit_rps=0.5)


def test_token_bucket_charges_prompt_and_max_tokens() -> None:
    bucket = TokenBucket.full(100.0, now=0.0)

    assert bucket.seconds_until(80, now=0.0) == 0.0
    bucket.take(80)
    assert bucket.seconds_until(80, now=0.0) == pytest.approx(0.6)
    assert bucket.seconds_until(80, now=0.6) == 0.0
    assert bucket.seconds_until(1000, now=1.6) == 0.0  # bigger than the bucket: waits for a full one


# ---- traces ----------------------------------------------------------------------------------
def test_trace_carries_stage_timings_and_gateway_time() -> None:
    async def body(h: Harness) -> None:
        response = await h.post("/v1/completions", body_of("completion", stream=True))

        assert response.status_code == 200
        [trace] = h.traces
        assert trace.queue_s == 0.001 and trace.prefill_s == 0.002 and trace.decode_s == 0.003
        assert trace.gateway_s == 0.0  # the fake clock did not move: clamped at 0
        assert trace.output_tokens == 24 and trace.prompt_tokens > 0 and trace.zone == "az-a"
        assert trace.endpoint == "/v1/completions" and trace.model == MODEL
    run(body)
