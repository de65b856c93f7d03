"""A small observed fleet for the telemetry tests: two real replicas, a real Prometheus, the scraper.

The fleet, both sources and a bounded burst of traffic are set up once per session, in this order:
replicas ready -> both sources scraping them -> traffic -> tests. Each behaviour test takes the
``source`` fixture, parametrized over ``scraper`` and ``prometheus``, so one test body checks both.

Prometheus tests need the binary: without it they fail with "unavailable: prometheus binary not found"
when ``$CI`` is set (CI installs it), and are skipped with that reason otherwise.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import psutil
import pytest

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import REQUEST_SUCCESS, Telemetry
from controlplane.telemetry.config import PrometheusConfig
from controlplane.telemetry.prometheus import PrometheusSource
from controlplane.telemetry.prometheus_server import UNAVAILABLE, PrometheusServer
from controlplane.telemetry.scraper import ScraperSource
from inference.launcher import ReplicaProcess, free_port
from inference.models.default import ensure_default_model
from tests import polling

ZONES = ("az-a", "az-b")
API_KEY = "telemetry-test-key"
SCRAPE_INTERVAL_S = 1.0  # test-only: fast enough to see traffic within seconds
WINDOW_S = 120.0  # every query of the session sees the whole burst of traffic
RING_SIZE = 600
REQUESTS_PER_REPLICA = 10
MAX_TOKENS = 8
READY_TIMEOUT_S = 90.0
OBSERVE_TIMEOUT_S = 20.0  # Prometheus' discovery sends its first targets up to 5 s after start
# Scrapes of history before the traffic: rate() extrapolates up to 1.1 scrape intervals past the last
# sample, a share of the sampled span that shrinks as the span grows.
HISTORY_SCRAPES = 4

T = TypeVar("T")


def wait_until(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.2) -> T:
    """The shared poll, at a pace that suits Prometheus' scrape interval."""
    return polling.wait_until(check, timeout=timeout, what=what, interval=interval)


def pid_exists(pid: int) -> bool:
    """Whether a process with ``pid`` still runs (an exited, unreaped child does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def require_binary(name: str) -> None:
    """Fail (under CI) or skip (elsewhere) when ``name`` is not installed; never skip silently."""
    if shutil.which(name) is not None:
        return
    reason = UNAVAILABLE if name == "prometheus" else f"unavailable: {name} binary not found"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def prometheus_binary() -> None:
    require_binary("prometheus")


@pytest.fixture
def promtool_binary() -> None:
    require_binary("promtool")


def prometheus_config() -> PrometheusConfig:
    """A Prometheus on a free loopback port, scraping every second."""
    return PrometheusConfig(port=free_port(), scrape_interval_s=SCRAPE_INTERVAL_S)


@dataclass
class Fleet:
    replicas: list[ReplicaProcess]
    endpoints: list[ReplicaEndpoint]

    def endpoint(self, zone: str) -> ReplicaEndpoint:
        return next(e for e in self.endpoints if e.zone == zone)


@dataclass
class Observed:
    fleet: Fleet
    sources: dict[str, Telemetry]
    server: PrometheusServer | None
    sent: dict[str, int]  # successful requests sent, by replica
    sent_at: tuple[float, float]  # wall-clock start and end of that traffic

    def explain(self) -> str:
        """What Prometheus knows of its targets and the tail of its log: attached to a failed assertion."""
        if self.server is None:
            return ""
        try:
            targets = httpx.get(f"{self.server.url}/api/v1/targets", timeout=5, trust_env=False).json()
            keys = ("labels", "health", "lastError", "lastScrape", "lastScrapeDuration")
            health = [{k: t.get(k) for k in keys} for t in targets["data"]["activeTargets"]]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            health = [{"error": str(exc)}]
        return f"traffic at {self.sent_at}; targets: {health}; prometheus log:{self.server.log_tail()}"


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("telemetry-state")
    ensure_default_model(folder)  # once, before two replicas would race to build it
    return folder


@pytest.fixture(scope="session")
def fleet(state_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("replica-logs")
    replicas = [
        ReplicaProcess(port=free_port(), replica_id=f"tele-{zone}", zone=zone, log_path=logs / f"{zone}.log",
                       extra_args=("--model", "default", "--num-threads", "1", "--api-key", API_KEY),
                       env={"LLMSRE_STATE_DIR": str(state_dir)})
        for zone in ZONES
    ]
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(READY_TIMEOUT_S)
        endpoints = [ReplicaEndpoint(r.replica_id, r.zone, "127.0.0.1", r.port, ReplicaState.READY, "default")
                     for r in replicas]
        yield Fleet(replicas, endpoints)
    finally:
        for replica in replicas:
            replica.stop()


def send_traffic(fleet: Fleet, per_replica: int = REQUESTS_PER_REPLICA) -> dict[str, int]:
    """``per_replica`` short completions to each replica, four at a time; returns the successes."""
    def one(replica: ReplicaProcess) -> str:
        response = httpx.post(f"{replica.base_url}/v1/completions", timeout=60, trust_env=False,
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": "default", "prompt": "The fleet reports",
                                    "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return replica.replica_id

    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(one, [r for r in fleet.replicas for _ in range(per_replica)]))
    return {r.replica_id: done.count(r.replica_id) for r in fleet.replicas}


def _observes_fleet(source: Telemetry, fleet: Fleet) -> bool:
    """Two samples of every replica are in: a rate exists for each (a counter still at its start value)."""
    rates = source.rate(REQUEST_SUCCESS, window_s=WINDOW_S)
    return all((e.replica_id,) in rates for e in fleet.endpoints)


@pytest.fixture(scope="session")
def observed(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    sources: dict[str, Telemetry] = {}
    server: PrometheusServer | None = None
    scraper = ScraperSource(lambda: fleet.endpoints, interval_s=SCRAPE_INTERVAL_S, ring_size=RING_SIZE,
                            window_s=WINDOW_S)
    # One request each before anyone watches: the replica creates its http_requests series on the first
    # request, and a series born inside a rate window loses its first increase (in Prometheus too).
    send_traffic(fleet, per_replica=1)
    try:
        scraper.start()
        sources["scraper"] = scraper
        if shutil.which("prometheus") is not None:
            server = PrometheusServer(prometheus_config(), tmp_path_factory.mktemp("prometheus"))
            server.start(fleet.endpoints)
            sources["prometheus"] = PrometheusSource(server.url, window_s=WINDOW_S)
        for name, source in sources.items():
            wait_until(functools.partial(_observes_fleet, source, fleet), timeout=OBSERVE_TIMEOUT_S,
                       what=f"the {name} source to scrape both replicas twice")
        time.sleep(HISTORY_SCRAPES * SCRAPE_INTERVAL_S)
        began = time.time()
        sent = send_traffic(fleet)
        yield Observed(fleet, sources, server, sent, (began, time.time()))
    finally:
        for source in sources.values():
            source.stop()
        if server is not None:
            pid = server.pid
            server.stop()
            assert pid is not None and not pid_exists(pid), f"prometheus (pid {pid}) outlived the session"


@pytest.fixture(params=["scraper", "prometheus"])
def source(request: pytest.FixtureRequest) -> Telemetry:
    """Each behaviour test runs once per source, with the same body."""
    if request.param == "prometheus":
        require_binary("prometheus")
    observed: Observed = request.getfixturevalue("observed")
    return observed.sources[request.param]
