"""What the fleet did and how it served: events, the golden signals, traces, chart series and where the
time of slow requests went, the expert load of a mixture-of-experts fleet (``/api/v1/events``,
``/api/v1/metrics/*``, ``/api/v1/traces/slow``, ``/api/v1/latency/breakdown``). Part of
:mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class Event:
    id: int
    ts: float  # POSIX seconds
    kind: str  # noun.verb, such as "replica.spawned"
    subject: str  # what it happened to, such as a replica id
    detail: Mapping[str, Any]  # one shape per kind


@dataclass(slots=True, frozen=True)
class Quantiles:
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


@dataclass(slots=True, frozen=True)
class MetricSummary:
    """The golden signals of a scope over one window; None: no data (not zero)."""

    scope: str
    window_s: float
    replicas: tuple[str, ...]
    qps: float | None
    error_rate: float | None
    ttft: Quantiles = Quantiles()
    tpot: Quantiles = Quantiles()
    e2e: Quantiles = Quantiles()
    queue: Quantiles = Quantiles()
    prefill: Quantiles = Quantiles()
    decode: Quantiles = Quantiles()
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    num_waiting: float | None = None
    num_running: float | None = None
    generation_tokens_per_s: float | None = None


@dataclass(slots=True, frozen=True)
class Trace:
    """One request as the gateway saw it, with the replica's stage timings (seconds)."""

    request_id: str
    started_at: float
    endpoint: str
    model: str
    status: int
    replica_id: str | None
    zone: str | None
    priority: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float
    gateway_s: float
    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    detokenize_s: float | None
    serialize_s: float | None
    retries: int = 0
    resumes: int = 0
    error: str | None = None
    trace_id: str | None = None  # OpenTelemetry trace id, when the gateway exported the request's spans

    @property
    def serialization_s(self) -> float:
        return (self.detokenize_s or 0.0) + (self.serialize_s or 0.0)


@dataclass(slots=True, frozen=True)
class Series:
    """One line of a chart: its labels and (POSIX seconds, value) points."""

    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]


@dataclass(slots=True, frozen=True)
class ReplicaActivity:
    waiting: float | None
    running: float | None
    kv_usage: float | None
    qps: float | None
    tokens_per_s: float | None


@dataclass(slots=True, frozen=True)
class ReplicaExpertLoad:
    """One replica's tokens per expert; the tuples follow :attr:`ExpertLoad.experts` (None: no data)."""

    replica: str
    tokens_per_s: tuple[float | None, ...]  # over the window
    tokens_total: tuple[float | None, ...]  # since the replica started
    imbalance: float | None  # busiest expert over the mean, worst layer, since start (1 is even)
    recent_imbalance: float | None = None  # the same ratio of tokens/s in the window, all layers together


@dataclass(slots=True, frozen=True)
class ExpertLoad:
    """Tokens routed to each expert, per replica (``/api/v1/metrics/experts``); no experts: a dense model."""

    scope: str
    window_s: float
    experts: tuple[str, ...]
    replicas: tuple[ReplicaExpertLoad, ...]

    @property
    def is_moe(self) -> bool:
        return bool(self.experts)


@dataclass(slots=True, frozen=True)
class StageMeans:
    """Mean time per stage of a group of requests, and each stage's share of their total."""

    count: int
    e2e_s: float
    stages_s: Mapping[str, float]
    shares: Mapping[str, float]


@dataclass(slots=True, frozen=True)
class ReplicaTail:
    threshold_s: float
    tail: StageMeans | None


@dataclass(slots=True, frozen=True)
class LatencyBreakdown:
    """Where the time of the requests at and above ``quantile`` went, next to typical ones."""

    scope: str
    window_s: float
    quantile: float
    num_traces: int
    threshold_s: float | None
    tail: StageMeans | None
    median: StageMeans | None
    by_replica: Mapping[str, ReplicaTail]
    truncated: bool = False
    slowest: tuple[Trace, ...] = ()
