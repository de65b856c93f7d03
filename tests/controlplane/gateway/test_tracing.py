"""OpenTelemetry traces: the gateway's spans and the replicas', joined by W3C ``traceparent`` and exported
over OTLP/HTTP to a real receiver in the test (:mod:`.otlp`, decoding with opentelemetry-proto).

The fast tests run the gateway in-process over fake replicas (:mod:`.fakes`); the slow one runs a gateway
process and two replica processes and resumes a stream on the second replica after a device failure on
the first, as a client with its own trace sees it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.gateway.config import GatewayConfig, gateway_problems
from controlplane.gateway.handler import Gateway
from controlplane.gateway.process import write_config
from controlplane.gateway.server import create_gateway_app
from controlplane.gateway.tracing import CLIENT_CANCELLED, CLIENT_DISCONNECTED
from controlplane.traces import TraceRecord
from inference.config import TracingConfig
from inference.launcher import ReplicaProcess, free_port
from inference.tracing import SHUTDOWN_TIMEOUT_S, extract, start_provider, stop_provider
from tests.polling import wait_until

from .conftest import ADMIN_TOKEN, Fleet
from .fakes import MODEL, FakeFleet, sse_payloads, stream_token_ids
from .otlp import OtlpReceiver, ReceivedSpan

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = "traceparent"
REPLICA = "llmsre.replica.id"
SAMPLED = 0x01  # the sampled bit of traceparent's flags (W3C Trace Context)
COMPLETION = {"model": MODEL, "prompt": "Trace me, please", "max_tokens": 24, "temperature": 0.0,
              "stream": True, "return_token_ids": True}


def client_traceparent(flags: str = "01") -> dict[str, str]:
    return {TRACEPARENT: f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-{flags}"}


def parse_traceparent(header: str) -> tuple[str, str, str]:
    """(trace id, parent span id, flags) of a ``traceparent`` header."""
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16
    return trace_id, span_id, flags


def exporter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]


class RecordingTransport(httpx.AsyncBaseTransport):
    """The fake fleet's transport, keeping the headers of every inference request sent upstream."""

    def __init__(self, fleet: FakeFleet) -> None:
        self.inner = fleet.transport
        self.sent: list[tuple[int | None, dict[str, str]]] = []  # (replica port, headers)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.startswith("/v1/"):
            self.sent.append((request.url.port, dict(request.headers)))
        return await self.inner.handle_async_request(request)

    def traceparents(self) -> list[str | None]:
        return [headers.get(TRACEPARENT) for _, headers in self.sent]


Body = Callable[[httpx.AsyncClient, Gateway], Awaitable[None]]


def serve(fleet: FakeFleet, body: Body, **config: Any) -> tuple[list[TraceRecord], RecordingTransport]:
    """``body`` against a started gateway over ``fleet``; the gateway is stopped (its spans flushed) after."""
    traces: list[TraceRecord] = []
    transport = RecordingTransport(fleet)

    async def main() -> None:
        gateway = Gateway(GatewayConfig(stall_timeout_s=0.5, first_byte_timeout_s=1.0, **config),
                          endpoints=fleet.endpoints, on_trace=traces.append, transport=transport)
        await gateway.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_gateway_app(gateway)),
                                   base_url="http://gateway", timeout=10)
        try:
            await body(client, gateway)
        finally:
            await client.aclose()
            await gateway.stop()

    asyncio.run(main())
    return traces, transport


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_ns)


# ---- off by default --------------------------------------------------------------------------
def test_with_tracing_off_no_exporter_runs_and_no_traceparent_is_created() -> None:
    before = exporter_threads()

    async def body(client: httpx.AsyncClient, gateway: Gateway) -> None:
        plain = await client.post("/v1/completions", json=COMPLETION)
        traced = await client.post("/v1/completions", json=COMPLETION, headers=client_traceparent())
        assert plain.status_code == traced.status_code == 200
        assert gateway.tracing is None and exporter_threads() == before

    traces, sent = serve(FakeFleet(), body)
    assert GatewayConfig().otlp_traces_endpoint == ""  # off unless configured
    assert len(sent.sent) == 2 and sent.traceparents() == [None, None]  # none created, none passed on
    assert [t.trace_id for t in traces] == [None, None]


def test_with_tracing_off_the_sdk_and_exporter_are_never_imported() -> None:
    modules = subprocess.run(
        [sys.executable, "-c", "import sys, controlplane.gateway.process, inference.server; "
                               "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    assert "opentelemetry.trace" in modules  # the API, for traceparent, which fastapi imports as well
    assert "opentelemetry.sdk" not in modules and "opentelemetry.exporter" not in modules


# ---- the gateway's tree over fake replicas ---------------------------------------------------------
def test_a_resumed_request_keeps_the_clients_trace_with_one_span_per_attempt(receiver: OtlpReceiver) -> None:
    fleet = FakeFleet()
    fleet["r0"].behaviour.error_frame_after = 7  # r0 breaks its stream after 7 tokens: resumed elsewhere
    payloads: list[Any] = []
    before = exporter_threads()

    async def body(client: httpx.AsyncClient, gateway: Gateway) -> None:
        response = await client.post("/v1/completions", json=COMPLETION, headers=client_traceparent())
        assert response.status_code == 200 and response.headers["x-replica-id"] == "r0"
        assert len(exporter_threads()) == len(before) + 1  # the gateway's batch exporter
        payloads.extend(sse_payloads(response.text))

    traces, sent = serve(fleet, body, otlp_traces_endpoint=receiver.url)
    assert payloads[-1] == "[DONE]" and len(stream_token_ids(payloads)) == 24  # the client lost nothing
    assert [t.trace_id for t in traces] == [CLIENT_TRACE]  # the row the console shows names the trace
    assert exporter_threads() == before  # the exporter stopped with the gateway

    spans = receiver.of_trace(CLIENT_TRACE)
    (request,) = by_name(spans, "POST /v1/completions")
    assert request.parent_id == CLIENT_SPAN and request.kind == "SERVER"
    assert request.service == "llm-sre-gateway"
    assert request.attributes["gen_ai.operation.name"] == "text_completion"
    assert request.attributes["gen_ai.request.model"] == MODEL
    assert request.attributes["gen_ai.request.max_tokens"] == 24
    assert request.attributes["gen_ai.usage.output_tokens"] == 24
    assert request.attributes["llmsre.resumes"] == 1 and not request.is_error
    first, resume = by_name(spans, "upstream first") + by_name(spans, "upstream resume")
    assert first.parent_id == resume.parent_id == request.span_id
    assert first.kind == resume.kind == "CLIENT"
    assert first.attributes["llmsre.replica.id"] == "r0" and first.is_error
    assert first.attributes["error.type"] == "error_frame"
    assert resume.attributes["llmsre.replica.id"] != "r0" and not resume.is_error
    assert resume.attributes["llmsre.attempt.reason"] == "error_frame"
    assert resume.attributes["llmsre.resume.from_token"] == first.attributes["llmsre.attempt.tokens"] == 7
    assert first.attributes["llmsre.attempt.tokens"] + resume.attributes["llmsre.attempt.tokens"] == 24
    routes = by_name(spans, "route")
    assert [r.attributes["llmsre.route.replica"] for r in routes] == ["r0", resume.attributes[REPLICA]]
    assert {r.parent_id for r in routes} == {request.span_id}
    assert {r.attributes["llmsre.route.policy"] for r in routes} == {"score"}
    # each upstream request carried its own attempt's context, so a replica's spans are its children
    assert [parse_traceparent(h or "") for h in sent.traceparents()] == [
        (CLIENT_TRACE, first.span_id, "01"), (CLIENT_TRACE, resume.span_id, "01")]


def test_without_a_traceparent_the_gateway_starts_the_trace(receiver: OtlpReceiver) -> None:
    async def body(client: httpx.AsyncClient, gateway: Gateway) -> None:
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200

    traces, sent = serve(FakeFleet(), body, otlp_traces_endpoint=receiver.url)
    (trace_id,) = [t.trace_id for t in traces]
    assert trace_id is not None and trace_id != CLIENT_TRACE
    spans = receiver.of_trace(trace_id)
    (request,) = by_name(spans, "POST /v1/completions")
    (attempt,) = by_name(spans, "upstream first")
    assert request.parent_id == "" and attempt.parent_id == request.span_id  # the gateway's root span
    trace, parent, flags = parse_traceparent(sent.traceparents()[0] or "")
    assert (trace, parent) == (trace_id, attempt.span_id) and int(flags, 16) & SAMPLED


@pytest.mark.parametrize("case", ["client says not sampled", "ratio 0"])
def test_an_unsampled_request_exports_nothing_and_tells_the_replica_so(receiver: OtlpReceiver,
                                                                      case: str) -> None:
    headers = client_traceparent("00") if case == "client says not sampled" else {}
    ratio = 0.0 if case == "ratio 0" else 1.0

    async def body(client: httpx.AsyncClient, gateway: Gateway) -> None:
        assert (await client.post("/v1/completions", json=COMPLETION, headers=headers)).status_code == 200

    traces, sent = serve(FakeFleet(), body, otlp_traces_endpoint=receiver.url, otlp_sample_ratio=ratio)
    assert receiver.spans == [] and [t.trace_id for t in traces] == [None]
    # the replica learns the decision (the sampled flag clear), so it does not start a trace of its own
    (header,) = sent.traceparents()
    assert header is not None and int(parse_traceparent(header)[2], 16) & SAMPLED == 0


# ---- what a client can and cannot decide -------------------------------------------------------------
LOW_TRACE = "00000000000000000000000000000001"  # passes any ratio above 0 if sampled by trace id


@pytest.mark.parametrize(("trace_id", "ratio"), [(CLIENT_TRACE, 0.0), (LOW_TRACE, 1e-9)])
def test_a_clients_sampled_flag_does_not_overrule_the_ratio(receiver: OtlpReceiver, trace_id: str,
                                                            ratio: float) -> None:
    headers = {TRACEPARENT: f"00-{trace_id}-{CLIENT_SPAN}-01"}

    async def body(client: httpx.AsyncClient, gateway: Gateway) -> None:
        for _ in range(3):
            assert (await client.post("/v1/completions", json=COMPLETION, headers=headers)).status_code == 200

    traces, sent = serve(FakeFleet(), body, otlp_traces_endpoint=receiver.url, otlp_sample_ratio=ratio)
    assert receiver.spans == [] and [t.trace_id for t in traces] == [None] * 3
    # the replicas are told the gateway's decision (not sampled), under the client's trace id
    for header in sent.traceparents():
        trace, _, flags = parse_traceparent(header or "")
        assert trace == trace_id and int(flags, 16) & SAMPLED == 0


def test_a_replica_follows_its_parents_sampled_flag_whatever_its_ratio() -> None:
    provider = start_provider(TracingConfig("http://127.0.0.1:9/v1/traces", 0.0), service_name="replica",
                              attributes={})
    try:
        tracer = provider.get_tracer("test")
        assert tracer.start_span("followed", context=extract(client_traceparent("01"))).is_recording()
        assert not tracer.start_span("new trace").is_recording()  # ratio 0 for traces of its own
    finally:
        stop_provider(provider)


def test_a_client_leaving_mid_stream_is_recorded_but_not_as_an_error(receiver: OtlpReceiver) -> None:
    fleet = FakeFleet()
    for replica in fleet.replicas.values():
        replica.behaviour.stall_after = 3  # the stream is still running when the client leaves

    async def body(client: httpx.AsyncClient, gateway: Gateway) -> None:
        await leave_after_first_chunk(create_gateway_app(gateway), COMPLETION)

    traces, _ = serve(fleet, body, otlp_traces_endpoint=receiver.url)
    (trace,) = traces
    assert trace.status == 200 and trace.error == CLIENT_DISCONNECTED and trace.trace_id is not None
    (request,) = by_name(receiver.of_trace(trace.trace_id), "POST /v1/completions")
    assert not request.is_error and "error.type" not in request.attributes
    assert request.attributes[CLIENT_CANCELLED] is True


async def leave_after_first_chunk(app: Any, payload: dict[str, Any]) -> None:
    """One request straight to the ASGI ``app``, whose client disconnects once the first body chunk came."""
    content = json.dumps(payload).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 40000),
             "server": ("gateway", 80), "headers": [(b"host", b"gateway"), (b"content-type",
                                                    b"application/json"),
                                                   (b"content-length", str(len(content)).encode())]}
    requested, left = False, asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": content, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message["type"] == "http.response.body" and message.get("body"):
            left.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    assert left.is_set()


# ---- stopping --------------------------------------------------------------------------------------
@pytest.fixture
def silent_collector() -> Iterator[str]:
    """A collector that accepts connections and never answers (one that is overloaded or half gone)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"


def test_stop_waits_a_bounded_time_for_a_silent_collector_and_a_restart_exports_again(
        silent_collector: str) -> None:
    async def body(client: httpx.AsyncClient, gateway: Gateway) -> None:
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        first = gateway.tracing
        started = time.monotonic()
        await gateway.stop()  # a span is buffered: the last export never gets an answer
        assert time.monotonic() - started < SHUTDOWN_TIMEOUT_S + 2
        assert gateway.tracing is None
        await gateway.start()  # the next start gets a provider of its own, not the shut-down one
        assert gateway.tracing is not None and gateway.tracing is not first

    serve(FakeFleet(), body, otlp_traces_endpoint=silent_collector)


def test_the_endpoint_is_logged_without_credentials(caplog: pytest.LogCaptureFixture) -> None:
    config = TracingConfig("http://otel:s3cret@127.0.0.1:9/v1/traces?token=t0ken")
    with caplog.at_level(logging.WARNING, logger="inference.tracing"):
        stop_provider(start_provider(config, service_name="test", attributes={}))
    assert "http://127.0.0.1:9/v1/traces" in caplog.text
    assert "s3cret" not in caplog.text and "otel:" not in caplog.text and "t0ken" not in caplog.text


# ---- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("settings", "key"), [
    ({"otlp_traces_endpoint": "collector:4318"}, "gateway.otlp_traces_endpoint"),
    ({"otlp_traces_endpoint": "ftp://collector/v1/traces"}, "gateway.otlp_traces_endpoint"),
    ({"otlp_traces_endpoint": "http://c:4318", "otlp_sample_ratio": 1.5}, "gateway.otlp_sample_ratio"),
])
def test_bad_trace_settings_are_named(settings: dict[str, Any], key: str) -> None:
    problems = dict(gateway_problems(GatewayConfig(**settings)))
    assert key in problems and "must" in problems[key]


def test_a_replica_refuses_a_bad_trace_endpoint_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from inference.__main__ import main

    assert main(["serve", "--otlp-traces-endpoint", "collector:4318"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: otlp_traces_endpoint: must be an http(s) URL") and error.count("\n") == 1


def test_an_endpoint_without_a_path_gets_otlps_traces_path() -> None:
    assert GatewayConfig(otlp_traces_endpoint="http://collector:4318").tracing().traces_url == \
        "http://collector:4318/v1/traces"
    assert GatewayConfig(otlp_traces_endpoint="https://c.example/otlp/v1/traces").tracing().traces_url == \
        "https://c.example/otlp/v1/traces"
    assert gateway_problems(GatewayConfig(otlp_traces_endpoint="http://collector:4318")) == []


# ---- one trace from the client to the engines --------------------------------------------------
REPLICAS = (("r1", "az-a"), ("r2", "az-b"))
PROMPT = "A stream that breaks half-way is picked up by another replica, and the trace shows both"
MAX_TOKENS = 24
BREAK_AFTER = 4  # tokens the client has when the first replica's device fails
CHUNK_TOKENS = 8  # --max-num-batched-tokens: the prompt is prefilled in chunks of at most this many
STEP_DELAY_S = 0.3  # a token_latency fault on the replica that serves first: 6 s for the device fault to land
CLOCK_SLACK_NS = 250_000_000  # gateway and replica spans come from different processes' clocks


@pytest.fixture
def traced_fleet(state_dir: Path, tmp_path: Path, receiver: OtlpReceiver) -> Iterator[tuple[str, Fleet]]:
    """Two replicas and a gateway process, all exporting to ``receiver`` (every 0.1 s)."""
    env = {"LLMSRE_STATE_DIR": str(state_dir), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    fleet = Fleet(state_dir, tmp_path)
    for replica_id, zone in REPLICAS:
        fleet.replicas[replica_id] = ReplicaProcess(
            free_port(), replica_id=replica_id, zone=zone, env=env, log_path=tmp_path / f"{replica_id}.log",
            extra_args=("--num-threads", "1", "--admin-token", ADMIN_TOKEN, "--max-num-batched-tokens",
                        str(CHUNK_TOKENS), "--otlp-traces-endpoint", receiver.url)).start()
    port = free_port()
    write_config(tmp_path / "gateway.json", GatewayConfig(otlp_traces_endpoint=receiver.url,
                                                          stall_timeout_s=10.0, probe_interval_s=0.5))
    (tmp_path / "endpoints.json").write_text(json.dumps([e.to_json() for e in fleet.endpoints()]))
    with open(tmp_path / "gateway.log", "wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "controlplane.gateway", "--port", str(port), "--no-reuse-port",
             "--config", str(tmp_path / "gateway.json"), "--endpoints", str(tmp_path / "endpoints.json")],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        fleet.wait_ready()
        # the gateway may have probed the replicas before they were ready: wait until it routes to both
        wait_until(lambda: _routable(url) == {"r1", "r2"}, timeout=60, what="the gateway to route to both")
        yield url, fleet
    finally:
        gateway.terminate()
        gateway.wait(30)
        fleet.stop_all()


def _routable(url: str) -> set[str]:
    try:
        return set(httpx.get(f"{url}/health", timeout=2).json()["routable"])
    except (httpx.HTTPError, ValueError, KeyError):
        return set()


def _stream_through_a_device_failure(url: str, fleet: Fleet) -> tuple[str, list[int], list[Any]]:
    """The client's stream; once it has BREAK_AFTER tokens the replica serving it fails. Both replicas
    start slow; once the first is known the other is made fast again, so that only the stream that has
    to break is slow: the fault has (MAX_TOKENS - BREAK_AFTER) * STEP_DELAY_S to land, and the resume
    takes no longer than the model does."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    events: list[Any] = []
    failed = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=client_traceparent(),
                      timeout=120) as response:
        assert response.status_code == 200
        first = response.headers["x-replica-id"]
        second = ({"r1", "r2"} - {first}).pop()
        assert fleet.admin(second, "DELETE").status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            events.append(event)
            if isinstance(event, dict) and event.get("choices"):
                tokens += event["choices"][0].get("token_ids", [])
            if len(tokens) >= BREAK_AFTER and not failed:
                failed = fleet.admin(first, "PUT", {"kind": "device_failure", "duration_s": 3}).status_code
                assert failed == 201
    return first, tokens, events


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_request_resumed_on_a_second_replica_is_one_trace_from_the_client_to_both_engines(
        traced_fleet: tuple[str, Fleet], receiver: OtlpReceiver) -> None:
    url, fleet = traced_fleet
    for replica_id, _ in REPLICAS:  # slow steps, so that the stream is still running when the fault lands
        assert fleet.admin(replica_id, "PUT", {"kind": "token_latency", "seconds": STEP_DELAY_S,
                                               "duration_s": 120}).status_code == 201
    first, tokens, events = _stream_through_a_device_failure(url, fleet)
    second = ({"r1", "r2"} - {first}).pop()
    assert events[-1] == "[DONE]" and len(tokens) == MAX_TOKENS  # the client saw nothing of the failure
    assert not any(isinstance(e, dict) and "error" in e for e in events)

    def tree() -> list[ReceivedSpan]:
        spans = receiver.of_trace(CLIENT_TRACE)
        done = by_name(spans, "text_completion default") and by_name(spans, "POST /v1/completions")
        return spans if done and len(by_name(spans, "text_completion default")) == 2 else []

    spans = wait_until(tree, timeout=30, what="the gateway's and both replicas' spans at the receiver")
    # the gateway: its request span under the client's, an attempt per replica, the second a resume
    (request,) = by_name(spans, "POST /v1/completions")
    assert request.parent_id == CLIENT_SPAN and request.attributes["llmsre.resumes"] == 1
    assert request.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS and not request.is_error
    (attempt,) = by_name(spans, "upstream first")
    (resume,) = by_name(spans, "upstream resume")
    assert attempt.parent_id == resume.parent_id == request.span_id
    assert attempt.attributes["llmsre.replica.id"] == first and attempt.is_error
    assert attempt.attributes["error.type"] == "error_frame" and "device failure" in attempt.status_message
    assert resume.attributes["llmsre.replica.id"] == second and not resume.is_error
    assert resume.attributes["llmsre.attempt.reason"] == "error_frame"
    delivered = resume.attributes["llmsre.resume.from_token"]
    assert BREAK_AFTER <= delivered < MAX_TOKENS
    # the replicas: each one's request span is the child of the attempt that called it
    replica_spans = {s.resource["service.instance.id"]: s for s in by_name(spans, "text_completion default")}
    broken, resumed = replica_spans[first], replica_spans[second]
    assert broken.parent_id == attempt.span_id and resumed.parent_id == resume.span_id
    assert broken.service == resumed.service == "llm-sre-replica" and broken.kind == "SERVER"
    assert broken.resource["cloud.availability_zone"] == dict(REPLICAS)[first]
    assert broken.is_error and broken.attributes["error.type"] == "device_failure"
    assert broken.attributes["gen_ai.usage.output_tokens"] >= delivered
    assert not resumed.is_error and resumed.attributes["gen_ai.response.finish_reasons"] == ["length"]
    offset = resumed.attributes["llmsre.output_offset"]  # where the continuation started
    assert 0 < offset <= delivered and offset + resumed.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    input_tokens = "gen_ai.usage.input_tokens"
    assert resumed.attributes[input_tokens] == broken.attributes[input_tokens] + offset
    for outer, inner in ((attempt, broken), (resume, resumed)):  # within their attempts, clocks apart
        assert outer.start_ns - CLOCK_SLACK_NS <= inner.start_ns <= inner.end_ns
        assert inner.end_ns <= outer.end_ns + CLOCK_SLACK_NS
    for replica in (broken, resumed):
        _assert_stages(spans, replica)


def _assert_stages(spans: list[ReceivedSpan], replica: ReceivedSpan) -> None:
    """Queue, the prefill chunks and the decode under a replica's request span, with their token counts."""
    children = [s for s in spans if s.parent_id == replica.span_id]
    assert {s.name for s in children} == {"queue", "prefill", "decode"}
    (queue,), (decode,) = by_name(children, "queue"), by_name(children, "decode")
    chunks = by_name(children, "prefill")
    a = replica.attributes
    assert sum(c.attributes["llmsre.prefill.tokens"] for c in chunks) == \
        a["gen_ai.usage.input_tokens"] - a["gen_ai.usage.cache_read.input_tokens"]
    assert len(chunks) >= 2 and all(c.attributes["llmsre.prefill.tokens"] <= CHUNK_TOKENS for c in chunks)
    assert [c.attributes["llmsre.prefill.chunk"] for c in chunks] == list(range(len(chunks)))
    assert decode.attributes["llmsre.decode.tokens"] == a["gen_ai.usage.output_tokens"] - 1
    assert queue.end_ns <= chunks[0].start_ns and chunks[-1].end_ns <= decode.end_ns
    assert replica.start_ns <= queue.start_ns and decode.end_ns <= replica.end_ns
