"""The query interface itself: scopes, label matchers and choosing a source from the configuration."""

from __future__ import annotations

import pytest

from controlplane.replicas import ReplicaEndpoint
from controlplane.telemetry.base import Regex, Scope, TelemetryError, label_matches
from controlplane.telemetry.config import TelemetryConfig
from controlplane.telemetry.prometheus import PrometheusSource
from controlplane.telemetry.scraper import ScraperSource
from controlplane.telemetry.select import select_source


@pytest.mark.parametrize(("text", "scope", "matchers"), [
    ("fleet", Scope(), {}),
    ("zone:az-a", Scope("zone", "az-a"), {"zone": "az-a"}),
    ("replica:r-1", Scope("replica", "r-1"), {"replica": "r-1"}),
])
def test_scope_parses_and_prints_back(text: str, scope: Scope, matchers: dict[str, str]) -> None:
    assert Scope.parse(text) == scope
    assert str(scope) == text
    assert scope.matchers == matchers


@pytest.mark.parametrize("text", ["", "zone", "zone:", "region:eu", "fleet:all", "replica"])
def test_bad_scope_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="fleet, zone:NAME or replica:ID"):
        Scope.parse(text)


def test_label_matchers_are_exact_or_anchored_regex() -> None:
    labels = {"status_code": "503", "path": "/v1/completions"}
    assert label_matches(labels, {"status_code": Regex("5..")})
    assert not label_matches(labels, {"status_code": Regex("5")})  # anchored, as PromQL's =~
    assert label_matches(labels, {"path": Regex("/v1/completions|/v1/chat/completions")})
    assert not label_matches(labels, {"zone": "az-a"})
    assert label_matches(labels, {"zone": ""})  # a missing label reads as empty
    with pytest.raises(ValueError, match="bad label regex"):
        Regex("(")


def endpoints() -> list[ReplicaEndpoint]:
    return []


def test_auto_uses_prometheus_when_one_runs_else_the_scraper() -> None:
    source = select_source(TelemetryConfig(), "http://127.0.0.1:9090", endpoints)
    assert isinstance(source, PrometheusSource) and source.name == "prometheus"
    assert source.scrape_interval_s == 2.0  # without Prometheus' own interval, the scraper's
    told = select_source(TelemetryConfig(), "http://127.0.0.1:9090", endpoints, prometheus_scrape_s=1.0)
    assert told.scrape_interval_s == 1.0  # the interval Prometheus is configured with: how far samples lie
    scraper = select_source(TelemetryConfig(scrape_interval_s=1.0, ring_size=50), None, endpoints)
    assert isinstance(scraper, ScraperSource)
    assert (scraper.interval_s, scraper.ring_size, scraper.window_s) == (1.0, 50, 30.0)
    assert scraper.scrape_interval_s == 1.0


def test_explicit_scraper_ignores_a_running_prometheus() -> None:
    source = select_source(TelemetryConfig(source="scraper"), "http://x:9090", endpoints)
    assert isinstance(source, ScraperSource)


def test_explicit_prometheus_without_one_running_is_an_error() -> None:
    with pytest.raises(TelemetryError, match="no Prometheus is running"):
        select_source(TelemetryConfig(source="prometheus"), None, endpoints)


def test_rate_window_spans_at_least_four_scrapes() -> None:
    source = select_source(TelemetryConfig(scrape_interval_s=15.0), None, endpoints)
    assert source.window_s == 60.0
    # of the source that answers: Prometheus scraping every 15 s, beside a scraper configured at 2 s
    prometheus = select_source(TelemetryConfig(), "http://127.0.0.1:9090", endpoints,
                               prometheus_scrape_s=15.0)
    assert prometheus.window_s == 60.0
