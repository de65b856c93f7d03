"""One request as the gateway handles it: its record while it runs, what its headers and body say, and
the trace it leaves. The body is read with a size limit before it is parsed, and parsed strictly."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request

from controlplane.gateway.assembly import RequestParams, StreamAssembly
from controlplane.gateway.errors import bad_request, too_large
from controlplane.gateway.slices import Assignment
from controlplane.gateway.tracing import NO_SPANS, RequestSpans
from controlplane.gateway.upstream import Upstream
from controlplane.replicas import ReplicaEndpoint
from controlplane.traces import TraceRecord

PRIORITY_HEADER = "x-priority"
TRIED_HEADER = "x-gateway-tried"  # replicas tried first that failed before the first byte (when any)
PRIORITIES = {"interactive": 0, "standard": 1, "batch": 2}  # header class -> the replica's priority field
DEFAULT_PRIORITY = "standard"
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
STAGES = ("queue", "prefill", "decode", "detokenize", "serialize")  # the replica's timings, in order
KEY_ID_CHARS = 12  # sha256 hex prefix that stands for an API key in traces


@dataclass(slots=True)
class Job:
    request_id: str
    kind: str
    started: float  # gateway clock
    started_wall: float
    key_id: str | None = None
    priority: str = DEFAULT_PRIORITY
    params: RequestParams | None = None
    assembly: StreamAssembly | None = None
    upstream: Upstream | None = None  # the stream being relayed now
    replica: ReplicaEndpoint | None = None  # the replica that produced the latest token
    failed: set[str] = field(default_factory=set)  # replicas that failed this request
    retries: int = 0
    first_token_at: float | None = None
    done: bool = False  # its trace was emitted
    spans: RequestSpans = NO_SPANS  # its OpenTelemetry spans (controlplane.gateway.tracing)
    assignment: Assignment = field(default_factory=Assignment)  # its model version and colour (slices)

    @property
    def endpoint(self) -> str:
        return PATHS[self.kind]


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:KEY_ID_CHARS]


def bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


def request_priority(request: Request) -> str:
    value = request.headers.get(PRIORITY_HEADER, DEFAULT_PRIORITY).strip().lower()
    if value not in PRIORITIES:
        raise bad_request(PRIORITY_HEADER, f"must be one of {', '.join(PRIORITIES)}, got {value!r}")
    return value


async def read_body(request: Request, limit: int) -> Any:
    """The JSON body, read only up to ``limit`` bytes: a declared or actual size above it is a 413 before
    the rest is read. Parsed by orjson, which refuses what a Python parser would choke on (nesting deeper
    than 1,024, numbers out of range, NaN, lone surrogates) with a ValueError: a 400, never a 500."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise bad_request("body", f"not valid JSON: {exc}") from exc


def stage_seconds(timings: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The replica's stage timings from a final chunk (None where it sent none)."""
    timings = timings or {}
    return {stage: seconds(timings.get(stage)) for stage in STAGES}


def seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def job_trace(job: Job, *, status: int, error: str | None, e2e: float, gateway_s: float,
              ttft: float | None, stages: dict[str, float | None],
              replica: ReplicaEndpoint | None) -> TraceRecord:
    """The request's trace: the gateway's own timings, the replica's stages, and how it was served."""
    assembly = job.assembly
    prompt_tokens = 0
    if assembly is not None:
        prompt_tokens = int(assembly.usage().get("prompt_tokens", 0)) if assembly.meta else 0
    return TraceRecord(
        request_id=job.request_id, started_at=job.started_wall, endpoint=job.endpoint,
        model=job.params.model if job.params else "", status=status,
        replica_id=replica.replica_id if replica else None, zone=replica.zone if replica else None,
        priority=job.priority, prompt_tokens=prompt_tokens,
        output_tokens=len(assembly.token_ids) if assembly else 0, ttft_s=ttft, e2e_s=e2e,
        gateway_s=gateway_s, queue_s=stages["queue"], prefill_s=stages["prefill"],
        decode_s=stages["decode"], detokenize_s=stages["detokenize"], serialize_s=stages["serialize"],
        retries=job.retries, resumes=assembly.num_resumes if assembly else 0, error=error,
        api_key_id=job.key_id, trace_id=job.spans.trace_id)


def tried_header(job: Job) -> dict[str, str]:
    """The replicas that failed this request before its first byte, for the client to see."""
    return {TRIED_HEADER: ",".join(sorted(job.failed))} if job.failed else {}
