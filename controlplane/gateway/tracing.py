"""The gateway's OpenTelemetry spans: one tree per request, joined to the client's trace and to the
replicas' spans by W3C ``traceparent``.

Where it sits: :class:`~controlplane.gateway.handler.Gateway` starts a :class:`GatewayTracing` when
``[gateway] otlp_traces_endpoint`` is set, and each request gets a :class:`RequestSpans` that the handler
tells what happens (routed, attempt, failed, resuming, relayed, finish). With tracing off every request
holds :data:`NO_SPANS`, whose calls do nothing: no span objects, no exporter thread, no ``traceparent``.

The tree of a request that was resumed on a second replica::

    POST /v1/completions        SERVER: the client's traceparent is its parent (a new trace without one)
      route                     policy, chosen replica, scores (one per pick)
      upstream first            CLIENT: replica, zone; failed with error.type = why the stream broke
        text_completion default the replica's spans (inference.tracing): queue, prefill chunks, decode
      route
      upstream resume           llmsre.attempt.reason (the failure it follows), llmsre.resume.from_token
        text_completion default

A client's ``traceparent`` names the trace, and its "not sampled" is followed, but its "sampled" is not
trusted: such a request is kept at ``otlp_sample_ratio`` like a new trace (:func:`start_provider`'s
``trust_remote_sampled``). Each attempt's context goes upstream as ``traceparent``, so a replica's
request span is the attempt's child; an attempt that is not sampled still sends its ``traceparent``
(flag 00), so the replicas, sampling by parent, do not start traces of their own for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, format_trace_id

from controlplane.gateway.assembly import RequestParams, StreamAssembly
from controlplane.gateway.errors import UpstreamError
from controlplane.gateway.routing import RoutingDecision
from controlplane.replicas import ReplicaEndpoint
from controlplane.traces import TraceRecord
from inference.config import TracingConfig
from inference.tracing import (
    INPUT_TOKENS,
    MAX_TOKENS,
    OPERATION,
    OPERATIONS,
    OUTPUT_TOKENS,
    REQUEST_MODEL,
    SCOPE,
    STREAM,
    extract,
    inject,
    start_provider,
    stop_provider,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

SERVICE_NAME = "llm-sre-gateway"
CLIENT_DISCONNECTED = "client disconnected"  # the error of a request whose client left before its end
CLIENT_CANCELLED = "llmsre.client.cancelled"  # on a request span: the client left (its status stays unset)


class Job(Protocol):
    """What the request span is begun from (:class:`controlplane.gateway.request.Job`, which holds the
    :class:`RequestSpans` and so is not imported here)."""

    @property
    def started_wall(self) -> float: ...

    @property
    def params(self) -> RequestParams | None: ...

    @property
    def assembly(self) -> StreamAssembly | None: ...


class RequestSpans:
    """What happens to one request, as spans. This base records nothing: tracing is off."""

    trace_id: str | None = None  # 32 hex digits while the trace is sampled (kept with the request's row)

    def routed(self, decision: RoutingDecision) -> None:
        """A pick of the router."""

    def attempt(self, endpoint: ReplicaEndpoint, path: str) -> dict[str, str] | None:
        """An upstream request starts; the headers that carry its ``traceparent``."""
        return None

    def failed(self, exc: UpstreamError) -> None:
        """The attempt under way failed (before its first byte, or mid-stream)."""

    def resuming(self, exc: UpstreamError, from_token: int) -> None:
        """The next attempt continues the stream that ``exc`` broke, after ``from_token`` tokens."""

    def relayed(self) -> None:
        """The attempt under way relayed its stream to the end."""

    def finish(self, record: TraceRecord) -> None:
        """The request is over; ``record`` is what the gateway's own trace row says."""


NO_SPANS = RequestSpans()


class _Unsampled(RequestSpans):
    """A request whose trace is not sampled: only its ``traceparent`` (flag 00) goes upstream."""

    def __init__(self, span: Span) -> None:
        self._headers: dict[str, str] = {}
        inject(trace.set_span_in_context(span), self._headers)

    def attempt(self, endpoint: ReplicaEndpoint, path: str) -> dict[str, str] | None:
        return self._headers


class _Recording(RequestSpans):
    """A sampled request: the request span, and a child per routing decision and per upstream attempt."""

    def __init__(self, tracer: Tracer, span: Span, assembly: StreamAssembly) -> None:
        self._tracer, self._span, self._assembly = tracer, span, assembly
        self._context = trace.set_span_in_context(span)
        self.trace_id = format_trace_id(span.get_span_context().trace_id)
        self._attempt: Span | None = None
        self._tokens_before = 0  # tokens delivered when the attempt under way started
        self._num_attempts = 0
        self._next: dict[str, Any] = {"llmsre.attempt.kind": "first"}

    def routed(self, decision: RoutingDecision) -> None:
        attributes: dict[str, Any] = {"llmsre.route.policy": decision.policy,
                                      "llmsre.route.replica": decision.replica_id or "",
                                      "llmsre.route.scores": [f"{rid}={v:.4g}" for rid, v in decision.scores],
                                      "llmsre.route.excluded": list(decision.excluded),
                                      "llmsre.route.affinity_blocks": decision.affinity_blocks}
        self._tracer.start_span("route", context=self._context, attributes=attributes).end()

    def attempt(self, endpoint: ReplicaEndpoint, path: str) -> dict[str, str] | None:
        self._end_attempt(None)
        self._num_attempts += 1
        attributes = {"llmsre.replica.id": endpoint.replica_id, "llmsre.replica.zone": endpoint.zone,
                      "server.address": endpoint.host, "server.port": endpoint.port,
                      "http.request.method": "POST", "url.path": path, "llmsre.attempt": self._num_attempts,
                      **self._next}
        span = self._tracer.start_span(f"upstream {self._next['llmsre.attempt.kind']}", context=self._context,
                                       kind=SpanKind.CLIENT, attributes=attributes)
        self._attempt, self._tokens_before = span, len(self._assembly.token_ids)
        headers: dict[str, str] = {}
        inject(trace.set_span_in_context(span), headers)
        return headers

    def failed(self, exc: UpstreamError) -> None:
        self._end_attempt(exc)
        self._next = {"llmsre.attempt.kind": "retry", "llmsre.attempt.reason": exc.reason}

    def resuming(self, exc: UpstreamError, from_token: int) -> None:
        self._next = {"llmsre.attempt.kind": "resume", "llmsre.attempt.reason": exc.reason,
                      "llmsre.resume.from_token": from_token}

    def relayed(self) -> None:
        self._end_attempt(None)

    def _end_attempt(self, exc: UpstreamError | None) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        span.set_attribute("llmsre.attempt.tokens", len(self._assembly.token_ids) - self._tokens_before)
        if exc is not None:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            span.set_attribute("error.type", exc.reason)
            if exc.status is not None:
                span.set_attribute("http.response.status_code", exc.status)
        span.end()

    def finish(self, record: TraceRecord) -> None:
        self._end_attempt(None)  # the client left mid-stream
        span = self._span
        span.set_attributes({
            "http.response.status_code": record.status, INPUT_TOKENS: record.prompt_tokens,
            OUTPUT_TOKENS: record.output_tokens, "llmsre.request.id": record.request_id,
            "llmsre.priority": record.priority, "llmsre.retries": record.retries,
            "llmsre.resumes": record.resumes, "llmsre.replica.id": record.replica_id or "",
            "llmsre.gateway_s": record.gateway_s})
        if record.ttft_s is not None:
            span.set_attribute("llmsre.ttft_s", record.ttft_s)
        if record.status == 200 and record.error == CLIENT_DISCONNECTED:
            span.set_attribute(CLIENT_CANCELLED, True)  # the client's doing, not a server error: no status
        elif record.error is not None or record.status >= 500:
            span.set_status(Status(StatusCode.ERROR, record.error or f"HTTP {record.status}"))
            span.set_attribute("error.type", str(record.status) if record.status >= 400 else "stream_error")
        span.end()


class GatewayTracing:
    """The gateway's tracer, exporting over OTLP/HTTP; :meth:`begin` gives each request its spans."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE)

    @classmethod
    def start(cls, config: TracingConfig) -> GatewayTracing:
        # a client's traceparent names the trace and may say "not sampled", but its "sampled" does not
        # overrule otlp_sample_ratio: any client (with no api_keys, anyone) could load the collector at will
        return cls(start_provider(config, service_name=SERVICE_NAME, attributes={"process.pid": os.getpid()},
                                  trust_remote_sampled=False))

    def begin(self, headers: Mapping[str, str], job: Job) -> RequestSpans:
        """The request span, a child of the client's ``traceparent`` when it sent one."""
        params, assembly = job.params, job.assembly
        assert params is not None and assembly is not None
        operation = OPERATIONS.get(params.kind, params.kind)
        attributes: dict[str, Any] = {"http.request.method": "POST", "url.path": params.path,
                                      OPERATION: operation, REQUEST_MODEL: params.model,
                                      STREAM: params.stream}
        if params.max_tokens is not None:
            attributes[MAX_TOKENS] = params.max_tokens
        span = self.tracer.start_span(f"POST {params.path}", context=extract(headers), kind=SpanKind.SERVER,
                                      start_time=int(job.started_wall * 1e9), attributes=attributes)
        if not span.is_recording():
            return _Unsampled(span)
        return _Recording(self.tracer, span, assembly)

    def shutdown(self) -> None:
        """Send what is buffered, for :data:`~inference.tracing.SHUTDOWN_TIMEOUT_S` at most."""
        stop_provider(self.provider)
