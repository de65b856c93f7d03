"""One request as the gateway saw it: its own timings plus the replica's stage timings.

The gateway emits a :class:`TraceRecord` per request; the store keeps every trace above the running P95
end-to-end latency and a sample of the rest, so the console can attribute tail latency to stages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class TraceRecord:
    request_id: str
    started_at: float  # wall clock (POSIX seconds) when the gateway received the request
    endpoint: str  # /v1/completions | /v1/chat/completions
    model: str
    status: int  # HTTP status the client got (200 even if the stream later failed: see error)
    replica_id: str | None  # the replica that produced the final token
    zone: str | None
    priority: str  # interactive | standard | batch
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None  # as the client saw it, gateway included
    e2e_s: float
    gateway_s: float  # time spent in the gateway itself (routing, retries, proxying overhead)
    queue_s: float | None  # the replica's stage timings (None when the replica sent none)
    prefill_s: float | None
    decode_s: float | None
    detokenize_s: float | None
    serialize_s: float | None
    retries: int = 0  # other replicas tried before the first byte
    resumes: int = 0  # mid-stream continuations on another replica
    error: str | None = None
    api_key_id: str | None = None  # a hash prefix of the client key, never the key
