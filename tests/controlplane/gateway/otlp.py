"""A real OTLP/HTTP traces receiver for tests: ``POST /v1/traces`` on 127.0.0.1, protobuf bodies decoded
with the official OpenTelemetry protobuf definitions (``opentelemetry-proto``), as a collector would."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # resource service.name
    resource: dict[str, Any]
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: str  # SERVER, CLIENT, INTERNAL
    attributes: dict[str, Any]
    is_error: bool
    status_message: str
    start_ns: int
    end_ns: int


class OtlpReceiver:
    """Every span exported to :attr:`url`, decoded; bodies that are not OTLP protobuf get a 4xx."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def accept(self, request: ExportTraceServiceRequest) -> None:
        spans = [_span(resource_spans.resource.attributes, span)
                 for resource_spans in request.resource_spans
                 for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != PROTOBUF:
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            receiver.accept(ExportTraceServiceRequest.FromString(body))
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", PROTOBUF)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _span(resource: Any, span: Span) -> ReceivedSpan:
    attributes = _attributes(resource)
    return ReceivedSpan(
        service=str(attributes.get("service.name", "")), resource=attributes, name=span.name,
        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(),
        kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
        attributes=_attributes(span.attributes),
        is_error=span.status.code == Status.STATUS_CODE_ERROR, status_message=span.status.message,
        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
