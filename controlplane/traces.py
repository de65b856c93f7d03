"""One request as the gateway saw it: its own timings plus the replica's stage timings.

The gateway emits a :class:`TraceRecord` per request; the store keeps every trace above the running P95
end-to-end latency and a sample of the rest, so the console can attribute tail latency to stages.
"""

from __future__ import annotations

import random
from collections import deque
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
    trace_id: str | None = None  # the OpenTelemetry trace (32 hex digits) when it was exported and sampled


class TraceSampler:
    """Which traces to keep: every request above the running P95 end-to-end latency, and a sample of
    the rest. The P95 comes from a sliding window of recent requests."""

    def __init__(self, sample_rate: float, *, window: int = 1000, rng: random.Random | None = None) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate: must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.recent: deque[float] = deque(maxlen=window)
        self.rng = rng or random.Random()

    def keep(self, record: TraceRecord) -> bool:
        threshold = self.p95()
        self.recent.append(record.e2e_s)
        if record.error is not None or threshold is None or record.e2e_s >= threshold:
            return True
        return self.rng.random() < self.sample_rate

    def p95(self) -> float | None:
        if len(self.recent) < 20:
            return None  # too few to know the tail: keep everything
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
