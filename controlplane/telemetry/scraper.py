"""The in-process telemetry source: scrape every replica's ``/metrics`` and answer PromQL-like queries.

For machines without Prometheus. A thread fetches each live replica's page every ``interval_s`` and
appends one (timestamp, value) per series to a bounded ring. Queries follow Prometheus 2.x semantics, so
numbers agree with :class:`controlplane.telemetry.prometheus.PrometheusSource`:

- a rate is the increase over the window (counter resets add the value before the drop), extrapolated
  to the window edges the way ``rate()`` does (:func:`extrapolated_rate`);
- a quantile is ``histogram_quantile`` over bucket rates with linear interpolation inside the bucket
  (:func:`histogram_quantile`);
- a gauge is the latest sample, unless the series went stale: a replica that left the fleet, failed a
  scrape or stopped exporting a series gets a stale marker, as in Prometheus, and disappears from
  instant queries at once, while its old samples still count in rates until they leave the window.

Series whose newest sample is older than the rings' horizon (``ring_size * interval_s``) are dropped.
Target labels (``replica``, ``zone``, ``model``, ``instance``, ``job``) win over the same labels on a
page, as in the generated Prometheus configuration (``honor_labels: false``, echoes dropped).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import (
    DEFAULT_WINDOW_S,
    Aggregation,
    EndpointsProvider,
    Group,
    Matchers,
    RangeKind,
    Rates,
    Series,
    Telemetry,
    check_quantile,
    check_query,
    check_range,
    histogram_base,
    label_matches,
    quotient,
)

logger = logging.getLogger(__name__)

JOB = "replicas"
LOOKBACK_S = 300.0  # an instant query sees a sample this old at most (Prometheus' lookback delta)
EXTRAPOLATION_THRESHOLD = 1.1  # x the average sample spacing: closer than this to an edge extrapolates
MAX_SCRAPE_WORKERS = 16

Point = tuple[float, float | None]  # (timestamp, value); None is a stale marker
Fetch = Callable[[ReplicaEndpoint], str]
LabelKey = tuple[tuple[str, str], ...]


# ---- PromQL math (pure) ------------------------------------------------------------------------------
def extrapolated_rate(points: Sequence[tuple[float, float]], *, start: float, end: float) -> float | None:
    """``rate()`` over the window [start, end] from the samples in it; None with fewer than two.

    As Prometheus 2.x: the increase adds back each value before a counter reset, is extrapolated to
    the window's edges when the first/last sample lies within 1.1 average spacings of them (else by half a
    spacing), never back past the counter's zero point, and is divided by the window's length.
    """
    if len(points) < 2:
        return None
    first_t, first_v = points[0]
    last_t, last_v = points[-1]
    increase = last_v - first_v
    previous = first_v
    for _, value in points[1:]:
        if value < previous:
            increase += previous  # a reset: the counter restarted from zero after reaching `previous`
        previous = value
    sampled = last_t - first_t
    if sampled <= 0:
        return None
    to_start = first_t - start
    to_end = end - last_t
    average_spacing = sampled / (len(points) - 1)
    if increase > 0 and first_v >= 0:
        # A counter is never negative: do not extrapolate to before the point where it was zero.
        to_start = min(to_start, sampled * (first_v / increase))
    threshold = average_spacing * EXTRAPOLATION_THRESHOLD
    interval = sampled
    interval += to_start if to_start < threshold else average_spacing / 2
    interval += to_end if to_end < threshold else average_spacing / 2
    factor = interval / sampled / (end - start)  # in Prometheus' order, so results agree to the last bit
    return increase * factor


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """``histogram_quantile(q, ...)`` over (upper bound, cumulative count) pairs, as Prometheus 2.x.

    NaN when undefined (no ``+Inf`` bucket, fewer than two buckets, no observations); the highest finite
    bound when the rank falls in the ``+Inf`` bucket; otherwise linear interpolation inside the bucket
    that holds the rank, the lowest bucket starting at 0 (or at its bound when that is <= 0).
    """
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    merged: dict[float, float] = {}
    for bound, count in buckets:
        merged[bound] = merged.get(bound, 0.0) + count  # same bound twice: add them up
    ordered = sorted(merged.items())
    if not ordered or not math.isinf(ordered[-1][0]):
        return math.nan
    bounds = [b for b, _ in ordered]
    counts = _monotonic([c for _, c in ordered])
    if len(bounds) < 2:
        return math.nan
    observations = counts[-1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = bisect.bisect_left(counts, rank, hi=len(counts) - 1)  # first finite bucket with count >= rank
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    bucket_start, bucket_end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        bucket_start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count == 0:
        return math.nan  # only when rank is 0 and the bucket is empty (Go's 0/0)
    return bucket_start + (bucket_end - bucket_start) * (rank / count)


def _monotonic(counts: list[float]) -> list[float]:
    """Bucket rates may dip below a lower bucket's through float error; raise them to the running max."""
    out: list[float] = []
    highest = -math.inf
    for count in counts:
        highest = max(highest, count)
        out.append(highest)
    return out


def aggregate(values: Sequence[float], agg: Aggregation) -> float:
    if agg == "sum":
        return math.fsum(values)
    if agg == "avg":
        return math.fsum(values) / len(values)
    if agg == "max":
        return max(values)
    if agg == "min":
        return min(values)
    return float(len(values))


# ---- series storage ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Series:
    name: str
    labels: dict[str, str]
    target: str  # the replica whose page it came from
    points: deque[Point]

    @property
    def is_stale(self) -> bool:
        return bool(self.points) and self.points[-1][1] is None

    def mark_stale(self, at: float) -> None:
        if self.points and not self.is_stale:
            self.points.append((at, None))


@dataclass(slots=True, frozen=True)
class _Snapshot:
    """A series' labels and points copied out under the lock, with timestamps for bisecting."""

    labels: dict[str, str]
    times: list[float]
    values: list[float | None]

    @classmethod
    def of(cls, series: _Series) -> _Snapshot:
        return cls(series.labels, [t for t, _ in series.points], [v for _, v in series.points])

    def latest(self, at: float) -> float | None:
        """The instant value at ``at``: the newest sample within the lookback, unless it is a stale marker."""
        i = bisect.bisect_right(self.times, at) - 1
        if i < 0 or self.times[i] < at - LOOKBACK_S:
            return None
        return self.values[i]

    def window(self, start: float, end: float) -> list[tuple[float, float]]:
        lo = bisect.bisect_left(self.times, start)
        hi = bisect.bisect_right(self.times, end)
        return [(t, v) for t, v in zip(self.times[lo:hi], self.values[lo:hi]) if v is not None]


def _target_labels(endpoint: ReplicaEndpoint) -> dict[str, str]:
    return {"replica": endpoint.replica_id, "zone": endpoint.zone, "model": endpoint.model,
            "instance": f"{endpoint.host}:{endpoint.port}", "job": JOB}


# ---- the source -------------------------------------------------------------------------------------
class ScraperSource(Telemetry):
    """Scrapes the fleet's ``/metrics`` pages itself; ``start()`` runs the loop, ``scrape_once()`` one tick.

    ``clock`` stamps samples (monotonic seconds); ``wall_clock`` maps them to the POSIX seconds of
    :meth:`range`. ``fetch`` returns one endpoint's page (default: httpx GET ``/metrics``) and raises on
    failure.
    """

    name = "scraper"

    def __init__(self, endpoints: EndpointsProvider, *, interval_s: float, ring_size: int,
                 clock: Callable[[], float] = time.monotonic, fetch: Fetch | None = None,
                 wall_clock: Callable[[], float] = time.time, window_s: float = DEFAULT_WINDOW_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if ring_size < 2:
            raise ValueError(f"ring_size must be >= 2, got {ring_size}")
        self.endpoints = endpoints
        self.interval_s = self.scrape_interval_s = interval_s
        self.ring_size = ring_size
        self.window_s = window_s
        self.clock = clock
        self._wall_offset = wall_clock() - clock()
        self._fetch = fetch or self._http_fetch
        self._http: httpx.Client | None = None
        self._series: dict[str, dict[LabelKey, _Series]] = {}  # by metric name
        self._targets: set[str] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def now(self) -> float:
        return self.clock()

    # -- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="telemetry-scraper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 10)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._http is not None:
            self._http.close()
            self._http = None

    def _run(self) -> None:
        while not self._stopping.is_set():
            began = self.clock()
            try:
                self.scrape_once()
            except Exception:  # the loop must outlive one bad tick; the next one tries again
                logger.exception("telemetry scrape failed")
            self._stopping.wait(max(0.0, self.interval_s - (self.clock() - began)))

    # -- scraping
    def scrape_once(self) -> None:
        """Fetch every live replica's page once and record it; replicas that left are marked stale."""
        # a replica a cluster has not placed yet has no address (no host) to scrape
        live = [e for e in self.endpoints() if e.state is not ReplicaState.STOPPED and e.host]
        pages = self._fetch_all(live)
        with self._lock:
            now = self.clock()
            gone = self._targets - {e.replica_id for e in live}
            for rid in gone:
                logger.info("replica %s left the fleet: its series go stale", rid)
                self._mark_target_stale(rid, now)
            for endpoint, (at, text) in zip(live, pages):
                self._record(endpoint, at, text)
            self._targets = {e.replica_id for e in live}
            self._drop_expired(now)

    def _fetch_all(self, endpoints: list[ReplicaEndpoint]) -> list[tuple[float, str | None]]:
        if not endpoints:
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=MAX_SCRAPE_WORKERS, thread_name_prefix="scrape")
        return list(self._pool.map(self._fetch_one, endpoints))

    def _fetch_one(self, endpoint: ReplicaEndpoint) -> tuple[float, str | None]:
        at = self.clock()  # like Prometheus: the sample time is when the scrape began
        try:
            return at, self._fetch(endpoint)
        except Exception as exc:  # any failure is a failed scrape: up=0, series stale
            logger.warning("replica %s: scrape of %s failed: %s", endpoint.replica_id, endpoint.base_url, exc)
            return at, None

    def _http_fetch(self, endpoint: ReplicaEndpoint) -> str:
        if self._http is None:
            self._http = httpx.Client(timeout=min(self.interval_s, 10.0), trust_env=False)
        response = self._http.get(f"{endpoint.base_url}/metrics")
        response.raise_for_status()
        return response.text

    def _record(self, endpoint: ReplicaEndpoint, at: float, text: str | None) -> None:
        target = _target_labels(endpoint)
        seen: set[tuple[str, LabelKey]] = set()
        samples: list[tuple[str, dict[str, str], float]] = []
        if text is not None:
            try:
                samples = [(s.name, {**s.labels, **target}, s.value)
                           for family in text_string_to_metric_families(text) for s in family.samples]
            except ValueError as exc:
                logger.warning("replica %s: unparsable /metrics page: %s", endpoint.replica_id, exc)
                text = None
        samples.append(("up", target, 0.0 if text is None else 1.0))
        for name, labels, value in samples:
            key = tuple(sorted(labels.items()))
            seen.add((name, key))
            series = self._series.setdefault(name, {}).get(key)
            if series is None:
                series = _Series(name, labels, endpoint.replica_id, deque(maxlen=self.ring_size))
                self._series[name][key] = series
            if series.points and series.points[-1][0] >= at:
                continue  # a slow fetch finished after a newer one: keep time moving forward
            series.points.append((at, value))
        for name, by_key in self._series.items():
            for key, series in by_key.items():
                if series.target == endpoint.replica_id and (name, key) not in seen:
                    series.mark_stale(at)

    def _mark_target_stale(self, replica_id: str, at: float) -> None:
        for by_key in self._series.values():
            for series in by_key.values():
                if series.target == replica_id:
                    series.mark_stale(at)

    def _drop_expired(self, now: float) -> None:
        horizon = now - self.ring_size * self.interval_s
        for name in list(self._series):
            by_key = self._series[name]
            for key in [k for k, s in by_key.items() if not s.points or s.points[-1][0] < horizon]:
                del by_key[key]
            if not by_key:
                del self._series[name]

    @property
    def num_series(self) -> int:
        """Series held in memory (for the control plane's own metrics and for tests)."""
        with self._lock:
            return sum(len(by_key) for by_key in self._series.values())

    def _select(self, name: str, match: Matchers | None) -> list[_Snapshot]:
        with self._lock:
            return self._select_locked(name, match)

    def _select_locked(self, name: str, match: Matchers | None) -> list[_Snapshot]:
        series = self._series.get(name, {}).values()
        return [_Snapshot.of(s) for s in series if label_matches(s.labels, match)]

    # -- queries
    def gauge(self, metric: str, *, by: tuple[str, ...] = ("replica",), match: Matchers | None = None,
              agg: Aggregation = "sum") -> dict[Group, float]:
        check_query(agg=agg)
        return self._gauge_at(self._select(metric, match), self.clock(), by, agg)

    def rate(self, metric: str, *, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
             match: Matchers | None = None) -> dict[Group, float]:
        window = self._window(window_s)
        return self._rate_at(self._select(metric, match), self.clock(), window, by)

    def quantile(self, histogram: str, q: float, *, window_s: float | None = None,
                 by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> dict[Group, float]:
        check_quantile(q)
        window = self._window(window_s)
        buckets = self._select(f"{histogram_base(histogram)}_bucket", match)
        return self._quantile_at(buckets, self.clock(), window, q, by)

    def ratio(self, numerator: str, denominator: str, *, window_s: float | None = None,
              match: Matchers | None = None) -> float | None:
        window = self._window(window_s)
        with self._lock:  # both series as one scrape left them, read at one instant
            top, bottom = (self._select_locked(name, match) for name in (numerator, denominator))
            at = self.clock()
        rates = (self._rate_at(snaps, at, window, ()).get(()) for snaps in (top, bottom))
        return quotient(*rates)

    def rates(self, metrics: Sequence[str], *, window_s: float | None = None,
              by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> Rates:
        window = self._window(window_s)
        with self._lock:  # every series as one scrape left them, read at one instant
            snaps = {m: self._select_locked(m, match) for m in metrics}
            at = self.clock()
        return {m: self._rate_at(s, at, window, by) for m, s in snaps.items()}

    def range(self, kind: RangeKind, metric: str, *, start: float, end: float, step: float,
              q: float | None = None, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
              match: Matchers | None = None, agg: Aggregation = "sum") -> list[Series]:
        check_range(agg=agg, kind=kind, start=start, end=end, step=step)
        window = self._window(window_s)
        if kind == "quantile":
            if q is None:
                raise ValueError("a quantile range needs q")
            check_quantile(q)
            snaps = self._select(f"{histogram_base(metric)}_bucket", match)
        else:
            snaps = self._select(metric, match)
        lines: dict[Group, list[tuple[float, float]]] = {}
        num_steps = math.floor((end - start) / step + 1e-9) + 1
        for i in range(num_steps):
            wall = start + i * step
            at = wall - self._wall_offset
            if kind == "gauge":
                values = self._gauge_at(snaps, at, by, agg)
            elif kind == "rate":
                values = self._rate_at(snaps, at, window, by)
            else:
                values = self._quantile_at(snaps, at, window, q or 0.0, by)
            for group, value in values.items():
                lines.setdefault(group, []).append((wall, value))
        return [Series(by, group, tuple(points)) for group, points in sorted(lines.items())]

    # -- evaluation at one instant (monotonic seconds)
    @staticmethod
    def _gauge_at(snaps: list[_Snapshot], at: float, by: tuple[str, ...],
                  agg: Aggregation) -> dict[Group, float]:
        groups: dict[Group, list[float]] = {}
        for snap in snaps:
            value = snap.latest(at)
            if value is not None:
                groups.setdefault(_group(snap.labels, by), []).append(value)
        return {group: aggregate(values, agg) for group, values in groups.items()}

    @staticmethod
    def _rate_at(snaps: list[_Snapshot], at: float, window: float,
                 by: tuple[str, ...]) -> dict[Group, float]:
        groups: dict[Group, list[float]] = {}
        for snap in snaps:
            value = extrapolated_rate(snap.window(at - window, at), start=at - window, end=at)
            if value is not None:
                groups.setdefault(_group(snap.labels, by), []).append(value)
        return {group: math.fsum(values) for group, values in groups.items()}

    @classmethod
    def _quantile_at(cls, buckets: list[_Snapshot], at: float, window: float, q: float,
                     by: tuple[str, ...]) -> dict[Group, float]:
        rates = cls._rate_at(buckets, at, window, (*by, "le"))
        histograms: dict[Group, list[tuple[float, float]]] = {}
        for (*group, le), value in rates.items():
            bound = _bound(le)
            if not math.isnan(bound):  # Prometheus ignores buckets whose le is not a number
                histograms.setdefault(tuple(group), []).append((bound, value))
        out = {group: histogram_quantile(q, pairs) for group, pairs in histograms.items()}
        return {group: value for group, value in out.items() if not math.isnan(value)}


def _group(labels: Mapping[str, str], by: tuple[str, ...]) -> Group:
    return tuple(labels.get(name, "") for name in by)


def _bound(le: str) -> float:
    try:
        return float(le)
    except ValueError:
        return math.nan
