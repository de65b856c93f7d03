"""Telemetry follows the fleet: a replica that leaves stops being scraped within seconds, by both sources.

For Prometheus this is file-based service discovery: the control plane rewrites ``targets/replicas.json``
and Prometheus drops the target from ``/api/v1/targets``. For the scraper, the endpoints provider stops
listing it. Either way its gauges disappear (stale) while the remaining replica keeps reporting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from controlplane.replicas import ReplicaEndpoint
from controlplane.telemetry.base import NUM_RUNNING, Telemetry
from controlplane.telemetry.prometheus import PrometheusSource
from controlplane.telemetry.prometheus_server import PrometheusServer
from controlplane.telemetry.scraper import ScraperSource

from .conftest import SCRAPE_INTERVAL_S, Fleet, pid_exists, prometheus_config, require_binary, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FOLLOW_TIMEOUT_S = 10.0  # "within a few seconds": Prometheus' discovery batches updates for up to 5 s
DISCOVERY_TIMEOUT_S = 20.0


@dataclass
class Follower:
    source: Telemetry
    set_targets: Callable[[list[ReplicaEndpoint]], None]
    scraped: Callable[[], set[str]]  # the replicas being scraped now


@pytest.fixture
def scraper_follower(fleet: Fleet) -> Iterator[Follower]:
    current = list(fleet.endpoints)
    fetched: dict[str, float] = {}

    def fetch(endpoint: ReplicaEndpoint) -> str:
        fetched[endpoint.replica_id] = time.monotonic()
        return httpx.get(f"{endpoint.base_url}/metrics", timeout=5, trust_env=False).text

    def set_targets(endpoints: list[ReplicaEndpoint]) -> None:
        current[:] = endpoints

    def scraped() -> set[str]:
        recent = time.monotonic() - 1.5 * SCRAPE_INTERVAL_S
        return {rid for rid, at in fetched.items() if at >= recent}

    source = ScraperSource(lambda: list(current), interval_s=SCRAPE_INTERVAL_S, ring_size=60, fetch=fetch)
    source.start()
    try:
        yield Follower(source, set_targets, scraped)
    finally:
        source.stop()


@pytest.fixture
def prometheus_follower(fleet: Fleet, tmp_path: Path) -> Iterator[Follower]:
    require_binary("prometheus")
    server = PrometheusServer(prometheus_config(), tmp_path / "prometheus")
    server.start(fleet.endpoints)
    source = PrometheusSource(server.url)

    def scraped() -> set[str]:
        body = httpx.get(f"{server.url}/api/v1/targets", params={"state": "active"}, timeout=5,
                         trust_env=False).json()
        return {t["labels"]["replica"] for t in body["data"]["activeTargets"]}

    pid = server.pid
    try:
        yield Follower(source, server.update_targets, scraped)
    finally:
        source.stop()
        server.stop()
    assert pid is not None and not pid_exists(pid), f"prometheus (pid {pid}) still runs after stop"


@pytest.fixture(params=["scraper", "prometheus"])
def follower(request: pytest.FixtureRequest) -> Follower:
    follower: Follower = request.getfixturevalue(f"{request.param}_follower")
    return follower


def test_removed_replica_is_dropped_within_seconds(follower: Follower, fleet: Fleet) -> None:
    keep, drop = fleet.endpoints
    both = {keep.replica_id, drop.replica_id}
    wait_until(lambda: follower.scraped() == both, timeout=DISCOVERY_TIMEOUT_S, what="both replicas scraped")
    wait_until(lambda: set(follower.source.gauge(NUM_RUNNING)) == {(rid,) for rid in both},
               timeout=DISCOVERY_TIMEOUT_S, what="gauges from both replicas")

    follower.set_targets([keep])
    began = time.monotonic()
    wait_until(lambda: follower.scraped() == {keep.replica_id}, timeout=FOLLOW_TIMEOUT_S,
               what=f"{drop.replica_id} to leave the scraped targets")
    wait_until(lambda: set(follower.source.gauge(NUM_RUNNING)) == {(keep.replica_id,)},
               timeout=FOLLOW_TIMEOUT_S, what=f"{drop.replica_id}'s gauges to go stale")
    assert time.monotonic() - began < FOLLOW_TIMEOUT_S
    assert follower.source.gauge("up") == {(keep.replica_id,): 1.0}
