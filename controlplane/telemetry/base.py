"""One query interface over the replicas' metrics, whichever source answers it.

Replicas export vLLM-named metrics on ``/metrics``; either the real Prometheus scrapes them
(:class:`controlplane.telemetry.prometheus.PrometheusSource`, queried in PromQL) or the control plane scrapes
them itself (:class:`controlplane.telemetry.scraper.ScraperSource`, the same PromQL semantics computed from
ring buffers). The API, the autoscaler, the alerts and the console read through :class:`Telemetry` and never
care which one runs.

Every query answers a mapping from a group (the values of the ``by`` labels, in order; ``""`` for a
missing label) to a number, as ``sum by (...)`` would. A group without data is absent, never a made-up 0.
"""

from __future__ import annotations

import abc
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from controlplane.errors import Unavailable
from controlplane.replicas import ReplicaEndpoint, ReplicaLoad

DEFAULT_WINDOW_S = 30.0  # rate/quantile window when a caller names none (>= 4 scrapes at the 2 s default)
RATE_WINDOW_SCRAPES = 4  # a rate window spans at least this many scrape intervals (Prometheus' advice)

# Metric names the composite queries read (vLLM's names, as the replicas export them).
REQUEST_SUCCESS = "vllm:request_success_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
HTTP_REQUESTS = "llmsre_http_requests_total"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
NUM_RUNNING = "vllm:num_requests_running"
NUM_WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# The error rate counts inference requests only: probes and scrapes would dilute it, and /ready answers
# 503 on purpose while a replica drains.
INFERENCE_PATHS = "/v1/completions|/v1/chat/completions"
SERVER_ERROR_CODES = "5.."

Aggregation = Literal["sum", "avg", "max", "min", "count"]
AGGREGATIONS: tuple[str, ...] = ("sum", "avg", "max", "min", "count")
RangeKind = Literal["gauge", "rate", "quantile"]
RANGE_KINDS: tuple[str, ...] = ("gauge", "rate", "quantile")
Group = tuple[str, ...]
Rates = dict[str, dict[Group, float]]  # counter -> group -> per-second rate, from one read
EndpointsProvider = Callable[[], list[ReplicaEndpoint]]


class TelemetryError(Unavailable):
    """A query could not be answered (source down, bad query, timeout); the message says which and why. The
    same query may be answered later (HTTP 503)."""


@dataclass(slots=True, frozen=True)
class Regex:
    """A label matcher value matched as a fully anchored regular expression (PromQL ``=~``)."""

    pattern: str

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"bad label regex {self.pattern!r}: {exc}") from exc

    def matches(self, value: str) -> bool:
        return re.fullmatch(self.pattern, value) is not None


Matchers = Mapping[str, str | Regex]  # label name -> exact value or Regex


def label_matches(labels: Mapping[str, str], match: Matchers | None) -> bool:
    """Whether a series' labels satisfy every matcher (a missing label reads as ``""``, as in PromQL)."""
    for name, want in (match or {}).items():
        value = labels.get(name, "")
        if not (want.matches(value) if isinstance(want, Regex) else value == want):
            return False
    return True


@dataclass(slots=True, frozen=True)
class Scope:
    """What a summary covers: the whole fleet, one zone, or one replica (``fleet``, ``zone:az-a``, ...)."""

    kind: Literal["fleet", "zone", "replica"] = "fleet"
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("fleet", "zone", "replica"):
            raise ValueError(f"scope kind must be fleet, zone or replica, got {self.kind!r}")
        if (self.kind == "fleet") != (self.name == ""):
            raise ValueError(f"scope {self.kind!r} {'takes no' if self.kind == 'fleet' else 'needs a'} name")

    @classmethod
    def parse(cls, text: str) -> Scope:
        """``fleet``, ``zone:NAME`` or ``replica:ID``."""
        if text == "fleet":
            return cls()
        kind, sep, name = text.partition(":")
        if not sep or kind not in ("zone", "replica") or not name:
            raise ValueError(f"scope must be fleet, zone:NAME or replica:ID, got {text!r}")
        return cls(kind, name)  # type: ignore[arg-type]

    @property
    def matchers(self) -> dict[str, str | Regex]:
        return {} if self.kind == "fleet" else {self.kind: self.name}

    def __str__(self) -> str:
        return "fleet" if self.kind == "fleet" else f"{self.kind}:{self.name}"


@dataclass(slots=True, frozen=True)
class Quantiles:
    """Latency quantiles in seconds; None where the window saw no observation."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


@dataclass(slots=True, frozen=True)
class MetricSummary:
    """The numbers an SRE reads first for a scope, over one window. None: no data, not zero."""

    scope: str
    window_s: float
    observed_at: float  # monotonic seconds
    replicas: tuple[str, ...]  # replicas reporting in this scope
    qps: float | None  # successful requests per second
    error_rate: float | None  # share of inference requests answered 5xx
    ttft: Quantiles = field(default_factory=Quantiles)
    tpot: Quantiles = field(default_factory=Quantiles)  # time per output token (inter-token latency)
    e2e: Quantiles = field(default_factory=Quantiles)
    queue: Quantiles = field(default_factory=Quantiles)
    prefill: Quantiles = field(default_factory=Quantiles)
    decode: Quantiles = field(default_factory=Quantiles)
    kv_usage_mean: float | None = None  # 0..1
    kv_usage_max: float | None = None
    num_waiting: float | None = None  # summed over the scope's replicas
    num_running: float | None = None
    generation_tokens_per_s: float | None = None


@dataclass(slots=True, frozen=True)
class Series:
    """One line of a chart: a group and its (POSIX seconds, value) points."""

    by: tuple[str, ...]
    group: Group
    points: tuple[tuple[float, float], ...]

    @property
    def labels(self) -> dict[str, str]:
        return dict(zip(self.by, self.group))


class Telemetry(abc.ABC):
    """The query interface; sources implement gauge, rate, quantile and range, the rest is shared."""

    name: str
    window_s: float
    # seconds between a series' samples (0: unknown): a rate over a window is the increase between the
    # window's first and last samples, about this much less than the window, extrapolated to all of it
    scrape_interval_s: float = 0.0

    def start(self) -> None:  # noqa: B027 (sources with nothing to start keep the default)
        """Begin collecting (the in-process scraper); a no-op for sources that need nothing."""

    def stop(self) -> None:  # noqa: B027
        """Stop collecting and release connections."""

    @abc.abstractmethod
    def gauge(self, metric: str, *, by: tuple[str, ...] = ("replica",), match: Matchers | None = None,
              agg: Aggregation = "sum") -> dict[Group, float]:
        """The latest value of each series, aggregated within each group (``sum by (...) (metric)``)."""

    @abc.abstractmethod
    def rate(self, metric: str, *, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
             match: Matchers | None = None) -> dict[Group, float]:
        """Per-second rate of a counter over the window, summed within each group; resets handled."""

    @abc.abstractmethod
    def quantile(self, histogram: str, q: float, *, window_s: float | None = None,
                 by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> dict[Group, float]:
        """``histogram_quantile(q, sum by (le, ...) (rate(histogram_bucket[window])))``."""

    @abc.abstractmethod
    def range(self, kind: RangeKind, metric: str, *, start: float, end: float, step: float,
              q: float | None = None, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
              match: Matchers | None = None, agg: Aggregation = "sum") -> list[Series]:
        """``kind`` evaluated every ``step`` seconds from ``start`` to ``end`` (POSIX seconds), for charts."""

    def ratio(self, numerator: str, denominator: str, *, window_s: float | None = None,
              match: Matchers | None = None) -> float | None:
        """``sum(rate(numerator[w])) / sum(rate(denominator[w]))``: a mean per event, such as generated
        tokens per finished request. None when the denominator did not move or is unknown. Sources
        evaluate both rates on the same samples (one query, one lock): read a scrape apart, one window's
        tokens would be put over the next window's requests, off by a whole batch of finishes. This
        default, for sources without that guarantee, reads the two rates one after the other."""
        window = self._window(window_s)
        top = self.rate(numerator, window_s=window, by=(), match=match).get(())
        bottom = self.rate(denominator, window_s=window, by=(), match=match).get(())
        return quotient(top, bottom)

    def rates(self, metrics: Sequence[str], *, window_s: float | None = None,
              by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> Rates:
        """Each counter's :meth:`rate`, all read on the same samples (one query, one lock), as ``ratio``
        does for two sums: read a scrape apart, one counter's window would end a scrape after another's,
        and a share of one in the other (CPU seconds per busy second) could read over 1. This default,
        for sources without that guarantee, reads them one after the other."""
        window = self._window(window_s)
        return {m: self.rate(m, window_s=window, by=by, match=match) for m in metrics}

    def now(self) -> float:
        """Monotonic seconds, the time base of ``observed_at`` (sources with an injected clock override)."""
        return time.monotonic()

    def replica_loads(self) -> dict[str, ReplicaLoad]:
        """Instant load of every replica that reports all three gauges."""
        waiting = self.gauge(NUM_WAITING)
        running = self.gauge(NUM_RUNNING)
        kv = self.gauge(KV_USAGE, agg="max")
        now = self.now()
        return {rid: ReplicaLoad(rid, waiting[(rid,)], running[(rid,)], kv[(rid,)], now)
                for (rid,) in sorted(waiting.keys() & running.keys() & kv.keys()) if rid}

    def summary(self, scope: Scope, *, window_s: float | None = None) -> MetricSummary:
        """QPS, errors, latency quantiles by stage, KV and queue state for ``scope``."""
        window = self._window(window_s)
        match = scope.matchers

        def one(values: dict[Group, float]) -> float | None:
            return values.get(())

        def quantiles(histogram: str) -> Quantiles:
            got = [one(self.quantile(histogram, q, window_s=window, by=(), match=match))
                   for q in (0.5, 0.95, 0.99)]
            return Quantiles(*got)

        running = self.gauge(NUM_RUNNING, match=match)
        return MetricSummary(
            scope=str(scope), window_s=window, observed_at=self.now(),
            replicas=tuple(sorted(rid for (rid,) in running if rid)),
            qps=one(self.rate(REQUEST_SUCCESS, window_s=window, by=(), match=match)),
            error_rate=self._error_rate(window, match),
            ttft=quantiles(TTFT), tpot=quantiles(ITL), e2e=quantiles(E2E),
            queue=quantiles(QUEUE_TIME), prefill=quantiles(PREFILL_TIME), decode=quantiles(DECODE_TIME),
            kv_usage_mean=one(self.gauge(KV_USAGE, by=(), match=match, agg="avg")),
            kv_usage_max=one(self.gauge(KV_USAGE, by=(), match=match, agg="max")),
            num_waiting=one(self.gauge(NUM_WAITING, by=(), match=match)),
            num_running=sum(running.values()) if running else None,
            generation_tokens_per_s=one(self.rate(GENERATION_TOKENS, window_s=window, by=(), match=match)),
        )

    def _error_rate(self, window: float, match: Matchers) -> float | None:
        inference = {**match, "path": Regex(INFERENCE_PATHS)}
        total = self.rate(HTTP_REQUESTS, window_s=window, by=(), match=inference).get(())
        if total is None or total <= 0:
            return None  # no inference request in the window: a share of nothing is unknown
        errors = self.rate(HTTP_REQUESTS, window_s=window, by=(),
                           match={**inference, "status_code": Regex(SERVER_ERROR_CODES)}).get((), 0.0)
        return errors / total

    def _window(self, window_s: float | None) -> float:
        window = self.window_s if window_s is None else window_s
        if not window > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        return window


def quotient(top: float | None, bottom: float | None) -> float | None:
    """``top / bottom``; None where either is unknown or the bottom is 0."""
    if top is None or not bottom:
        return None
    return top / bottom


def check_quantile(q: float) -> None:
    if not 0 <= q <= 1 or math.isnan(q):
        raise ValueError(f"quantile must be in [0, 1], got {q}")


def check_query(*, agg: str = "sum", kind: str = "gauge") -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {', '.join(AGGREGATIONS)}, got {agg!r}")
    if kind not in RANGE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(RANGE_KINDS)}, got {kind!r}")


def check_range(*, agg: str, kind: str, start: float, end: float, step: float) -> None:
    """The arguments every source's ``range`` validates the same way."""
    check_query(agg=agg, kind=kind)
    if step <= 0 or end < start:
        raise ValueError(f"need step > 0 and end >= start, got start={start} end={end} step={step}")


def histogram_base(name: str) -> str:
    """Accept a histogram by its family name or by its ``_bucket`` series name."""
    return name.removesuffix("_bucket")
