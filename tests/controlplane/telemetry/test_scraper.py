"""The in-process scraper on a fake clock and fake /metrics pages: what it keeps, forgets and answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import Scope
from controlplane.telemetry.scraper import ScraperSource

INTERVAL_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """Fake replicas: each has a page of metric lines; fetches are recorded."""

    def __init__(self) -> None:
        self.endpoints: list[ReplicaEndpoint] = []
        self.pages: dict[str, dict[str, float]] = {}
        self.failing: set[str] = set()
        self.fetched: list[str] = []

    def add(self, replica_id: str, zone: str, state: ReplicaState = ReplicaState.READY) -> None:
        port = 9000 + len(self.endpoints)
        self.endpoints.append(ReplicaEndpoint(replica_id, zone, "127.0.0.1", port, state, "default"))
        self.pages[replica_id] = {}

    def remove(self, replica_id: str) -> None:
        self.endpoints = [e for e in self.endpoints if e.replica_id != replica_id]

    def fetch(self, endpoint: ReplicaEndpoint) -> str:
        self.fetched.append(endpoint.replica_id)
        if endpoint.replica_id in self.failing:
            raise httpx.ConnectError("connection refused")
        return "".join(f"{line} {value}\n" for line, value in self.pages[endpoint.replica_id].items())


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fleet() -> Fleet:
    fleet = Fleet()
    fleet.add("r1", "az-a")
    fleet.add("r2", "az-b")
    return fleet


@pytest.fixture
def scraper(fleet: Fleet, clock: Clock) -> Iterator[ScraperSource]:
    source = ScraperSource(lambda: fleet.endpoints, interval_s=INTERVAL_S, ring_size=20, clock=clock,
                           wall_clock=clock, fetch=fleet.fetch, window_s=20)
    yield source
    source.stop()


def tick(scraper: ScraperSource, clock: Clock, n: int = 1) -> None:
    for _ in range(n):
        clock.now += INTERVAL_S
        scraper.scrape_once()


def test_gauge_is_the_latest_value_with_target_labels_filled_in(scraper: ScraperSource, fleet: Fleet,
                                                                 clock: Clock) -> None:
    fleet.pages["r1"]["vllm:num_requests_waiting"] = 3  # no labels on the page: the target's are added
    fleet.pages["r2"]['vllm:num_requests_waiting{replica="r2",zone="az-b"}'] = 1
    tick(scraper, clock)
    fleet.pages["r1"]["vllm:num_requests_waiting"] = 5
    tick(scraper, clock)
    assert scraper.gauge("vllm:num_requests_waiting") == {("r1",): 5.0, ("r2",): 1.0}
    by_zone = scraper.gauge("vllm:num_requests_waiting", by=("zone",), match={"zone": "az-a"})
    assert by_zone == {("az-a",): 5.0}
    assert scraper.gauge("vllm:num_requests_waiting", by=(), agg="max") == {(): 5.0}
    assert scraper.gauge("vllm:num_requests_waiting", by=(), agg="avg") == {(): 3.0}
    assert scraper.gauge("up", by=("replica", "job")) == {("r1", "replicas"): 1.0, ("r2", "replicas"): 1.0}


def test_the_targets_labels_win_over_what_a_page_says_of_itself(scraper: ScraperSource, fleet: Fleet,
                                                                clock: Clock) -> None:
    """As the generated Prometheus configuration does: a replica started with a stale id or zone (or one
    answering on another's port) is counted under the target the fleet scrapes."""
    fleet.pages["r1"]['vllm:num_requests_running{replica="old-id",zone="az-x",model_name="m"}'] = 2
    tick(scraper, clock)

    assert scraper.gauge("vllm:num_requests_running", by=("replica", "zone", "model_name")) == {
        ("r1", "az-a", "m"): 2.0}


def test_counter_reset_on_replica_restart_is_counted_like_prometheus(scraper: ScraperSource, fleet: Fleet,
                                                                      clock: Clock) -> None:
    fleet.remove("r2")
    name = "vllm:request_success_total"
    for value in (0, 4, 8, 2, 6):  # the replica restarted between 8 and 2
        fleet.pages["r1"][name] = value
        tick(scraper, clock)
    # Increase (6 - 0) + 8 = 14 over 8 s sampled; the window reaches 2 s before the first sample but the
    # counter started at 0 there, so no extrapolation to the start; none to the end either.
    assert scraper.rate(name, window_s=10) == {("r1",): pytest.approx(14 / 10)}


def test_quantile_comes_from_bucket_increases(scraper: ScraperSource, fleet: Fleet, clock: Clock) -> None:
    fleet.remove("r2")
    name = "vllm:time_to_first_token_seconds_bucket"
    before = {"0.1": 100, "0.5": 100, "+Inf": 100}  # history before the window does not count
    after = {"0.1": 110, "0.5": 130, "+Inf": 140}  # 10 fast, 20 medium, 10 beyond 0.5 s
    for counts in (before, after):
        for le, count in counts.items():
            fleet.pages["r1"][f'{name}{{le="{le}"}}'] = count
        tick(scraper, clock)
    # rank 0.5 x 40 = 20 falls in (0.1, 0.5] holding 20: 10 into it
    assert scraper.quantile("vllm:time_to_first_token_seconds", 0.5, window_s=4) == {
        ("r1",): pytest.approx(0.1 + 0.4 * 10 / 20)}
    assert scraper.quantile(name, 0.9, window_s=4) == {("r1",): 0.5}  # in +Inf: the highest finite bound


def test_quantile_without_observations_is_absent_not_zero(scraper: ScraperSource, fleet: Fleet,
                                                          clock: Clock) -> None:
    for le in ("0.1", "+Inf"):
        fleet.pages["r1"][f'h_bucket{{le="{le}"}}'] = 0
    tick(scraper, clock, 3)
    assert scraper.quantile("h", 0.99) == {}


def test_removed_replica_is_no_longer_scraped_and_leaves_instant_queries(scraper: ScraperSource, fleet: Fleet,
                                                                          clock: Clock) -> None:
    for rid in ("r1", "r2"):
        fleet.pages[rid]["vllm:num_requests_running"] = 2
        fleet.pages[rid]["vllm:request_success_total"] = 0
    tick(scraper, clock)
    for rid in ("r1", "r2"):
        fleet.pages[rid]["vllm:request_success_total"] = 10
    tick(scraper, clock)
    fleet.remove("r2")
    fleet.fetched.clear()
    tick(scraper, clock, 2)
    assert fleet.fetched == ["r1", "r1"]
    assert scraper.gauge("vllm:num_requests_running") == {("r1",): 2.0}
    assert scraper.gauge("up") == {("r1",): 1.0}
    # Its samples still count in rates until they leave the window, as in Prometheus.
    assert set(scraper.rate("vllm:request_success_total", window_s=10)) == {("r1",), ("r2",)}


def test_series_of_a_departed_replica_age_out(scraper: ScraperSource, fleet: Fleet, clock: Clock) -> None:
    fleet.pages["r1"]["a"] = 1
    fleet.pages["r2"]["b"] = 1
    tick(scraper, clock)
    fleet.remove("r2")
    tick(scraper, clock)
    assert scraper.num_series == 4  # a, b and both up series
    tick(scraper, clock, scraper.ring_size + 1)  # past the rings' horizon
    assert scraper.num_series == 2
    assert scraper.rate("b", window_s=1e6) == {}


def test_stopped_replicas_are_not_scraped(scraper: ScraperSource, fleet: Fleet, clock: Clock) -> None:
    fleet.add("r3", "az-c", ReplicaState.STOPPED)
    tick(scraper, clock)
    assert sorted(fleet.fetched) == ["r1", "r2"]


def test_failed_scrape_sets_up_to_zero_and_hides_the_replica_gauges(scraper: ScraperSource, fleet: Fleet,
                                                                     clock: Clock) -> None:
    fleet.pages["r1"]["vllm:kv_cache_usage_perc"] = 0.5
    fleet.pages["r2"]["vllm:kv_cache_usage_perc"] = 0.25
    tick(scraper, clock)
    fleet.failing.add("r2")
    tick(scraper, clock)
    assert scraper.gauge("up") == {("r1",): 1.0, ("r2",): 0.0}
    assert scraper.gauge("vllm:kv_cache_usage_perc") == {("r1",): 0.5}
    fleet.failing.clear()
    tick(scraper, clock)
    assert scraper.gauge("vllm:kv_cache_usage_perc") == {("r1",): 0.5, ("r2",): 0.25}


def test_rings_are_bounded(scraper: ScraperSource, fleet: Fleet, clock: Clock) -> None:
    fleet.remove("r2")
    for i in range(50):
        fleet.pages["r1"]["c_total"] = i
        tick(scraper, clock)
    ring = scraper.range("gauge", "c_total", start=0, end=clock.now, step=INTERVAL_S)
    assert len(ring) == 1 and len(ring[0].points) == scraper.ring_size
    assert ring[0].points[-1] == (clock.now, 49.0)


def test_range_evaluates_each_step_on_wall_clock_time(fleet: Fleet, clock: Clock) -> None:
    wall_offset = 1_700_000_000.0
    source = ScraperSource(lambda: fleet.endpoints[:1], interval_s=INTERVAL_S, ring_size=100, clock=clock,
                           wall_clock=lambda: clock.now + wall_offset, fetch=fleet.fetch)
    for i in range(10):
        fleet.pages["r1"]["c_total"] = 3 * i  # +3 every 2 s: 1.5/s
        tick(source, clock)
    end = clock.now + wall_offset
    lines = source.range("rate", "c_total", start=end - 8, end=end, step=4, window_s=4)
    assert [t for t, _ in lines[0].points] == [end - 8, end - 4, end]
    assert [v for _, v in lines[0].points] == pytest.approx([1.5, 1.5, 1.5])


def test_summary_without_data_says_none(scraper: ScraperSource) -> None:
    summary = scraper.summary(Scope())
    assert summary.replicas == ()
    assert summary.qps is None and summary.error_rate is None and summary.ttft.p99 is None
    assert summary.kv_usage_max is None and summary.num_waiting is None and summary.num_running is None


def test_background_loop_scrapes_every_interval_until_stopped(fleet: Fleet) -> None:
    scraped = threading.Event()
    count = 0

    def fetch(endpoint: ReplicaEndpoint) -> str:
        nonlocal count
        count += 1
        if count >= 4:
            scraped.set()
        return "x 1\n"

    source = ScraperSource(lambda: fleet.endpoints, interval_s=0.05, ring_size=10, fetch=fetch)
    before = set(threading.enumerate())
    source.start()
    # its own loop, not one another test of the same process (an xdist worker) may have running
    (loop,) = [t for t in threading.enumerate() if t.name == "telemetry-scraper" and t not in before]
    try:
        assert scraped.wait(5), "the loop did not scrape twice"
    finally:
        source.stop()
    after_stop = count
    time.sleep(0.2)
    assert count == after_stop
    assert not loop.is_alive()
