"""Expert load: per replica and per expert, tokens/s over the window, tokens since start and the imbalance,
from the pages a mixture-of-experts replica exports (``inference.metrics``, the replica's own collector,
fed made-up routing counts: no model runs here).

The same query runs on the in-process scraper (fake clock, exact numbers) and on the real Prometheus that
scrapes those pages over HTTP through the configuration the control plane writes, so the labels it groups
by are the ones Prometheus keeps (the target's ``replica`` and ``zone``, not the page's echo). A dense
replica exports no expert series and is left out; a dense fleet answers no experts at all.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import Scope
from controlplane.telemetry.experts import ExpertLoad, expert_load, max_over_mean
from controlplane.telemetry.prometheus import PrometheusSource
from controlplane.telemetry.prometheus_server import PrometheusServer
from controlplane.telemetry.scraper import ScraperSource
from inference.metrics import CacheConfigInfo, EngineGauges, ReplicaMetrics

from .conftest import SCRAPE_INTERVAL_S, pid_exists, prometheus_config, wait_until

ZONES = {"r1": "az-a", "r2": "az-b", "dense": "az-c"}
# tokens/s routed to each of 4 experts, per MoE layer (2 layers); "dense" has no MoE layer
LAYER_RATES: dict[str, tuple[tuple[int, ...], ...]] = {
    "r1": ((30, 10, 10, 10), (10, 10, 10, 30)),  # layer 0 leans on expert 0, layer 1 on expert 3
    "r2": ((10, 10, 10, 10), (10, 10, 10, 10)),  # even
    "dense": (),
}
EXPECTED_RATES = {"r1": (40.0, 20.0, 20.0, 40.0), "r2": (20.0, 20.0, 20.0, 20.0)}  # summed over layers
EXPECTED_IMBALANCE = {"r1": 2.0, "r2": 1.0}  # the replica's gauge: worst layer (30 / mean 15)
EXPECTED_RECENT = {"r1": 40 * 4 / 120, "r2": 1.0}  # tokens/s of all layers together: flatter
EXPERTS = ("0", "1", "2", "3")
INTERVAL_S = 2.0
DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "llmsre-fleet.json"
WINDOW_S = 20.0


def replica_metrics(rid: str, clock: Callable[[], float]) -> ReplicaMetrics:
    """The replica's own collector; its page echoes a replica and zone of its own, which the target's
    labels replace (Prometheus drops the echo, the scraper overrides it)."""
    layers = LAYER_RATES[rid]

    def read() -> EngineGauges:
        t = clock()
        return EngineGauges(0, 0, 0.0, 0, 0, 0, 1, 2, None,
                            expert_tokens=[[int(rate * t) for rate in layer] for layer in layers])

    return ReplicaMetrics(model_name="default-moe" if layers else "default", replica=f"echo-{rid}",
                          zone="echo-zone", max_model_len=64, read_engine=read,
                          cache_info=CacheConfigInfo(16, 8, "auto", True, bytes_per_token=64))


def endpoint(rid: str, port: int) -> ReplicaEndpoint:
    model = "default-moe" if LAYER_RATES[rid] else "default"
    return ReplicaEndpoint(rid, ZONES[rid], "127.0.0.1", port, ReplicaState.READY, model)


def assert_expert_load(load: ExpertLoad, *, rel: float) -> None:
    assert load.is_moe and load.experts == EXPERTS
    assert [r.replica for r in load.replicas] == ["r1", "r2"]  # the dense replica has no row
    for row in load.replicas:
        assert row.tokens_per_s == pytest.approx(EXPECTED_RATES[row.replica], rel=rel), row
        assert all(total is not None and total > 0 for total in row.tokens_total), row
        assert row.imbalance == pytest.approx(EXPECTED_IMBALANCE[row.replica], rel=0.01), row
        assert row.recent_imbalance == pytest.approx(EXPECTED_RECENT[row.replica], rel=rel), row


# ---- the scraper, on a fake clock -------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scraper_on(rids: tuple[str, ...], clock: Clock) -> ScraperSource:
    pages = {rid: replica_metrics(rid, clock) for rid in rids}
    endpoints = [endpoint(rid, 9000 + i) for i, rid in enumerate(rids)]
    return ScraperSource(lambda: endpoints, interval_s=INTERVAL_S, ring_size=50, clock=clock,
                         wall_clock=clock, window_s=WINDOW_S,
                         fetch=lambda e: generate_latest(pages[e.replica_id].registry).decode())


def scrape(source: ScraperSource, clock: Clock, n: int) -> None:
    for _ in range(n):
        clock.now += INTERVAL_S
        source.scrape_once()


@pytest.fixture
def moe_scraper() -> Iterator[tuple[ScraperSource, Clock]]:
    clock = Clock()
    source = scraper_on(("r1", "r2", "dense"), clock)
    yield source, clock
    source.stop()


def test_scraper_answers_tokens_per_second_totals_and_imbalance_per_replica_and_expert(
        moe_scraper: tuple[ScraperSource, Clock]) -> None:
    source, clock = moe_scraper
    scrape(source, clock, 15)
    load = expert_load(source)
    assert_expert_load(load, rel=1e-6)  # a straight counter: rate() is its slope, exactly
    assert load.scope == "fleet" and load.window_s == WINDOW_S
    r1 = load.replicas[0]
    assert r1.tokens_total == (40 * clock.now, 20 * clock.now, 20 * clock.now, 40 * clock.now)


def test_scope_narrows_to_a_zone_or_a_replica(moe_scraper: tuple[ScraperSource, Clock]) -> None:
    source, clock = moe_scraper
    scrape(source, clock, 15)
    assert [r.replica for r in expert_load(source, Scope("zone", "az-b")).replicas] == ["r2"]
    only = expert_load(source, Scope.parse("replica:r1"), window_s=10.0)
    assert [r.replica for r in only.replicas] == ["r1"] and only.window_s == 10.0
    assert expert_load(source, Scope("replica", "dense")).experts == ()


def test_before_the_second_scrape_there_are_totals_but_no_rate_yet(
        moe_scraper: tuple[ScraperSource, Clock]) -> None:
    source, clock = moe_scraper
    scrape(source, clock, 1)
    load = expert_load(source)
    assert load.experts == EXPERTS and [r.replica for r in load.replicas] == ["r1", "r2"]
    assert all(r.tokens_per_s == (None,) * 4 and r.recent_imbalance is None for r in load.replicas)
    assert all(None not in r.tokens_total for r in load.replicas)


def test_a_dense_fleet_answers_no_experts_not_zeros() -> None:
    clock = Clock()
    source = scraper_on(("dense",), clock)
    try:
        scrape(source, clock, 5)
        load = expert_load(source)
    finally:
        source.stop()
    assert not load.is_moe and load.experts == () and load.replicas == ()


def test_experts_sort_as_numbers_and_a_missing_expert_is_none() -> None:
    clock = Clock()
    layers = {"r1": ((1,) * 12,), "r2": ((1,) * 3,)}  # twelve experts; r2's model (mid-rollout) has three
    pages = {rid: ReplicaMetrics(model_name="m", replica=rid, zone="z", max_model_len=64,
                                 read_engine=lambda ls=ls: EngineGauges(  # type: ignore[misc]
                                     0, 0, 0.0, 0, 0, 0, 1, 2, None,
                                     expert_tokens=[[int(r * clock()) for r in layer] for layer in ls]),
                                 cache_info=CacheConfigInfo(16, 8, "auto", True))
             for rid, ls in layers.items()}
    endpoints = [ReplicaEndpoint(rid, "az-a", "127.0.0.1", 9000 + i, ReplicaState.READY, "m")
                 for i, rid in enumerate(pages)]
    source = ScraperSource(lambda: endpoints, interval_s=INTERVAL_S, ring_size=50, clock=clock,
                           wall_clock=clock, window_s=WINDOW_S,
                           fetch=lambda e: generate_latest(pages[e.replica_id].registry).decode())
    try:
        scrape(source, clock, 15)
        load = expert_load(source)
    finally:
        source.stop()
    assert load.experts == tuple(str(i) for i in range(12))  # "2" before "10"
    r2 = load.replicas[1]
    assert r2.tokens_per_s[:3] == pytest.approx((1.0, 1.0, 1.0)) and r2.tokens_per_s[3:] == (None,) * 9


def test_max_over_mean_skips_unknowns_and_has_no_ratio_of_nothing() -> None:
    assert max_over_mean([3.0, 1.0, None]) == 1.5
    assert max_over_mean([None, None]) is None and max_over_mean([0.0, 0.0]) is None
    assert max_over_mean([]) is None


def test_a_nonsense_window_is_refused(moe_scraper: tuple[ScraperSource, Clock]) -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        expert_load(moe_scraper[0], window_s=0)


# ---- the real Prometheus, scraping the pages over HTTP ---------------------------------------------------
def grafana_expert_query() -> str:
    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Expert load")]
    return str(panel["targets"][0]["expr"])


def serve_page(metrics: ReplicaMetrics) -> ThreadingHTTPServer:
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(metrics.registry)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.usefixtures("prometheus_binary")
def test_prometheus_answers_the_same_by_the_targets_labels(tmp_path_factory: pytest.TempPathFactory) -> None:
    started = time.monotonic()

    def clock() -> float:  # counts far from 0: whole tokens leave the imbalance ratios exact to 1e-4
        return time.monotonic() - started + 1000.0

    pages = {rid: serve_page(replica_metrics(rid, clock)) for rid in LAYER_RATES}
    server = PrometheusServer(prometheus_config(), tmp_path_factory.mktemp("prometheus-experts"))
    source: PrometheusSource | None = None
    try:
        server.start([endpoint(rid, page.server_address[1]) for rid, page in pages.items()])
        window = 4 * SCRAPE_INTERVAL_S
        source = PrometheusSource(server.url, window_s=window)

        def both_scraped() -> ExpertLoad | None:
            load = expert_load(source)
            return load if len(load.replicas) == 2 else None

        wait_until(both_scraped, timeout=30.0, what="a scrape of both MoE pages")
        # rate() of a series younger than its window is extrapolated from part of it: wait out one window
        time.sleep(window + 1.5 * SCRAPE_INTERVAL_S)
        load = expert_load(source)
        assert_expert_load(load, rel=0.15)  # wall-clock scrapes: the slope within scrape jitter
        assert [r.replica for r in expert_load(source, Scope("zone", "az-a")).replicas] == ["r1"]
        # the page's echo of its identity is dropped: no series is grouped under it
        echoed = source.instant('count({__name__=~"llmsre_moe_.*", exported_replica!=""})', ())
        assert echoed == {}
        # the Grafana panel's query: one line per expert, and no flat 0 beside them (that is for dense)
        panel = grafana_expert_query().replace("$__rate_interval", "4s").replace("$model_name", "default-moe")
        by_expert = source.instant(panel.replace("$zone", ".*").replace("$replica", ".*"), ("expert",))
        assert sorted(by_expert) == [(e,) for e in EXPERTS]
        assert sum(by_expert.values()) == pytest.approx(sum(EXPECTED_RATES["r1"] + EXPECTED_RATES["r2"]),
                                                        rel=0.15)
    finally:
        if source is not None:
            source.stop()
        pid = server.pid
        server.stop()
        for page in pages.values():
            page.shutdown()
            page.server_close()
    assert pid is not None and not pid_exists(pid)
