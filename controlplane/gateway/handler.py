"""The gateway: the OpenAI-compatible entry point that clients call, routing every request to a replica.

client -> :meth:`Gateway.handle`: authenticate, parse, admit (load shedding, per-key rate limits), route
(:mod:`controlplane.gateway.routing`), open a stream on a replica (retried on another replica before the first
byte), relay its chunks -> client; when the stream breaks mid-way (connection reset, error frame, stall),
resume on another replica from the tokens already delivered -> one :class:`TraceRecord` per request.

Every upstream request is a stream with ``return_token_ids`` and usage, whatever the client asked, so any
request can be resumed: the continuation is a ``/v1/completions`` request whose prompt is the original
prompt's token ids plus the tokens delivered, with ``output_offset`` so that seeded sampling goes on where
it stopped (chat continuations are translated back into chat chunks). With greedy or seeded sampling the
client's stream equals an undisturbed run, text included: a continuation starts at the last token whose
text the replica had released, and the gateway drops what it regenerates up to the point delivered.
Non-streaming requests run as streams too, assembled at the end.

Transport failures become an :class:`UpstreamError` in one place (:meth:`Gateway._send`, :class:`Upstream`);
refusals are :class:`GatewayError` s in the OpenAI error shape. See :mod:`controlplane.gateway.upstream_http`,
:mod:`controlplane.gateway.liveness`, :mod:`controlplane.gateway.health_checks`,
:mod:`controlplane.gateway.toxics` (link faults), :mod:`controlplane.gateway.tracing` (OpenTelemetry
spans) and :mod:`controlplane.gateway.server`. """

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from controlplane.gateway.admission import OutlierDetector, RateLimiter, RetryBudgets, shed_limit
from controlplane.gateway.assembly import BadEvent, RequestParams, StreamAssembly
from controlplane.gateway.catalog import served_models
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.errors import GatewayError, UpstreamError
from controlplane.gateway.health_checks import ActiveChecks
from controlplane.gateway.ledger import Ledger
from controlplane.gateway.liveness import Liveness
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.request import (
    PRIORITIES,
    Job,
    bearer,
    key_id,
    read_body,
    request_priority,
    tried_header,
)
from controlplane.gateway.routing import Candidate, Router, routable
from controlplane.gateway.slices import STABLE, SlicePlan, assign, conversation_key, endpoints_for
from controlplane.gateway.toxics import LinkToxics
from controlplane.gateway.tracing import CLIENT_DISCONNECTED, GatewayTracing
from controlplane.gateway.upstream import DONE_EVENT, EventStreamResponse, Upstream, open_stream, sse_event
from controlplane.gateway.upstream_http import (
    HttpxStreams,
    StreamClient,
    StreamResponse,
    UpstreamPool,
)
from controlplane.replicas import ReplicaEndpoint, ReplicaLoad
from controlplane.traces import TraceRecord
from inference.protocol import error_body

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-replica-id"

MAX_RESUMES = 3  # mid-stream continuations per request

Clock = Callable[[], float]
EventSink = Callable[[str, str, str], None]  # (kind, replica_id, detail)


# ---- the gateway -----------------------------------------------------------------------------
class Gateway:
    """Routes, retries, resumes, ejects, admits and traces; :func:`create_gateway_app` serves it."""

    def __init__(self, config: GatewayConfig, *, endpoints: Callable[[], list[ReplicaEndpoint]],
                 load: Callable[[str], ReplicaLoad | None] = lambda _: None,
                 on_trace: Callable[[TraceRecord], None] = lambda _: None,
                 on_event: EventSink = lambda kind, replica_id, detail: None,
                 clock: Clock = time.monotonic, transport: httpx.AsyncBaseTransport | None = None,
                 router: Router | None = None, slices: Callable[[], SlicePlan] = SlicePlan) -> None:
        self.config = config
        self._endpoints, self._load, self._on_event = endpoints, load, on_event
        self._slices = slices  # traffic slices: the version split and the colours (slices.py)
        self.clock = clock
        self.router = router or Router(config.routing)
        self.metrics = GatewayMetrics()
        self.ledger = Ledger(self.metrics, on_trace, clock)  # what each finished request leaves behind
        self.limiter = RateLimiter(requests_per_s=config.rate_limit_rps,
                                   tokens_per_s=config.rate_limit_tokens_per_s, clock=clock)
        self.budgets = RetryBudgets(config.retry_budget_ratio, clock=clock)  # one per colour
        self.outliers = OutlierDetector(config.eject_after_failures)
        self.toxics = LinkToxics(clock=clock)  # link faults injected by chaos (chaos.faults.link)
        self.liveness = Liveness(config.stall_timeout_s, on_event=self._emit)  # stalled: routed around
        self.tracing: GatewayTracing | None = None  # OpenTelemetry spans, from start() when configured
        self._inflight: dict[str, int] = defaultdict(int)
        self._client = self._new_client(transport)
        self.checks = ActiveChecks(client=self._client, endpoints=endpoints, outliers=self.outliers,
                                   liveness=self.liveness, inflight=lambda rid: self._inflight.get(rid, 0),
                                   interval_s=config.probe_interval_s, silence_s=config.stall_timeout_s,
                                   probe_idle=config.probe_idle_replicas, readmit=self._readmit,
                                   ejected=self._ejected)
        # Streams go through the pooled client; an httpx transport given here (in-process fake replicas
        # in tests) carries them instead.
        self._streams: StreamClient = HttpxStreams(self._client) if transport is not None else UpstreamPool()

    def _new_client(self, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
        t = self.config.first_byte_timeout_s
        # Reads have no httpx timeout: the first byte and stalls are timed per event by Upstream.
        timeout = httpx.Timeout(connect=t, read=None, write=t, pool=t)
        # Probes and /v1/models only, unless a transport carries the streams too (no connection limit).
        limits = httpx.Limits(max_connections=None if transport is not None else 100)
        return httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits, trust_env=False)

    # ---- lifecycle ----
    async def start(self) -> None:
        """Start the active health checks and the trace export when configured (idempotent)."""
        self.checks.start()
        if self.tracing is None and self.config.otlp_traces_endpoint:  # its exporter thread starts here
            self.tracing = GatewayTracing.start(self.config.tracing())

    async def stop(self) -> None:
        """Stop the health checks and the trace export and close every upstream connection."""
        await self.checks.stop()
        if self.tracing is not None:  # exports what is buffered (bounded), off the event loop
            tracing, self.tracing = self.tracing, None  # a start() after this one starts a new provider
            await asyncio.to_thread(tracing.shutdown)
        self.liveness.stop()
        await self._streams.aclose()
        await self._client.aclose()

    def set_admission(self, *, rate_limit_rps: float | None = None,
                      rate_limit_tokens_per_s: float | None = None,
                      max_inflight_per_replica: int | None = None) -> None:
        """Change admission at run time (the admin API); rate buckets start full again."""
        cfg = self.config
        if rate_limit_rps is not None:
            cfg.rate_limit_rps = rate_limit_rps
        if rate_limit_tokens_per_s is not None:
            cfg.rate_limit_tokens_per_s = rate_limit_tokens_per_s
        if max_inflight_per_replica is not None:
            cfg.max_inflight_per_replica = max_inflight_per_replica
        self.limiter = RateLimiter(requests_per_s=cfg.rate_limit_rps,
                                   tokens_per_s=cfg.rate_limit_tokens_per_s, clock=self.clock)

    def slice_plan(self) -> SlicePlan:
        return self._slices()

    def ejected(self) -> set[str]:
        """The replicas ejected now."""
        return set(self.outliers.ejected)

    def inflight(self) -> dict[str, int]:
        """Upstream requests in flight per replica."""
        return {rid: n for rid, n in self._inflight.items() if n}

    # ---- requests ----
    async def handle(self, request: Request, kind: str) -> Response:
        """One /v1/completions or /v1/chat/completions request, streaming or not."""
        job = Job(uuid.uuid4().hex, kind, self.clock(), time.time())
        try:
            job.key_id = self._authenticate(request)
            job.priority = request_priority(request)
            job.params = RequestParams.parse(kind, await read_body(request, self.config.max_body_bytes))
            job.assembly = StreamAssembly(job.params)
            if not (plan := self._slices()).is_empty:
                job.assignment = assign(plan, conversation_key(request.headers, job.params.block_hashes,
                                                               job.request_id))
            if self.tracing is not None:
                job.spans = self.tracing.begin(request.headers, job)
            self._admit(job)
            self.budgets.of(job.assignment.colour).record_request()
            body = job.params.upstream_body(PRIORITIES[job.priority])
            job.upstream = await self._open(job, job.params.path, body, budgeted=True)
        except GatewayError as exc:
            self.ledger.finish(job, exc.status, str(exc))
            return exc.response()
        job.replica = job.upstream.endpoint
        if job.params.stream:
            return self._streaming_response(job)
        return await self._collected_response(job)

    def _authenticate(self, request: Request) -> str | None:
        """The key's id (a hash prefix), or None without a key; 401 when keys are required."""
        given = bearer(request)
        keys = self.config.api_keys
        if keys and (given is None or not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)):
            self.metrics.refuse("unauthorized")
            raise GatewayError(401, "missing or invalid API key", type_="invalid_request_error",
                               code="invalid_api_key")
        return key_id(given) if given else None

    def _admit(self, job: Job) -> None:
        """Before any byte goes upstream: a routable replica, room for the priority class, rate limits."""
        assert job.params is not None
        pool = routable(self._candidates(job.assignment.version))
        if not pool:
            self.metrics.refuse("no_replica")
            raise GatewayError(503, "no routable replica (none ready, or all ejected)",
                               type_="service_unavailable", code="no_replica",
                               headers={"Retry-After": str(self.config.retry_after_s)})
        limit = shed_limit(job.priority, self.config.max_inflight_per_replica)
        if all(c.num_inflight >= limit for c in pool):
            self.metrics.refuse(f"shed_{job.priority}")
            raise GatewayError(429, f"every replica has {limit} or more requests in flight; {job.priority} "
                               "requests are shed at this load", type_="rate_limit_error", code="overloaded",
                               headers={"Retry-After": str(self.config.retry_after_s)})
        wait = self.limiter.admit(job.key_id or "anonymous", job.params.num_tokens_estimate)
        if wait > 0:
            self.metrics.refuse("rate_limited")
            raise GatewayError(429, "rate limit exceeded for this API key", type_="rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": str(math.ceil(wait))})

    def _candidates(self, version: str = STABLE) -> list[Candidate]:
        ejected = self.outliers.ejected
        return [Candidate(e, self._load(e.replica_id), self._inflight.get(e.replica_id, 0),
                          e.replica_id in ejected)
                for e in endpoints_for(version, self._endpoints(), self._slices())]

    # ---- upstream attempts ----
    async def _open(self, job: Job, path: str, body: dict[str, Any], *, budgeted: bool) -> Upstream:
        """A primed stream on some replica: up to ``max_retries`` other replicas after a failure."""
        assert job.params is not None
        last: UpstreamError | None = None
        for _ in range(self.config.max_retries + 1):
            candidates = self._candidates(job.assignment.version)
            avoid = job.failed
            suspects = self.liveness.suspects
            if suspects and routable(candidates, exclude=job.failed | suspects):
                avoid = job.failed | suspects
            decision = self.router.pick(candidates, block_hashes=job.params.block_hashes, exclude=avoid)
            job.spans.routed(decision)
            if not decision.is_routed:
                break
            if last is not None and budgeted and not last.is_silence \
                    and not self.budgets.of(job.assignment.colour).try_spend():
                break
            if last is not None:
                job.retries += 1
                self.metrics.retries.labels(last.replica_id, last.reason).inc()
            endpoint = next(c.endpoint for c in candidates if c.replica_id == decision.replica_id)
            logger.debug("[%s] request %s -> %s (%s)", endpoint.replica_id, job.request_id,
                         decision.replica_id, decision.scores)
            try:
                headers = {**(job.spans.attempt(endpoint, path) or {}), **job.assignment.upstream_headers()}
                upstream = await self._attempt(endpoint, path, body, headers or None, job.assignment.colour)
            except UpstreamError as exc:
                job.spans.failed(exc)
                job.failed.add(endpoint.replica_id)
                self._record_failure(exc, job.assignment.colour)
                if not exc.is_retryable:
                    raise exc.to_client(self.config.retry_after_s) from exc
                last = exc
                continue
            self.router.remember(endpoint.replica_id, job.params.block_hashes)
            return upstream
        if last is None:
            raise GatewayError(503, "no routable replica left for this request", type_="service_unavailable",
                               code="no_replica", headers={"Retry-After": str(self.config.retry_after_s)})
        raise last.to_client(self.config.retry_after_s) from last

    async def _attempt(self, endpoint: ReplicaEndpoint, path: str, body: dict[str, Any],
                       headers: dict[str, str] | None, colour: str | None = None) -> Upstream:
        """Send to one replica (with its traceparent) and wait for its first event; in flight until closed."""
        self._acquire(endpoint.replica_id)
        upstream: Upstream | None = None
        try:
            if self.toxics:
                await self._through_toxics(endpoint.replica_id, colour)
            async with self.liveness.watching(endpoint.replica_id):
                response = await self._send(endpoint, path, body, headers)
                upstream = Upstream(endpoint, response, self._release)
                await upstream.prime(self.config.first_byte_timeout_s)
            self.liveness.heard(endpoint.replica_id)
            return upstream
        except BaseException:
            if upstream is None:
                self._release(endpoint.replica_id)
            else:
                await upstream.aclose()
            raise

    async def _through_toxics(self, replica_id: str, colour: str | None) -> None:
        if self.toxics.refuses(replica_id, colour):
            raise UpstreamError(replica_id, "connect", "link refused (link-abort fault)")
        delay = self.toxics.request_delay(replica_id, colour)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _send(self, endpoint: ReplicaEndpoint, path: str, body: dict[str, Any],
                    headers: dict[str, str] | None) -> StreamResponse:
        # A replica answers with its status line as soon as it accepts a stream, before any token: no
        # answer within the stall timeout means it is not serving (partitioned, stopped), whatever its queue.
        cfg = self.config
        return await open_stream(self._streams, endpoint, path, body,
                                 wait_s=min(cfg.first_byte_timeout_s, cfg.stall_timeout_s),
                                 refusal_timeout_s=cfg.first_byte_timeout_s, headers=headers)

    def _acquire(self, replica_id: str) -> None:
        self._inflight[replica_id] += 1
        self.metrics.inflight.labels(replica_id).set(self._inflight[replica_id])

    def _release(self, replica_id: str) -> None:
        self._inflight[replica_id] -= 1
        self.metrics.inflight.labels(replica_id).set(self._inflight[replica_id])

    def _record_failure(self, exc: UpstreamError, colour: str | None) -> None:
        """Count a replica's failure towards its ejection (consecutive failures) and its stall mark.

        A coloured request's failure does not count: the colour is a slice experiment's, whose fault touches
        only that colour; were it to eject the replica or mark it stalled, the uncoloured traffic would lose
        the replica too, the very blast radius the experiment promises to keep. Its failures are what the
        experiment measures (and stops itself on); the uncoloured requests still judge the replica."""
        rid = exc.replica_id
        if colour is not None:
            logger.info("[%s] upstream failure of a %r-coloured request (not counted against it): %s",
                        rid, colour, exc)
            return
        logger.info("[%s] upstream failure: %s", rid, exc)
        self.liveness.failed(exc)
        if exc.is_failure and self.outliers.record_failure(rid):
            self._ejected(rid, f"{self.config.eject_after_failures} consecutive failures; last: {exc}")

    def _ejected(self, replica_id: str, why: str) -> None:
        """``replica_id`` was just ejected (routed around until a probe re-admits it)."""
        logger.warning("[%s] ejected: %s", replica_id, why)
        self.metrics.ejections.labels(replica_id).inc()
        self.metrics.ejected.set(len(self.outliers.ejected))
        self._emit("ejected", replica_id, why)

    def _emit(self, kind: str, replica_id: str, detail: str) -> None:
        try:
            self._on_event(kind, replica_id, detail)
        except Exception:
            logger.exception("[%s] on_event(%s) failed", replica_id, kind)

    # ---- relaying and resuming ----
    async def _chunks(self, job: Job) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The client's chunks in batches (one per read), resumed elsewhere when a stream breaks."""
        assert job.assembly is not None and job.upstream is not None
        while True:
            try:
                async with contextlib.aclosing(self._relay(job, job.upstream)) as relay:
                    async for batch in relay:
                        yield batch
                break
            except UpstreamError as exc:
                job.spans.failed(exc)
                self._record_failure(exc, job.assignment.colour)
                if job.assembly.is_finished:
                    break  # broken after the last token: nothing is lost
                job.upstream = await self._resume(job, exc)
                if job.upstream is None:
                    break

    async def _relay(self, job: Job, upstream: Upstream) -> AsyncGenerator[list[dict[str, Any]], None]:
        """One upstream stream's chunks for the client until ``[DONE]``, a batch per read (one write)."""
        assembly = job.assembly
        assert assembly is not None
        opened = self.clock()
        batch: list[dict[str, Any]] = []
        try:
            while (event := await upstream.next_event(self.config.stall_timeout_s)) is not None:
                if self.toxics and self.toxics.reset_due(upstream.replica_id, opened, job.assignment.colour):
                    raise UpstreamError(upstream.replica_id, "broken", "link reset (link-abort fault)")
                self.liveness.heard(upstream.replica_id)
                try:
                    batch += assembly.accept(event)
                except BadEvent as exc:  # the replica's fault: resumed elsewhere like a broken stream
                    raise UpstreamError(upstream.replica_id, "bad_event", str(exc)) from exc
                if event.get("choices"):
                    job.replica = upstream.endpoint
                if job.first_token_at is None and assembly.token_ids:
                    job.first_token_at = self.clock()
                if batch and not upstream.has_buffered:
                    yield batch
                    batch = []
            if batch:
                yield batch
            if not assembly.is_finished:
                raise UpstreamError(upstream.replica_id, "closed", "[DONE] before the last token")
            self.outliers.record_success(upstream.replica_id)
            self.liveness.heard(upstream.replica_id)
            job.spans.relayed()
        finally:
            await upstream.aclose()

    async def _resume(self, job: Job, exc: UpstreamError) -> Upstream | None:
        """Go on elsewhere from what was delivered; None when nothing is left to generate."""
        assembly = job.assembly
        assert assembly is not None
        job.failed.add(exc.replica_id)
        if assembly.is_exhausted():
            assembly.finish_locally("length")
            return None
        if assembly.num_resumes >= MAX_RESUMES:
            raise GatewayError(503, f"the stream broke {MAX_RESUMES + 1} times; last: {exc}",
                               type_="service_unavailable", code="resume_failed") from exc
        detail = (f"request {job.request_id}: {exc.reason} after {len(assembly.token_ids)} tokens; "
                  f"continuing from token {assembly.resume_point()[0]}")
        path, body = assembly.continuation(PRIORITIES[job.priority])
        logger.warning("[%s] resuming %s", exc.replica_id, detail)
        self.metrics.resumes.labels(exc.replica_id, exc.reason).inc()
        self._emit("resumed", exc.replica_id, detail)
        job.spans.resuming(exc, len(assembly.token_ids))
        return await self._open(job, path, body, budgeted=False)

    def _streaming_response(self, job: Job) -> Response:
        assert job.upstream is not None
        stream = self._event_stream(job)

        async def close() -> None:
            await stream.aclose()
            if job.upstream is not None:
                await job.upstream.aclose()
            self.ledger.finish(job, 200, CLIENT_DISCONNECTED)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                   REPLICA_HEADER: job.upstream.replica_id, **tried_header(job)}
        return EventStreamResponse(stream, on_close=close, headers=headers)

    async def _event_stream(self, job: Job) -> AsyncGenerator[bytes, None]:
        assert job.assembly is not None
        error: str | None = None
        try:
            async with contextlib.aclosing(self._chunks(job)) as batches:
                async for batch in batches:
                    yield b"".join(map(sse_event, batch))
            yield b"".join(map(sse_event, job.assembly.closing_chunks())) + DONE_EVENT
        except GatewayError as exc:
            error = str(exc)
            logger.error("request %s failed mid-stream: %s", job.request_id, exc)
            yield sse_event(exc.body)
        except Exception as exc:  # a bug must still end the stream the way an OpenAI client understands
            error = f"internal error: {type(exc).__name__}: {exc}"
            logger.exception("request %s: gateway error mid-stream", job.request_id)
            yield sse_event(error_body(error, type_="server_error", code="gateway_error"))
        finally:
            self.ledger.finish(job, 200, error)

    async def _collected_response(self, job: Job) -> Response:
        assert job.assembly is not None
        try:
            async with contextlib.aclosing(self._chunks(job)) as chunks:
                async for _ in chunks:
                    pass
        except GatewayError as exc:
            self.ledger.finish(job, exc.status, str(exc))
            return exc.response()
        finally:
            if job.upstream is not None:
                await job.upstream.aclose()
        self.ledger.finish(job, 200, None)
        rid = job.replica.replica_id if job.replica else ""
        return JSONResponse(job.assembly.full_response(), headers={REPLICA_HEADER: rid, **tried_header(job)})

    # ---- other endpoints ----
    async def models(self, request: Request) -> Response:
        """The models of the routable replicas, deduplicated by id."""
        try:
            self._authenticate(request)
        except GatewayError as exc:
            return exc.response()
        data = await served_models(self._client, [c.endpoint for c in routable(self._candidates())])
        return JSONResponse({"object": "list", "data": data})

    def health(self) -> dict[str, Any]:
        """The gateway's own liveness, with what it routes to."""
        return {"status": "ok", "routable": [c.replica_id for c in routable(self._candidates())],
                "ejected": sorted(self.outliers.ejected), "inflight": self.inflight()}

    # ---- re-admission ----
    async def probe_once(self) -> None:
        """One round of the active health checks (:mod:`controlplane.gateway.health_checks`)."""
        await self.checks.run_once()

    def _readmit(self, replica_id: str, why: str) -> None:
        self.outliers.readmit(replica_id)
        self.router.affinity.forget(replica_id)
        self.metrics.ejected.set(len(self.outliers.ejected))
        self.metrics.readmissions.labels(replica_id).inc()
        logger.warning("[%s] re-admitted: %s", replica_id, why)
        self._emit("readmitted", replica_id, why)
