"""One request as the gateway saw it: its own timings plus the replica's stage timings.

The gateway emits a :class:`TraceRecord` per request; the store keeps every trace above the running P95
end-to-end latency and a sample of the rest, so the console can attribute tail latency to stages.
"""

from __future__ import annotations

import bisect
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
    the rest. The P95 comes from a sliding window of recent requests.

    The gateway asks once per request it relays, so the window is kept sorted as well as in arrival
    order: a request costs two binary searches and two list shifts, not a sort of the window."""

    def __init__(self, sample_rate: float, *, window: int = 1000, rng: random.Random | None = None) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate: must be in [0, 1], got {sample_rate}")
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.sample_rate = sample_rate
        self.window = window
        self.recent: deque[float] = deque()  # arrival order: the oldest leaves first
        self._ordered: list[float] = []  # the same values, sorted
        self.rng = rng or random.Random()

    def keep(self, record: TraceRecord) -> bool:
        threshold = self.p95()
        self._add(record.e2e_s)
        if record.error is not None or threshold is None or record.e2e_s >= threshold:
            return True
        return self.rng.random() < self.sample_rate

    def p95(self) -> float | None:
        ordered = self._ordered
        if len(ordered) < 20:
            return None  # too few to know the tail: keep everything
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def _add(self, value: float) -> None:
        if len(self.recent) == self.window:
            oldest = self.recent.popleft()
            del self._ordered[bisect.bisect_left(self._ordered, oldest)]
        self.recent.append(value)
        bisect.insort(self._ordered, value)
