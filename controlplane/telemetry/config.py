"""Telemetry's sections of the configuration (``[prometheus]``, ``[telemetry]``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrometheusConfig:
    enabled: str = "auto"  # auto: when the binary is installed; on; off
    binary: str = "prometheus"
    host: str = "127.0.0.1"
    port: int = 9090
    scrape_interval_s: float = 2.0
    retention: str = "2h"


@dataclass(slots=True)
class TelemetryConfig:
    source: str = "auto"  # auto: Prometheus when it runs, else the in-process scraper
    scrape_interval_s: float = 2.0
    ring_size: int = 1800  # samples kept per series by the in-process scraper (an hour at 2 s)


def telemetry_problems(prometheus: PrometheusConfig, telemetry: TelemetryConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[prometheus]`` and ``[telemetry]``."""
    problems: list[tuple[str, str]] = []
    for key, ok, reason in (
        ("prometheus.port", 0 < prometheus.port < 65536, f"must be a TCP port, got {prometheus.port}"),
        ("prometheus.enabled", prometheus.enabled in ("auto", "on", "off"), "must be auto, on or off"),
        ("telemetry.source", telemetry.source in ("auto", "prometheus", "scraper"),
         "must be auto, prometheus or scraper"),
        ("telemetry.ring_size", telemetry.ring_size >= 10, "must be >= 10"),
    ):
        if not ok:
            problems.append((key, reason))
    return problems
