"""``python -m inference.bench serve``: drive an OpenAI-compatible server and measure what a client sees.

Data flow: ``datasets.build_requests`` -> an arrival schedule (Poisson, trace timestamps, or a closed loop
of C workers) -> one streaming HTTP request per ``BenchRequest`` -> one ``RequestRecord`` each ->
``report.summarize`` -> table, ``--result-json`` and per-request ``--jsonl``.

A library first: drills call ``run_load`` and read the records; ``main`` is a thin CLI over it. Every
failure of a request (connect error, timeout, HTTP error, cut stream, cancellation at the hard stop)
becomes a field of its record; only a run that cannot start raises (``BenchError``).

Safety: the target must be a loopback address. This tool generates load; it never sends it elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from inference.bench.answers import (
    absorb_chunk,
    error_kind,
    fail,
    fail_http,
    fail_with_error_object,
    parse_retry_after,
)
from inference.bench.datasets import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_VOCAB_SIZE,
    BenchRequest,
    DatasetConfig,
    PromptFormat,
    build_requests,
    poisson_arrivals,
    render_prompt,
    with_arrivals,
)
from inference.bench.report import (
    BAD,
    CANCEL,
    CANCELLED,
    CLIENT_CANCELLED,
    KINDS,
    PLAIN,
    PROTOCOL_ERROR,
    STREAM,
    STREAM_CUT,
    STREAM_ERROR,
    LoadReport,
    RequestRecord,
    Slo,
    format_table,
    summarize,
    write_jsonl,
    write_result_json,
)

__all__ = [
    "BenchError",
    "LoadConfig",
    "LoadReport",
    "NonLoopbackTargetError",
    "add_arguments",
    "config_from_args",
    "ensure_loopback",
    "main",
    "plan_requests",
    "run_load",
]

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)
REPLICA_HEADER = "x-replica-id"
TRIED_HEADER = "x-gateway-tried"  # replicas the gateway tried first (they failed before any byte)
REQUEST_ID_HEADER = "X-Request-Id"

Progress = Callable[[int, int], None]


class BenchError(Exception):
    """The run cannot start: a refused target, no model to name, a server that does not answer."""


class NonLoopbackTargetError(BenchError, ValueError):
    """The base URL points outside this machine's loopback interface."""


def ensure_loopback(base_url: str) -> None:
    """Refuse any target whose host is not 127.0.0.0/8, ``localhost`` or ``::1``; names are not resolved."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise NonLoopbackTargetError(f"refusing base URL {base_url!r}: {exc}") from exc
    if url.scheme not in ("http", "https") or not is_loopback_host(url.host):
        raise NonLoopbackTargetError(
            f"refusing to send load to {base_url!r}: only http(s) to a loopback host "
            "(127.0.0.0/8, localhost, ::1) is allowed")


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # any other name could resolve anywhere
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@dataclass(slots=True)
class LoadConfig:
    """One load run. Arrivals: ``concurrency`` (closed loop) or ``request_rate`` (Poisson; ``inf``: all at
    once) or, when neither is given, the trace's timestamps (traces) or all at once (random)."""

    dataset: DatasetConfig
    base_url: str = DEFAULT_BASE_URL
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float | None = None
    concurrency: int | None = None
    max_concurrency: int | None = None  # cap on requests in flight, for any arrival mode
    duration: float | None = None  # stop sending after this many seconds
    grace: float = 5.0  # in-flight requests are cancelled at duration + grace
    request_timeout: float = 300.0  # per request, whole stream included
    connect_timeout: float = 10.0
    slo: Slo | None = None
    temperature: float = 0.0
    ignore_eos: bool = True  # so that every request produces exactly max_tokens tokens
    run_id: str = ""  # "" : a fresh random id; requests are sent with X-Request-Id "<run_id>-<index>"
    # A mixed load (``--mix``): the share of each kind of request (report.KINDS); None: streams only.
    mix: dict[str, float] | None = None
    cancel_after: int = 1  # a CANCEL request is left by the client after this many tokens

    def __post_init__(self) -> None:
        ensure_loopback(self.base_url)
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.concurrency is not None and self.request_rate is not None:
            raise ValueError("concurrency and request_rate: give one (closed loop or open loop), not both")
        _check(self.request_rate is None or self.request_rate > 0, "request_rate", self.request_rate, "> 0")
        _check(self.concurrency is None or self.concurrency >= 1, "concurrency", self.concurrency, ">= 1")
        _check(self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency",
               self.max_concurrency, ">= 1")
        _check(self.duration is None or self.duration > 0, "duration", self.duration, "> 0")
        _check(self.grace >= 0, "grace", self.grace, ">= 0")
        _check(self.request_timeout > 0, "request_timeout", self.request_timeout, "> 0")
        _check(self.connect_timeout > 0, "connect_timeout", self.connect_timeout, "> 0")
        if not self.run_id:
            self.run_id = uuid.uuid4().hex[:8]
        if self.mix is not None:
            unknown = set(self.mix) - set(KINDS)
            _check(not unknown, "mix", self.mix, f"shares of {', '.join(KINDS)} only")
            _check(all(v >= 0 for v in self.mix.values()) and sum(self.mix.values()) > 0, "mix", self.mix,
                   "shares >= 0 with a positive sum")
        _check(self.cancel_after >= 1, "cancel_after", self.cancel_after, ">= 1")

    @property
    def prompt_format(self) -> PromptFormat:
        # The replica accepts token-id prompts on /v1/completions; chat needs text.
        return "token_ids" if self.endpoint == COMPLETIONS else "text"


def assign_kinds(num: int, mix: dict[str, float] | None, seed: int) -> list[str]:
    """The kind of each of ``num`` requests, drawn by ``mix``'s shares from ``seed`` (the same every run)."""
    if not mix:
        return [STREAM] * num
    rng = random.Random(f"kinds-{seed}")
    kinds = [k for k in KINDS if mix.get(k, 0) > 0]
    return rng.choices(kinds, weights=[mix[k] for k in kinds], k=num)


def parse_mix(text: str) -> dict[str, float]:
    """``stream=0.7,plain=0.15,cancel=0.1,bad=0.05`` -> shares by kind (ValueError naming ``--mix``)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--mix: expected KIND=SHARE, got {part!r}") from None
        if not sep or name.strip() not in KINDS:
            raise ValueError(f"--mix: expected KIND=SHARE with KIND one of {', '.join(KINDS)}, got {part!r}")
    return out


# Invalid on purpose (BAD requests), in turn: each must come back as a 4xx in the OpenAI error shape.
BAD_CHANGES: tuple[dict[str, Any], ...] = (
    {"max_tokens": -1}, {"temperature": -2.0}, {"model": "no-such-model"}, {"prompt": None, "messages": None},
)


def plan_requests(cfg: LoadConfig) -> list[BenchRequest]:
    """The workload with its arrival offsets (None in closed loop, where workers pace themselves)."""
    requests = build_requests(cfg.dataset)
    if cfg.concurrency is not None:
        return with_arrivals(requests, [None] * len(requests))
    if cfg.request_rate is not None:
        return with_arrivals(requests, poisson_arrivals(len(requests), cfg.request_rate, cfg.dataset.seed))
    if cfg.dataset.is_trace:
        return requests
    return with_arrivals(requests, [0.0] * len(requests))


async def run_load(cfg: LoadConfig, *, progress: Progress | None = None,
                   transport: httpx.AsyncBaseTransport | None = None) -> LoadReport:
    """Send ``cfg``'s workload, wait for it (or the hard stop), and return every record with the summary.

    ``progress(done, total)`` is called as requests finish. ``transport`` replaces the network (tests);
    the loopback check holds either way.
    """
    ensure_loopback(cfg.base_url)
    requests = plan_requests(cfg)
    async with _client(cfg, transport) as client:
        if cfg.model is None:
            log.info("run %s: asking %s/v1/models for the model", cfg.run_id, cfg.base_url)
        model = cfg.model or await discover_model(client)
        log.info("run %s: %d requests to %s%s (model %s)", cfg.run_id, len(requests), cfg.base_url,
                 cfg.endpoint, model)
        runner = _Runner(cfg, client, model, total=len(requests), progress=progress)
        runner.kinds = dict(zip((r.index for r in requests), assign_kinds(len(requests), cfg.mix,
                                                                             cfg.dataset.seed)))
        await runner.run(requests)
    summary = summarize(runner.records, duration=runner.elapsed, slo=cfg.slo)
    log.info("run %s: %d sent, %d ok in %.2f s", cfg.run_id, summary.num_requests, summary.num_completed,
             summary.duration)
    return LoadReport(run_id=cfg.run_id, base_url=cfg.base_url, endpoint=cfg.endpoint, model=model,
                      start_wall=runner.wall0, records=runner.records, summary=summary)


def _client(cfg: LoadConfig, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # trust_env=False: a proxy from the environment would carry the load off this machine.
    # No pool limit: --max-concurrency is the only queue, so client-side waiting never hides in TTFT.
    return httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, transport=transport, trust_env=False,
        follow_redirects=False,
        timeout=httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def discover_model(client: httpx.AsyncClient) -> str:
    """The first model id of ``GET /v1/models``."""
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"cannot name a model: GET /v1/models at {client.base_url} failed ({exc!r}); "
                         "pass --model") from exc


class _Runner:
    """Sends one run's requests on schedule and keeps their records."""

    def __init__(self, cfg: LoadConfig, client: httpx.AsyncClient, model: str, *, total: int,
                 progress: Progress | None) -> None:
        self.cfg, self.client, self.model = cfg, client, model
        self.total, self.progress = total, progress
        self.records: list[RequestRecord] = []
        self.kinds: dict[int, str] = {}  # request index -> kind (absent: STREAM)
        self.num_done = 0
        self.slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.elapsed = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def is_past_stop(self) -> bool:
        return self.cfg.duration is not None and self.now() >= self.cfg.duration

    async def run(self, requests: list[BenchRequest]) -> None:
        self.t0, self.wall0 = time.monotonic(), time.time()
        hard_stop = None if self.cfg.duration is None else self.cfg.duration + self.cfg.grace
        try:
            async with asyncio.timeout(hard_stop), asyncio.TaskGroup() as tasks:
                if self.cfg.concurrency is not None:
                    queue = iter(requests)
                    for _ in range(self.cfg.concurrency):
                        tasks.create_task(self._closed_loop_worker(queue))
                else:
                    await self._open_loop(requests, tasks)
        except TimeoutError:
            log.info("run %s: hard stop at %.1f s, in-flight requests cancelled", self.cfg.run_id, hard_stop)
        self.elapsed = self.now()

    async def _open_loop(self, requests: list[BenchRequest], tasks: asyncio.TaskGroup) -> None:
        for request in requests:
            if not await self._sleep_until(request.arrival or 0.0):
                return
            tasks.create_task(self._send_when_free(request))

    async def _sleep_until(self, offset: float) -> bool:
        """Sleep until ``offset``; False when the run's duration ends first (then nothing more is sent)."""
        stop = math.inf if self.cfg.duration is None else self.cfg.duration
        await asyncio.sleep(max(min(offset, stop) - self.now(), 0.0))
        return offset < stop

    async def _closed_loop_worker(self, queue: Iterator[BenchRequest]) -> None:
        for request in queue:  # one shared iterator: each request goes to exactly one worker
            if self.is_past_stop():
                return
            await self._send_when_free(request)

    async def _send_when_free(self, request: BenchRequest) -> None:
        async with self.slots or contextlib.nullcontext():
            if not self.is_past_stop():  # a late dispatch or a long wait for a slot must not send after S
                await self._send(request)

    async def _send(self, request: BenchRequest) -> None:
        record = RequestRecord(index=request.index, request_id=f"{self.cfg.run_id}-{request.index}",
                               prompt_len=request.prompt_len, output_len=request.output_len,
                               scheduled_time=request.arrival, kind=self.kinds.get(request.index, STREAM))
        payload = self._payload(request, record.kind)  # before the clock starts: prompt rendering is ours
        record.send_time, record.send_wall = self.now(), time.time()
        self.records.append(record)
        try:
            async with asyncio.timeout(self.cfg.request_timeout):
                await self._exchange(record, payload)
        except asyncio.CancelledError:
            fail(record, CANCELLED, message="cancelled at the run's hard stop")
            raise
        except Exception as exc:  # every failure of one request becomes its record, never the run's
            kind = error_kind(exc)
            if kind == PROTOCOL_ERROR:
                log.warning("run %s: request %s failed unexpectedly: %r", self.cfg.run_id,
                            record.request_id, exc)
            fail(record, kind, message=repr(exc))
        finally:
            if record.end_time is None:
                record.end_time = self.now()
            self._done()

    def _payload(self, request: BenchRequest, kind: str = STREAM) -> dict[str, Any]:
        prompt = render_prompt(request, self.cfg.prompt_format, seed=self.cfg.dataset.seed,
                               vocab_size=self.cfg.dataset.vocab_size)
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.output_len,
                                "stream": kind != PLAIN, "temperature": self.cfg.temperature,
                                "ignore_eos": self.cfg.ignore_eos}
        if kind != PLAIN:
            body["stream_options"] = {"include_usage": True}
        if self.cfg.endpoint == COMPLETIONS:
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if kind == BAD:
            body.update(BAD_CHANGES[request.index % len(BAD_CHANGES)])
            body = {k: v for k, v in body.items() if v is not None}
        return body

    async def _exchange(self, record: RequestRecord, payload: dict[str, Any]) -> None:
        headers = {REQUEST_ID_HEADER: record.request_id}
        if record.kind == PLAIN:
            await self._exchange_plain(record, payload, headers)
            return
        async with self.client.stream("POST", self.cfg.endpoint, json=payload, headers=headers) as resp:
            record.status = resp.status_code
            record.replica_id = resp.headers.get(REPLICA_HEADER)
            record.tried = tuple(r for r in resp.headers.get(TRIED_HEADER, "").split(",") if r)
            record.retry_after = parse_retry_after(resp.headers.get("retry-after"))
            if resp.status_code != 200:
                fail_http(record, resp.status_code, await resp.aread())
            elif not resp.headers.get("content-type", "").startswith("text/event-stream"):
                kind = resp.headers.get("content-type")
                fail(record, PROTOCOL_ERROR, message=f"not an event stream: {kind}")
            else:
                await self._read_stream(record, resp)

    async def _exchange_plain(self, record: RequestRecord, payload: dict[str, Any],
                              headers: dict[str, str]) -> None:
        """A request that is not streamed: one JSON answer, with its usage."""
        resp = await self.client.post(self.cfg.endpoint, json=payload, headers=headers)
        record.status = resp.status_code
        record.replica_id = resp.headers.get(REPLICA_HEADER)
        record.tried = tuple(r for r in resp.headers.get(TRIED_HEADER, "").split(",") if r)
        if resp.status_code != 200:
            fail_http(record, resp.status_code, resp.content)
            return
        try:
            answer = resp.json()
        except ValueError:
            fail(record, PROTOCOL_ERROR, message=f"answer is not JSON: {resp.text[:200]!r}")
            return
        if not isinstance(answer, dict) or not answer.get("choices"):
            fail(record, PROTOCOL_ERROR, message=f"answer has no choices: {resp.text[:200]!r}")
            return
        absorb_chunk(record, {k: v for k, v in answer.items() if k != "choices"}, self.now())
        record.finish_reason = answer["choices"][0].get("finish_reason")
        record.end_time = self.now()

    async def _read_stream(self, record: RequestRecord, resp: httpx.Response) -> None:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == "[DONE]":
                record.end_time = self.now()
                return
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                fail(record, PROTOCOL_ERROR, message=f"chunk is not JSON: {data[:200]!r}")
                return
            if not isinstance(chunk, dict):
                fail(record, PROTOCOL_ERROR, message=f"chunk is not an object: {data[:200]!r}")
                return
            if "error" in chunk:
                fail_with_error_object(record, STREAM_ERROR, chunk["error"])
                return
            absorb_chunk(record, chunk, self.now())
            if record.kind == CANCEL and len(record.token_times) >= self.cfg.cancel_after:
                record.finish_reason, record.end_time = CLIENT_CANCELLED, self.now()
                return  # leaving the block closes the connection: the server must free the request
        fail(record, STREAM_CUT, message="stream ended before data: [DONE]")

    def _done(self) -> None:
        self.num_done += 1
        if self.progress is not None:
            self.progress(self.num_done, self.total)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: must be {rule}, got {value!r}")


# ---------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target (loopback only)")
    target.add_argument("--base-url", default=DEFAULT_BASE_URL)
    target.add_argument("--endpoint", default=COMPLETIONS, choices=ENDPOINTS)
    target.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    target.add_argument("--api-key", default=None, help="sent as a Bearer token")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset", default="random", help="'random' or 'trace:FILE' (Azure LLM trace CSV)")
    data.add_argument("--num-requests", type=int, default=None, help="required for random; a cap for traces")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN)
    data.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN)
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in len * [1 - r, 1 + r]")
    data.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                      help="random prompt token ids are drawn below this")
    data.add_argument("--time-scale", type=float, default=1.0, help="trace replay speed-up (10: 10x faster)")
    data.add_argument("--token-scale", type=float, default=1.0, help="multiplies trace lengths (min 1 token)")
    data.add_argument("--max-input-len", type=int, default=None)
    data.add_argument("--max-output-len", type=int, default=None)
    data.add_argument("--trace-start", type=float, default=0.0, help="seconds into the trace")
    data.add_argument("--trace-duration", type=float, default=None, help="seconds of the trace to replay")

    load = p.add_argument_group("arrivals and bounds")
    load.add_argument("--request-rate", type=float, default=None,
                      help="Poisson arrivals per second ('inf': all at once); default: trace timestamps "
                           "for traces, all at once for random")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with C workers")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--duration", type=float, default=None,
                      help="stop sending after S seconds; in-flight requests are cancelled at S + grace")
    load.add_argument("--grace", type=float, default=5.0)
    load.add_argument("--request-timeout", type=float, default=300.0)
    load.add_argument("--mix", type=parse_mix, default=None, metavar="KIND=SHARE,...",
                      help="a mixed load: shares of stream, plain (not streamed), cancel (the client leaves "
                      "after --cancel-after tokens) and bad (invalid on purpose: must get a 4xx), e.g. "
                      "stream=0.7,plain=0.15,cancel=0.1,bad=0.05 (default: streams only)")
    load.add_argument("--cancel-after", type=int, default=1, help="tokens a cancel request reads")

    out = p.add_argument_group("report")
    out.add_argument("--slo", default=None, help="goodput SLOs in ms, as in ttft=500,tpot=100 (also e2el)")
    out.add_argument("--result-json", type=Path, default=None, help="write the summary here")
    out.add_argument("--jsonl", type=Path, default=None, help="write one line per request here")
    out.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    dataset = DatasetConfig(
        name=args.dataset, num_requests=args.num_requests, seed=args.seed, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, vocab_size=args.vocab_size,
        time_scale=args.time_scale, token_scale=args.token_scale, max_input_len=args.max_input_len,
        max_output_len=args.max_output_len, trace_start=args.trace_start, trace_duration=args.trace_duration)
    return LoadConfig(
        dataset=dataset, base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        api_key=args.api_key, request_rate=args.request_rate, concurrency=args.concurrency,
        max_concurrency=args.max_concurrency, duration=args.duration, grace=args.grace,
        request_timeout=args.request_timeout, slo=None if args.slo is None else Slo.parse(args.slo),
        mix=args.mix, cancel_after=args.cancel_after)


def _say_progress_on_stderr() -> None:
    """The run's milestones (asking for the model, sending, the hard stop) as timestamped lines on
    stderr: a drill that starts this client reads them to say why its load did not start."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s load client: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(args: argparse.Namespace) -> int:
    """Run the load of ``args`` and print its table; 2 on a bad configuration, 1 when it cannot start."""
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(desc="requests", unit="req", file=sys.stderr,
               disable=args.no_progress or not sys.stderr.isatty())

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    _say_progress_on_stderr()
    try:
        report = asyncio.run(run_load(cfg, progress=progress))
    except (BenchError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(format_table(report))
    if args.result_json is not None:
        write_result_json(report, args.result_json)
    if args.jsonl is not None:
        write_jsonl(report.records, args.jsonl)
    return 0
