"""The load client: sends a planned load to an OpenAI-compatible server and records what each request saw.

The sending stage of ``python -m inference.bench serve``: ``run_load`` takes a ``LoadConfig``
(:mod:`inference.bench.load_config`), follows its arrival schedule (Poisson, trace timestamps, or a closed
loop of C workers), sends one streaming (or plain) HTTP request per ``BenchRequest``, folds what comes back
into one ``RequestRecord`` each (:mod:`inference.bench.answers`) and hands the records to
``report.summarize``. Callers: the CLI (:mod:`inference.bench.serve`), the replica benchmark, and drills
that read the records directly.

Every failure of a request (connect error, timeout, HTTP error, cut stream, cancellation at the hard stop)
becomes a field of its record; only a run that cannot start raises (``BenchError``). Milestones (asking
for the model, sending, the hard stop) go to this module's logger, which the CLI prints on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
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
from inference.bench.datasets import BenchRequest, render_prompt
from inference.bench.load_config import (
    COMPLETIONS,
    BenchError,
    LoadConfig,
    assign_kinds,
    ensure_loopback,
    plan_requests,
)
from inference.bench.report import (
    BAD,
    CANCEL,
    CANCELLED,
    CLIENT_CANCELLED,
    PLAIN,
    PROTOCOL_ERROR,
    STREAM,
    STREAM_CUT,
    STREAM_ERROR,
    LoadReport,
    RequestRecord,
    summarize,
)

__all__ = ["discover_model", "run_load"]

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-replica-id"
TRIED_HEADER = "x-gateway-tried"  # replicas the gateway tried first (they failed before any byte)
REQUEST_ID_HEADER = "X-Request-Id"

Progress = Callable[[int, int], None]


# Invalid on purpose (BAD requests), in turn: each must come back as a 4xx in the OpenAI error shape.
BAD_CHANGES: tuple[dict[str, Any], ...] = (
    {"max_tokens": -1}, {"temperature": -2.0}, {"model": "no-such-model"}, {"prompt": None, "messages": None},
)


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
            await self._send(request)

    async def _send(self, request: BenchRequest) -> None:
        record = RequestRecord(index=request.index, request_id=f"{self.cfg.run_id}-{request.index}",
                               prompt_len=request.prompt_len, output_len=request.output_len,
                               scheduled_time=request.arrival, kind=self.kinds.get(request.index, STREAM))
        payload = self._payload(request, record.kind)  # before the clock starts: prompt rendering is ours
        sent = self.now()
        if self.cfg.duration is not None and sent >= self.cfg.duration:
            return  # a late dispatch, a long wait for a slot or a slow render: nothing is sent after S
        record.send_time, record.send_wall = sent, time.time()
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
        if self.cfg.token_ids:
            body["return_token_ids"] = True
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
