"""The load client (``python -m inference.bench serve``): workloads, arrivals, records and the summary.

The HTTP tests run against ``FakeReplica``, a tiny OpenAI-compatible SSE server started here on a free
loopback port. It stands in for the replica only to pin down the client's arithmetic (counts, token
times, percentiles, goodput, error kinds, the JSONL timeline, the hard stop): its answers are fixed and
known in advance. The replica's own tests exercise this client against the real server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inference.bench import serve
from inference.bench.datasets import (
    FIRST_PROMPT_TOKEN_ID,
    DatasetConfig,
    build_requests,
    poisson_arrivals,
    read_trace,
    shipped_trace,
)
from inference.bench.load_client import run_load
from inference.bench.load_config import (
    BenchError,
    LoadConfig,
    NonLoopbackTargetError,
    ensure_loopback,
    plan_requests,
)
from inference.bench.report import (
    Distribution,
    LoadReport,
    RequestRecord,
    ServerTimings,
    Slo,
    goodput,
    read_jsonl,
    summarize,
    write_jsonl,
)

AZURE_CSV = shipped_trace()  # the Azure LLM conversation trace (2023) the package ships
MODEL = "fake-model"
TIMINGS = {"queue": 0.001, "prefill": 0.002, "decode": 0.003, "detokenize": 0.0004, "serialize": 0.0005}


# ------------------------------------------------------------------------------------------ fake server


@dataclass
class FakeReplica:
    """Streams ``max_tokens`` chunks ``delay`` s apart; ``plan`` maps a request index to a failure:
    ``503``, ``429``, ``cut`` (ends without [DONE]) or ``abort`` (connection dropped mid-stream).

    Even indexes answer with an ``x-replica-id: r0`` header; odd ones name ``r1`` only in ``timings``.
    """

    delay: float = 0.002
    plan: dict[int, str] = field(default_factory=dict)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self, *, delay: float = 0.002, plan: dict[int, str] | None = None) -> None:
        self.delay, self.plan, self.bodies = delay, plan or {}, []
        self.in_flight = self.max_in_flight = 0

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        index = int(request.headers["x-request-id"].rsplit("-", 1)[1])
        action = self.plan.get(index, "ok")
        if action == "503":
            return JSONResponse({"error": {"message": "draining", "type": "service_unavailable",
                                           "code": "replica_draining"}}, status_code=503)
        if action == "429":
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_exceeded",
                                           "code": None}}, status_code=429, headers={"Retry-After": "2"})
        headers = {"x-replica-id": "r0"} if index % 2 == 0 else {}
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return StreamingResponse(self._events(body, index, action=action),
                                 media_type="text/event-stream", headers=headers)

    async def _events(self, body: dict[str, Any], index: int, *, action: str) -> Any:
        n, chat = body["max_tokens"], "messages" in body
        prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
        try:
            for i in range(n):
                await asyncio.sleep(self.delay)
                if action != "ok" and i == n // 2:
                    if action == "abort":  # uvicorn drops the connection mid-body, as a killed replica would
                        raise RuntimeError("replica died")
                    return  # "cut": the stream ends cleanly, but without [DONE]
                piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                yield _sse({"id": f"cmpl-{index}", "choices": [{"index": 0, **piece, "finish_reason": None}]})
            last = {"index": 0, "text": "", "finish_reason": "length"}
            yield _sse({"id": f"cmpl-{index}", "choices": [last]})
            timings = {**TIMINGS, "replica": "r0" if index % 2 == 0 else "r1"}
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
            yield _sse({"id": f"cmpl-{index}", "choices": [], "usage": usage, "timings": timings})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeReplica]:
    replica = FakeReplica()
    app = Starlette(routes=[Route("/v1/models", replica.models),
                            Route("/v1/completions", replica.complete, methods=["POST"]),
                            Route("/v1/chat/completions", replica.complete, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "fake replica did not start"
    replica.url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # type: ignore[attr-defined]
    yield replica
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _config(fake: FakeReplica, **kwargs: Any) -> LoadConfig:
    dataset = kwargs.pop("dataset", None) or DatasetConfig(
        num_requests=kwargs.pop("num_requests", 8), input_len=kwargs.pop("input_len", 12),
        output_len=kwargs.pop("output_len", 6), seed=kwargs.pop("seed", 0))
    return LoadConfig(dataset=dataset, base_url=fake.url, model=kwargs.pop("model", MODEL),  # type: ignore[attr-defined]
                      **kwargs)


# ------------------------------------------------------------------------------ one mixed run, shared

NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = 24, 12, 6
FAILURES = {3: "503", 5: "429", 7: "cut"}


@pytest.fixture(scope="module")
def mixed_run(fake: FakeReplica) -> tuple[LoadReport, list[dict[str, Any]], list[tuple[int, int]]]:
    """24 requests, all at once under a cap of 6, with one 503, one 429 and one cut stream."""
    fake.reset(delay=0.003, plan=FAILURES)
    ticks: list[tuple[int, int]] = []
    cfg = _config(fake, num_requests=NUM_REQUESTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN,
                  max_concurrency=6, slo=Slo(ttft_ms=500, tpot_ms=100))
    report = asyncio.run(run_load(cfg, progress=lambda done, total: ticks.append((done, total))))
    return report, list(fake.bodies), ticks


def test_every_request_is_counted_with_its_tokens(mixed_run: Any) -> None:
    report, bodies, ticks = mixed_run
    s = report.summary
    assert (s.num_requests, s.num_completed, s.num_failed) == (NUM_REQUESTS, NUM_REQUESTS - 3, 3)
    assert sorted(r.index for r in report.records) == list(range(NUM_REQUESTS))
    ok = [r for r in report.records if r.is_success]
    assert all(r.completion_tokens == OUTPUT_LEN and len(r.token_times) == OUTPUT_LEN for r in ok)
    assert all(r.prompt_tokens == INPUT_LEN and r.finish_reason == "length" for r in ok)
    assert all(r.timings == ServerTimings(**TIMINGS, replica=r.replica) for r in ok)
    assert s.total_output_tokens == OUTPUT_LEN * len(ok) and s.total_input_tokens == INPUT_LEN * len(ok)
    assert s.request_throughput == pytest.approx(len(ok) / s.duration)
    assert s.output_throughput == pytest.approx(OUTPUT_LEN * len(ok) / s.duration)
    assert ticks[-1] == (NUM_REQUESTS, NUM_REQUESTS) and len(ticks) == NUM_REQUESTS
    # what went over the wire: exact lengths, token-id prompts, usage requested
    assert len(bodies) == NUM_REQUESTS
    for body in bodies:
        assert body["max_tokens"] == OUTPUT_LEN and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["model"] == MODEL
        assert len(body["prompt"]) == INPUT_LEN and min(body["prompt"]) >= FIRST_PROMPT_TOKEN_ID


def test_failures_are_recorded_by_kind(mixed_run: Any) -> None:
    report, _, _ = mixed_run
    assert report.summary.errors == {"http_429": 1, "http_503": 1, "stream_cut": 1}
    by_index = {r.index: r for r in report.records}
    unavailable, limited, cut = by_index[3], by_index[5], by_index[7]
    assert (unavailable.status, unavailable.error_type, unavailable.error_code) == (
        503, "service_unavailable", "replica_draining")
    assert (limited.status, limited.retry_after, limited.error_type) == (429, 2.0, "rate_limit_exceeded")
    assert cut.status == 200 and cut.error_kind == "stream_cut" and len(cut.token_times) == OUTPUT_LEN // 2
    assert cut.completion_tokens is None
    # replica from the header (even indexes), else from timings (odd ones, which 3, 5 and 7 never reached)
    assert report.summary.replicas == {"r0": 12, "r1": 9, "unknown": 3}


def test_percentiles_match_numpy_on_the_recorded_samples(mixed_run: Any) -> None:
    report, _, _ = mixed_run
    ok = [r for r in report.records if r.is_success]
    samples = {
        "ttft": [r.first_token_time - r.send_time for r in ok],
        "e2el": [r.end_time - r.send_time for r in ok],
        "tpot": [((r.end_time - r.first_token_time) / (OUTPUT_LEN - 1)) for r in ok],
        "itl": [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])],
    }
    assert len(samples["itl"]) == len(ok) * (OUTPUT_LEN - 1)
    for name, values in samples.items():
        dist: Distribution = getattr(report.summary, name)
        ms = np.asarray(values) * 1000
        assert dist.count == len(values)
        assert dist.mean == pytest.approx(ms.mean())
        assert dist.max == pytest.approx(ms.max())
        for q in (50, 90, 95, 99):
            assert getattr(dist, f"p{q}") == pytest.approx(np.percentile(ms, q)), (name, q)
    assert report.summary.server_timings["queue"].mean == pytest.approx(TIMINGS["queue"] * 1000)


def test_goodput_counts_successes_within_every_slo() -> None:
    def record(index: int, *, ttft: float, e2el: float, tokens: int, status: int = 200) -> RequestRecord:
        times = [ttft + i * (e2el - ttft) / max(tokens - 1, 1) for i in range(tokens)]
        return RequestRecord(index=index, request_id=str(index), prompt_len=4, output_len=tokens,
                             first_token_time=ttft, token_times=times, end_time=e2el, status=status,
                             completion_tokens=tokens,
                             error_kind=None if status == 200 else f"http_{status}")

    records = [record(0, ttft=0.1, e2el=0.55, tokens=10),   # tpot 50 ms: good
               record(1, ttft=0.6, e2el=1.0, tokens=10),    # ttft 600 ms: misses
               record(2, ttft=0.1, e2el=1.9, tokens=10),    # tpot 200 ms: misses
               record(3, ttft=0.1, e2el=0.2, tokens=2, status=503),
               record(4, ttft=0.2, e2el=0.2, tokens=1)]     # no tpot with one token: good
    both = goodput(records, Slo.parse("ttft=500,tpot=100"), duration=2.0)
    assert (both.num_good, both.request_rate, both.percent) == (2, 1.0, 40.0)
    ttft_only = summarize(records, duration=2.0, slo=Slo(ttft_ms=500)).goodput
    assert ttft_only is not None and (ttft_only.num_good, ttft_only.percent) == (3, 60.0)
    assert goodput(records, Slo(e2el_ms=600), duration=2.0).num_good == 2  # records 0 and 4
    for bad in ("latency=5", "ttft=abc", "ttft=-1", ""):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_jsonl_holds_every_field_relative_to_the_start(mixed_run: Any, tmp_path: Path) -> None:
    report, _, _ = mixed_run
    path = tmp_path / "timeline.jsonl"
    write_jsonl(report.records, path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == NUM_REQUESTS
    expected = {f.name for f in fields(RequestRecord)} | {"success", "num_output_tokens", "replica", "ttft",
                                                         "tpot", "e2el"}
    for line in lines:
        assert set(line) == expected
        assert 0 <= line["send_time"] <= line["end_time"] <= report.summary.duration
        assert line["token_times"] == sorted(line["token_times"])
        assert all(line["send_time"] <= t <= line["end_time"] for t in line["token_times"])
        assert abs(line["send_wall"] - (report.start_wall + line["send_time"])) < 0.5
        if line["success"]:
            assert line["timings"]["replica"] in ("r0", "r1") and line["ttft"] > 0
    assert read_jsonl(path) == report.records


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://127.0.0.1.nip.io",
                                 "http://127.0.0.1@evil.example", "http://[::ffff:10.0.0.1]:80",
                                 "http://0.0.0.0:8000", "ftp://127.0.0.1", "http://2130706433"])
def test_non_loopback_targets_are_refused(url: str) -> None:
    with pytest.raises(NonLoopbackTargetError, match="refusing"):
        ensure_loopback(url)
    with pytest.raises(NonLoopbackTargetError):
        LoadConfig(dataset=DatasetConfig(num_requests=1), base_url=url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8101", "http://127.9.8.7", "http://LOCALHOST:8000",
                                 "http://[::1]:8000", "https://[::ffff:127.0.0.1]:1"])
def test_loopback_targets_are_accepted(url: str) -> None:
    ensure_loopback(url)


def test_cli_refuses_a_remote_target_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--base-url", "http://192.0.2.1:8000", "--num-requests", "1", "--model", "m"])
    started = time.monotonic()
    assert serve.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "refusing to send load" in err and "192.0.2.1" in err
    assert time.monotonic() - started < 1.0  # nothing was attempted


def test_run_load_rechecks_a_target_changed_after_validation() -> None:
    cfg = LoadConfig(dataset=DatasetConfig(num_requests=1), model="m")
    cfg.base_url = "http://192.0.2.1:8000"
    with pytest.raises(NonLoopbackTargetError):
        asyncio.run(run_load(cfg))


def test_poisson_arrivals_are_seeded() -> None:
    first = poisson_arrivals(4000, 20.0, seed=7)
    assert first == poisson_arrivals(4000, 20.0, seed=7)
    assert first != poisson_arrivals(4000, 20.0, seed=8)
    assert first[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(first))
    assert np.mean(np.diff(first)) == pytest.approx(1 / 20.0, rel=0.1)
    assert poisson_arrivals(3, math.inf, seed=7) == [0.0, 0.0, 0.0]
    cfg = LoadConfig(dataset=DatasetConfig(num_requests=50, seed=3), request_rate=5.0)
    planned = [r.arrival for r in plan_requests(cfg)]
    assert planned == poisson_arrivals(50, 5.0, seed=3)
    lengths = [r.prompt_len for r in build_requests(cfg.dataset)]
    assert [r.prompt_len for r in plan_requests(cfg)] == lengths


def test_random_lengths_spread_within_the_range_ratio() -> None:
    requests = build_requests(DatasetConfig(num_requests=500, input_len=100, output_len=20, range_ratio=0.5))
    assert {r.prompt_len for r in requests} <= set(range(50, 151))
    assert {r.output_len for r in requests} <= set(range(10, 31))
    assert len({r.prompt_len for r in requests}) > 50  # actually spread, not constant
    with pytest.raises(ValueError, match="num_requests"):
        DatasetConfig()


def test_trace_rows_are_parsed_and_scaled() -> None:
    # first rows of the file: 18:15:46.6805900 374/44, 18:15:50.9951690 396/109,
    # 18:15:51.2224670 879/55, 18:15:51.3910170 91/16
    cfg = DatasetConfig(name="trace:azure", num_requests=4, time_scale=10, token_scale=0.1,
                        max_output_len=8)
    assert cfg.trace_path == AZURE_CSV and AZURE_CSV.parent.name == "data"
    requests = build_requests(cfg)
    assert [r.arrival for r in requests] == pytest.approx([0.0, 0.4314579, 0.4541877, 0.4710427], abs=1e-6)
    assert [r.prompt_len for r in requests] == [37, 40, 88, 9]
    assert [r.output_len for r in requests] == [4, 8, 6, 2]  # 10.9 clamped to 8; 5.5 rounds to 6
    tiny = build_requests(DatasetConfig(name=f"trace:{AZURE_CSV}", num_requests=3, token_scale=1e-4))
    assert {(r.prompt_len, r.output_len) for r in tiny} == {(1, 1)}
    rows = read_trace(AZURE_CSV)
    assert len(rows) == 19366 and rows[1].offset == pytest.approx(4.314579, abs=1e-9)
    window = build_requests(DatasetConfig(name=f"trace:{AZURE_CSV}", trace_start=4.0, trace_duration=1.0,
                                          time_scale=2.0))
    inside = [r for r in rows if 4.0 <= r.offset < 5.0]
    assert len(window) == len(inside) >= 3
    assert [r.arrival for r in window] == pytest.approx([(r.offset - 4.0) / 2.0 for r in inside])
    assert window[0].prompt_len == inside[0].context_tokens == 396


def test_trace_timestamps_pace_the_sends(fake: FakeReplica) -> None:
    fake.reset(delay=0.001)
    dataset = DatasetConfig(name=f"trace:{AZURE_CSV}", num_requests=4, time_scale=20, token_scale=0.01,
                            max_output_len=3)
    report = asyncio.run(run_load(_config(fake, dataset=dataset)))
    assert report.summary.num_completed == 4
    for r in report.records:
        assert r.scheduled_time is not None and 0 <= r.send_time - r.scheduled_time < 0.15
    assert max(r.send_time for r in report.records) == pytest.approx(0.4710427 / 2, abs=0.15)


def test_closed_loop_keeps_c_requests_in_flight(fake: FakeReplica) -> None:
    fake.reset(delay=0.004)
    report = asyncio.run(run_load(_config(fake, num_requests=12, output_len=4, concurrency=3)))
    assert report.summary.num_completed == 12 and fake.max_in_flight == 3
    assert all(r.scheduled_time is None for r in report.records)


def test_max_concurrency_caps_an_open_loop(fake: FakeReplica) -> None:
    fake.reset(delay=0.004)
    report = asyncio.run(run_load(_config(fake, num_requests=10, output_len=4, max_concurrency=2)))
    assert report.summary.num_completed == 10 and fake.max_in_flight == 2


def test_duration_is_a_hard_stop(fake: FakeReplica) -> None:
    fake.reset(delay=0.05)  # each request would stream for 2.5 s
    cfg = _config(fake, num_requests=10_000, output_len=50, request_rate=40.0, duration=0.4, grace=0.2)
    started = time.monotonic()
    report = asyncio.run(run_load(cfg))
    assert time.monotonic() - started < 3.0  # unbounded, this run would last for minutes
    s = report.summary
    assert 3 <= s.num_requests < 100
    # nothing planned after S was sent, and nothing left after S however late the event loop ran (the
    # clock read that stamps a request's send is the one that decides it may go)
    assert all(r.scheduled_time is not None and r.scheduled_time < 0.4 for r in report.records)
    assert all(r.send_time < 0.4 for r in report.records)
    assert s.errors == {"cancelled": s.num_requests} and s.num_completed == 0
    assert 0.6 <= s.duration < 2.0  # cancelled at duration + grace


def test_chat_endpoint_and_model_discovery(fake: FakeReplica) -> None:
    fake.reset()
    report = asyncio.run(run_load(_config(fake, model=None, num_requests=3, output_len=5,
                                          endpoint="/v1/chat/completions")))
    assert report.model == MODEL and report.summary.num_completed == 3
    assert all(len(r.token_times) == 5 and r.prompt_tokens == 12 for r in report.records)
    assert all(isinstance(b["messages"][0]["content"], str) for b in fake.bodies)


def test_unreachable_target_becomes_connect_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the run: connections are refused
    cfg = LoadConfig(dataset=DatasetConfig(num_requests=3), base_url=f"http://127.0.0.1:{port}", model="m")
    report = asyncio.run(run_load(cfg))
    assert report.summary.errors == {"connect_error": 3} and report.summary.replicas == {}
    cfg.model = None
    with pytest.raises(BenchError, match="--model"):
        asyncio.run(run_load(cfg))


def test_a_connection_dropped_mid_stream_is_a_cut_stream(fake: FakeReplica) -> None:
    fake.reset(plan={0: "abort"})
    report = asyncio.run(run_load(_config(fake, num_requests=2, output_len=6)))
    dropped = next(r for r in report.records if r.index == 0)
    assert report.summary.errors == {"stream_cut": 1} and report.summary.num_completed == 1
    assert dropped.status == 200 and len(dropped.token_times) == 3


def test_a_stream_slower_than_the_request_timeout_times_out(fake: FakeReplica) -> None:
    fake.reset(delay=0.05)  # 20 tokens: one second per request
    report = asyncio.run(run_load(_config(fake, num_requests=2, output_len=20, request_timeout=0.15)))
    assert report.summary.errors == {"timeout": 2}
    assert all(0.15 <= r.end_time - r.send_time < 1.0 and r.token_times for r in report.records)


def test_cli_prints_the_table_and_writes_both_files(fake: FakeReplica, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    fake.reset()
    result, timeline = tmp_path / "result.json", tmp_path / "timeline.jsonl"
    args = _parse(["--base-url", fake.url, "--num-requests", "5", "--input-len", "8",  # type: ignore[attr-defined]
                   "--output-len", "3", "--request-rate", "200", "--slo", "ttft=1000,tpot=500",
                   "--result-json", str(result), "--jsonl", str(timeline), "--no-progress"])
    assert serve.main(args) == 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "TTFT" in out and "Goodput" in out
    summary = json.loads(result.read_text())
    assert summary["num_completed"] == 5 and summary["model"] == MODEL
    assert summary["goodput"]["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 500.0, "e2el_ms": None}
    assert summary["ttft"]["p99"] > 0 and summary["replicas"] == {"r0": 3, "r1": 2}
    assert len(timeline.read_text().splitlines()) == 5


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)
