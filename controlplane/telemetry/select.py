"""Which telemetry source runs: the real Prometheus when one runs, else the in-process scraper."""

from __future__ import annotations

from controlplane.telemetry.base import (
    DEFAULT_WINDOW_S,
    RATE_WINDOW_SCRAPES,
    EndpointsProvider,
    Telemetry,
    TelemetryError,
)
from controlplane.telemetry.config import TelemetryConfig
from controlplane.telemetry.prometheus import PrometheusSource
from controlplane.telemetry.scraper import ScraperSource


def select_source(config: TelemetryConfig, prometheus_url: str | None,
                  endpoints_provider: EndpointsProvider, *,
                  window_s: float | None = None, prometheus_scrape_s: float | None = None) -> Telemetry:
    """The source the configuration asks for; ``auto``: Prometheus when one runs, else the scraper.

    ``prometheus_url`` is the address of a running Prometheus (None: none runs), ``prometheus_scrape_s``
    the interval it scrapes at (None: the scraper's). The scraper comes back not yet started: call
    ``start()``.
    """
    if config.source not in ("auto", "prometheus", "scraper"):
        raise ValueError(f"telemetry.source must be auto, prometheus or scraper, got {config.source!r}")
    if config.source == "prometheus" and prometheus_url is None:
        raise TelemetryError("telemetry.source is prometheus but no Prometheus is running")
    def window(interval: float) -> float:
        return window_s or max(DEFAULT_WINDOW_S, RATE_WINDOW_SCRAPES * interval)

    if config.source != "scraper" and prometheus_url is not None:
        interval = prometheus_scrape_s or config.scrape_interval_s
        return PrometheusSource(prometheus_url, window_s=window(interval), scrape_interval_s=interval)
    return ScraperSource(endpoints_provider, interval_s=config.scrape_interval_s,
                         ring_size=config.ring_size, window_s=window(config.scrape_interval_s))
