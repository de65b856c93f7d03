"""Telemetry answered by the real Prometheus, in PromQL: :class:`PrometheusSource` is the
:class:`~controlplane.telemetry.base.Telemetry` source backed by it, through ``prometheus_api_client``;
every failure of that client becomes one :class:`TelemetryError`.

Where it sits: one of the two telemetry sources (the other is the in-process scraper, ``scraper.py``),
picked by ``select.py``; the Prometheus it queries is run by
:class:`~controlplane.telemetry.prometheus_server.PrometheusServer`, and its queries are built in
:mod:`controlplane.telemetry.promql`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import requests
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

from controlplane.telemetry.base import (
    DEFAULT_WINDOW_S,
    Aggregation,
    Group,
    Matchers,
    RangeKind,
    Rates,
    Series,
    Telemetry,
    TelemetryError,
    check_range,
)
from controlplane.telemetry.promql import (
    RATE_OF_LABEL,
    gauge_query,
    quantile_query,
    rate_query,
    rates_query,
    ratio_query,
)

QUERY_TIMEOUT_S = 5.0
T = TypeVar("T")


class PrometheusSource(Telemetry):
    """Telemetry answered by a running Prometheus at ``url``."""

    name = "prometheus"

    def __init__(self, url: str, *, window_s: float = DEFAULT_WINDOW_S,
                 timeout_s: float = QUERY_TIMEOUT_S, scrape_interval_s: float = 0.0) -> None:
        self.url = url.rstrip("/")
        self.window_s = window_s
        self.scrape_interval_s = scrape_interval_s  # the interval Prometheus was configured with
        session = requests.Session()
        session.trust_env = False  # loopback: no proxy from the environment
        # No retries inside the client: a telemetry read that fails is reported at once, the caller retries.
        self._client = PrometheusConnect(url=self.url, disable_ssl=True, session=session,
                                         retry=Retry(total=0),
                                         timeout=timeout_s)  # type: ignore[arg-type]  # requests takes floats

    def stop(self) -> None:
        self._client.close()

    def gauge(self, metric: str, *, by: tuple[str, ...] = ("replica",), match: Matchers | None = None,
              agg: Aggregation = "sum") -> dict[Group, float]:
        return self.instant(gauge_query(metric, by=by, match=match, agg=agg), by)

    def rate(self, metric: str, *, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
             match: Matchers | None = None) -> dict[Group, float]:
        return self.instant(rate_query(metric, window_s=self._window(window_s), by=by, match=match), by)

    def quantile(self, histogram: str, q: float, *, window_s: float | None = None,
                 by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> dict[Group, float]:
        promql = quantile_query(histogram, q, window_s=self._window(window_s), by=by, match=match)
        return self.instant(promql, by)

    def ratio(self, numerator: str, denominator: str, *, window_s: float | None = None,
              match: Matchers | None = None) -> float | None:
        promql = ratio_query(numerator, denominator, window_s=self._window(window_s), match=match)
        return self.instant(promql, ()).get(())

    def rates(self, metrics: Sequence[str], *, window_s: float | None = None,
              by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> Rates:
        if not metrics:
            return {}
        promql = rates_query(metrics, window_s=self._window(window_s), by=by, match=match)
        out: Rates = {m: {} for m in metrics}
        for (metric, *group), value in self.instant(promql, (RATE_OF_LABEL, *by)).items():
            out[metric][tuple(group)] = value
        return out

    def range(self, kind: RangeKind, metric: str, *, start: float, end: float, step: float,
              q: float | None = None, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
              match: Matchers | None = None, agg: Aggregation = "sum") -> list[Series]:
        check_range(agg=agg, kind=kind, start=start, end=end, step=step)
        window = self._window(window_s)
        if kind == "gauge":
            promql = gauge_query(metric, by=by, match=match, agg=agg)
        elif kind == "rate":
            promql = rate_query(metric, window_s=window, by=by, match=match)
        elif q is None:
            raise ValueError("a quantile range needs q")
        else:
            promql = quantile_query(metric, q, window_s=window, by=by, match=match)
        result = self._call(promql, lambda: self._client.custom_query_range(
            promql, start_time=datetime.fromtimestamp(start, UTC), end_time=datetime.fromtimestamp(end, UTC),
            step=f"{step:g}"))
        lines = []
        for item in result:
            points = tuple((float(t), float(v)) for t, v in item["values"] if not math.isnan(float(v)))
            if points:
                lines.append(Series(by, _group(item["metric"], by), points))
        return sorted(lines, key=lambda s: s.group)

    def instant(self, promql: str, by: Sequence[str]) -> dict[Group, float]:
        """Run an instant query; NaN results (no observation in the window) are left out."""
        result = self._call(promql, lambda: self._client.custom_query(promql))
        out: dict[Group, float] = {}
        for item in result:
            value = float(item["value"][1])
            if not math.isnan(value):
                out[_group(item["metric"], by)] = value
        return out

    def _call(self, promql: str, query: Callable[[], T]) -> T:
        """The one place where the client's failures become TelemetryError."""
        try:
            return query()
        except (PrometheusApiClientException, requests.RequestException, ValueError, KeyError) as exc:
            raise TelemetryError(f"prometheus at {self.url}: {promql}: {exc}") from exc


def _group(metric: Mapping[str, Any], by: Sequence[str]) -> Group:
    return tuple(str(metric.get(name, "")) for name in by)
