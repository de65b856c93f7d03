"""OpenTelemetry traces: the OTLP/HTTP export that replicas and gateways share, and a replica's spans.

Where it sits: ``python -m inference serve --otlp-traces-endpoint URL`` starts a :class:`ReplicaTracing`
(:func:`start_provider`: a tracer provider with a batch processor and the OTLP/HTTP protobuf exporter,
parent-based sampling). The server hands it every request that ends, with the W3C ``traceparent`` it came
with, and the spans are written after the fact from the timestamps the engine keeps anyway
(:class:`~inference.output.RequestMetrics`): one span for the request, named and described after
OpenTelemetry's GenAI semantic conventions, with a child for the queue wait, one per prefill chunk and
one for the decode. Nothing is timed twice and nothing happens per token. With tracing off (the default)
the server never imports the SDK, no exporter thread runs, and a request costs one ``is None`` check.

The gateway (:mod:`controlplane.gateway.tracing`) starts its provider with :func:`start_provider` and
reads and writes ``traceparent`` with :func:`extract` and :func:`inject`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from inference.config import TracingConfig
from inference.output import RequestMetrics, RequestOutput
from inference.protocol import ParsedRequest, ResponseContext
from inference.sampling_params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler

logger = logging.getLogger(__name__)

SCOPE = "llm-sre"  # the instrumentation scope of every span here and in the gateway
# OpenTelemetry GenAI semantic conventions (gen_ai.*), the names tracing backends chart LLM calls by
OPERATION = "gen_ai.operation.name"  # chat | text_completion
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
TOP_K = "gen_ai.request.top_k"
SEED = "gen_ai.request.seed"
STREAM = "gen_ai.request.stream"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prompt tokens served from the prefix cache
# vLLM's own request-span attributes, so that views built for vLLM's spans read these
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
TIME_E2E = "gen_ai.latency.e2e"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
OPERATIONS = {"chat": "chat", "completion": "text_completion"}
SHUTDOWN_TIMEOUT_S = 2.0  # the longest a stop waits for the last spans to reach the collector

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate


def extract(headers: Mapping[str, str]) -> Context:
    """The parent a request's ``traceparent`` names (an empty context when it has none, or a bad one)."""
    return _PROPAGATOR.extract(headers)


def inject(context: Context, headers: MutableMapping[str, str]) -> None:
    """``traceparent`` (and ``tracestate``) for a request made in ``context``."""
    _PROPAGATOR.inject(headers, context=context)


def start_provider(config: TracingConfig, *, service_name: str, attributes: Mapping[str, str | int],
                   trust_remote_sampled: bool = True) -> TracerProvider:
    """A tracer provider that batches spans to ``config``'s OTLP/HTTP endpoint (protobuf) on a thread of
    its own. Its own provider, not the global one: a test process may run several gateways, each with its
    own settings.

    Sampling is parent-based, ``sample_ratio`` for new traces. A remote parent that says "not sampled" is
    always followed (it can only make less to export). One that says "sampled" is followed when
    ``trust_remote_sampled`` (a replica, whose parent is its gateway's attempt); otherwise (the gateway,
    whose remote parent is whatever a client sent) the request is kept at ``sample_ratio`` by a draw of
    its own, so that neither the client's flag nor the trace id it chose can force an export."""
    # Imported here: with tracing off nothing pays for the SDK, the exporter or protobuf.
    import requests
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    ratio = TraceIdRatioBased(config.sample_ratio)
    sampler = ParentBased(ratio) if trust_remote_sampled else \
        ParentBased(ratio, remote_parent_sampled=_untrusted_parent_sampler(config.sample_ratio))
    resource = Resource.create({"service.name": service_name, **attributes})
    provider = TracerProvider(resource=resource, sampler=sampler)
    session = requests.Session()
    session.trust_env = False  # as every client here: no proxy taken from the environment
    exporter = OTLPSpanExporter(endpoint=config.traces_url, session=session)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    logger.warning("exporting traces to %s (OTLP/HTTP, sampling %g of new traces)",
                   loggable_url(config.traces_url), config.sample_ratio)
    return provider


def _untrusted_parent_sampler(sample_ratio: float) -> Sampler:
    """``sample_ratio`` of the requests whose parent says "sampled", each drawn at random: not by its
    trace id, which the client chose (a low one passes any ratio above 0 by trace id)."""
    from opentelemetry.sdk.trace.sampling import SamplingResult, TraceIdRatioBased

    class DrawnRatio(TraceIdRatioBased):
        def should_sample(self, parent_context: Context | None, trace_id: int, name: str,
                          kind: SpanKind | None = None, attributes: Attributes = None,
                          links: Sequence[Link] | None = None,
                          trace_state: TraceState | None = None) -> SamplingResult:
            return super().should_sample(parent_context, random.getrandbits(64), name, kind, attributes,
                                         links, trace_state)

        def get_description(self) -> str:
            return f"DrawnRatio{{{self.rate}}}"

    return DrawnRatio(sample_ratio)


def loggable_url(url: str) -> str:
    """``url`` without its user, password, query and fragment (where credentials and tokens ride)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def stop_provider(provider: TracerProvider, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Export what is buffered and stop the exporter thread, waiting at most ``timeout_s``: a collector
    that does not answer must not hold up a shutdown (what it has not taken by then is dropped)."""
    worker = threading.Thread(target=_shutdown, args=(provider,), name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("trace export still unfinished after %gs: the spans not yet sent are dropped",
                       timeout_s)


def _shutdown(provider: TracerProvider) -> None:
    try:
        provider.shutdown()
    except Exception:  # a collector that is gone must not fail a shutdown
        logger.exception("trace export shutdown failed")


@dataclass(slots=True, frozen=True)
class TracedRequest:
    """What a replica's request span says besides the engine's timings."""

    kind: str  # completion | chat
    model: str
    response_id: str
    params: SamplingParams
    stream: bool


class ReplicaTracing:
    """A replica's spans: :meth:`begin` per request, and :meth:`record` writes its tree when it ends."""

    def __init__(self, provider: TracerProvider, *, clock: Callable[[], float]) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE)
        self.clock = clock  # the engine's clock, which RequestMetrics' timestamps are read on

    def begin(self, headers: Mapping[str, str], parsed: ParsedRequest, ctx: ResponseContext) -> RequestTrace:
        """A request's trace, the child of the span its ``traceparent`` names (a new trace without one)."""
        request = TracedRequest(parsed.kind, ctx.model, ctx.request_id, parsed.params, parsed.stream)
        return RequestTrace(self, extract(headers), request)

    def record(self, parent: Context, request: TracedRequest, out: RequestOutput,
               error: str | None = None) -> None:
        """The request span (a child of the gateway's attempt when ``parent`` names one) and its stages."""
        m = out.metrics
        to_ns = _wall_ns(self.clock)
        operation = OPERATIONS.get(request.kind, request.kind)
        span = self.tracer.start_span(f"{operation} {request.model}", context=parent, kind=SpanKind.SERVER,
                                      start_time=to_ns(m.arrival_time),
                                      attributes=_request_attributes(operation, request, out))
        if not span.is_recording():  # not sampled: no children either
            return
        inner = trace.set_span_in_context(span)
        self._stage("queue", inner, m.arrival_time, m.first_scheduled_time, to_ns, {})
        for i, (start, end, num_tokens) in enumerate(m.prefill_chunks or ()):
            self._stage("prefill", inner, start, end, to_ns, {"llmsre.prefill.chunk": i,
                                                              "llmsre.prefill.tokens": num_tokens})
        if m.first_token_time is not None and m.last_token_time is not None:
            num_decoded = max(len(out.output_token_ids) - 1, 0)  # the first token came out of the prefill
            self._stage("decode", inner, m.first_token_time, m.last_token_time, to_ns,
                        {"llmsre.decode.tokens": num_decoded, OUTPUT_TOKENS: len(out.output_token_ids)})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
            span.set_attribute("error.type", "device_failure")
        span.end(end_time=to_ns(_last_time(m, self.clock)))

    def _stage(self, name: str, parent: Context, start: float | None, end: float | None,
               to_ns: Callable[[float], int], attributes: dict[str, Any]) -> None:
        if start is None or end is None:
            return
        span = self.tracer.start_span(name, context=parent, start_time=to_ns(start), attributes=attributes)
        span.end(end_time=to_ns(max(end, start)))

    def shutdown(self) -> None:
        stop_provider(self.provider)


class RequestTrace:
    """One request on its way through the server: the last output seen, and its spans once it ends
    (finished, failed, or cut off by its client, as a gateway does with a stream it resumes elsewhere)."""

    def __init__(self, tracing: ReplicaTracing, parent: Context, request: TracedRequest) -> None:
        self.tracing, self.parent, self.request = tracing, parent, request
        self.last: RequestOutput | None = None
        self.is_ended = False

    def seen(self, out: RequestOutput) -> None:
        self.last = out
        if out.finished:
            self.end()

    def end(self) -> None:
        """Write the spans (once; nothing when no output came)."""
        if self.is_ended or self.last is None:
            return
        self.is_ended = True
        try:
            self.tracing.record(self.parent, self.request, self.last, self.last.error)
        except Exception:  # a trace must never fail a request
            logger.exception("request %s: spans not recorded", self.request.response_id)

    async def wrap(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """``chunks`` as they come; the spans are written however the stream ends."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.end()


def _request_attributes(operation: str, request: TracedRequest, out: RequestOutput) -> dict[str, Any]:
    m, p = out.metrics, request.params
    attributes: dict[str, Any] = {
        OPERATION: operation, REQUEST_MODEL: request.model, RESPONSE_MODEL: request.model,
        RESPONSE_ID: request.response_id, MAX_TOKENS: p.max_tokens, TEMPERATURE: p.temperature,
        TOP_P: p.top_p, TOP_K: p.top_k, STREAM: request.stream,
        INPUT_TOKENS: len(out.prompt_token_ids), OUTPUT_TOKENS: len(out.output_token_ids),
        CACHED_INPUT_TOKENS: m.num_cached_tokens, "llmsre.preemptions": m.num_preemptions,
        "llmsre.output_offset": p.output_offset,  # tokens produced elsewhere before (a resumed stream)
        FINISH_REASONS: [out.finish_reason or "abort"],
        TIME_IN_QUEUE: m.queue_time, TIME_TO_FIRST_TOKEN: m.ttft, TIME_E2E: m.e2e_time,
        TIME_IN_PREFILL: m.prefill_time, TIME_IN_DECODE: m.decode_time}
    if p.seed is not None:
        attributes[SEED] = p.seed
    return attributes


def _wall_ns(clock: Callable[[], float]) -> Callable[[float], int]:
    """Engine-clock readings (monotonic seconds) as wall-clock nanoseconds, which spans carry."""
    offset = time.time() - clock()
    return lambda t: int((t + offset) * 1e9)


def _last_time(m: RequestMetrics, clock: Callable[[], float]) -> float:
    """When the request ended: finished, else its last token (a stream cut by its client), else now."""
    for t in (m.finished_time, m.last_token_time):
        if t is not None:
            return t
    return clock()
