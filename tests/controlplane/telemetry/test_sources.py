"""Both telemetry sources, reading the same two real replicas, tell the same story about the traffic sent.

Each test runs once against the in-process scraper and once against a real Prometheus (see conftest).
"""

from __future__ import annotations

import time

import pytest

from controlplane.telemetry.base import (
    DECODE_TIME,
    GENERATION_TOKENS,
    KV_USAGE,
    NUM_RUNNING,
    NUM_WAITING,
    PREFILL_TIME,
    QUEUE_TIME,
    REQUEST_SUCCESS,
    TTFT,
    MetricSummary,
    Quantiles,
    Scope,
    Telemetry,
)

from .conftest import MAX_TOKENS, SCRAPE_INTERVAL_S, WINDOW_S, Observed, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SETTLE_TIMEOUT_S = 15.0  # the last scrape after the traffic lands within a couple of intervals
LOW, HIGH = 0.8, 1.3  # rate x window vs what was sent: rate() extrapolates to the window's edges


def roughly(value: float | None, expected: float) -> bool:
    return value is not None and LOW * expected <= value <= HIGH * expected


def settled_rates(source: Telemetry, observed: Observed) -> dict[tuple[str, ...], float]:
    """Per-replica success rates, once every request sent shows up in them."""
    def check() -> dict[tuple[str, ...], float] | None:
        rates = source.rate(REQUEST_SUCCESS)
        ok = all(roughly(rates.get((rid,), 0) * WINDOW_S, sent) for rid, sent in observed.sent.items())
        return rates if ok else None

    return wait_until(check, timeout=SETTLE_TIMEOUT_S, what=f"per-replica rates to match {observed.sent}")


def test_per_replica_qps_matches_the_traffic_sent(source: Telemetry, observed: Observed) -> None:
    rates = settled_rates(source, observed)
    assert set(rates) == {(rid,) for rid in observed.sent}
    assert all(rate > 0 for rate in rates.values())
    fleet = source.rate(REQUEST_SUCCESS, by=())
    assert roughly(fleet[()] * WINDOW_S, sum(observed.sent.values())), fleet


def test_several_counters_read_at_once_tell_tokens_per_request(source: Telemetry, observed: Observed) -> None:
    """``rates`` reads every counter on the same samples: every request generated ``MAX_TOKENS`` tokens, so
    each replica's token rate over its success rate is that (rate()'s extrapolation cancels; a window
    that starts while requests stream counts some of their tokens without their finish, hence the
    tolerance). tests/controlplane/telemetry/test_promql_agreement.py checks the query itself exactly."""
    settled_rates(source, observed)
    rates = source.rates((REQUEST_SUCCESS, GENERATION_TOKENS))
    assert set(rates[REQUEST_SUCCESS]) == set(rates[GENERATION_TOKENS]) == {(rid,) for rid in observed.sent}
    for group, done in rates[REQUEST_SUCCESS].items():
        assert rates[GENERATION_TOKENS][group] / done == pytest.approx(MAX_TOKENS, rel=0.15), group


def test_ttft_quantiles_are_positive_and_ordered(source: Telemetry, observed: Observed) -> None:
    settled_rates(source, observed)
    p50 = source.quantile(TTFT, 0.5)
    p99 = source.quantile(TTFT, 0.99)
    assert set(p50) == set(p99) == {(rid,) for rid in observed.sent}
    for group in p50:
        assert 0 < p50[group] <= p99[group], (group, p50, p99)


@pytest.mark.parametrize("stage", [QUEUE_TIME, PREFILL_TIME, DECODE_TIME])
def test_stage_quantiles_are_present_for_every_replica(source: Telemetry, observed: Observed,
                                                       stage: str) -> None:
    settled_rates(source, observed)
    p50 = source.quantile(stage, 0.5)
    p99 = source.quantile(stage, 0.99)
    assert set(p50) == set(p99) == {(rid,) for rid in observed.sent}
    for group in p50:
        assert 0 <= p50[group] <= p99[group], (stage, group, p50, p99)


def test_kv_usage_gauges_are_fractions_and_loads_cover_both_replicas(source: Telemetry,
                                                                      observed: Observed) -> None:
    kv = source.gauge(KV_USAGE)
    assert set(kv) == {(rid,) for rid in observed.sent}
    assert all(0 <= v <= 1 for v in kv.values()), kv
    loads = source.replica_loads()
    assert set(loads) == set(observed.sent)
    for rid, load in loads.items():
        assert load.replica_id == rid
        assert load.num_waiting >= 0 and load.num_running >= 0 and 0 <= load.kv_cache_usage <= 1
        assert load.observed_at <= time.monotonic()


def test_gauges_group_by_zone(source: Telemetry, observed: Observed) -> None:
    by_zone = source.gauge(NUM_RUNNING, by=("zone",))
    assert set(by_zone) == {("az-a",), ("az-b",)}
    one_zone = source.gauge(NUM_WAITING, by=("replica",), match={"zone": "az-b"})
    assert set(one_zone) == {(observed.fleet.endpoint("az-b").replica_id,)}


def assert_latencies(q: Quantiles, what: str) -> None:
    assert q.p50 is not None and q.p95 is not None and q.p99 is not None, (what, q)
    assert 0 <= q.p50 <= q.p95 <= q.p99, (what, q)


def settled_summary(source: Telemetry, scope: Scope, observed: Observed, replicas: set[str]) -> MetricSummary:
    """The scope's summary once its request and token rates match what was sent to ``replicas``."""
    sent = sum(observed.sent[rid] for rid in replicas)

    def check() -> MetricSummary | None:
        s = source.summary(scope)
        ok = (s.qps is not None and roughly(s.qps * s.window_s, sent)
              and s.generation_tokens_per_s is not None
              and roughly(s.generation_tokens_per_s * s.window_s, sent * MAX_TOKENS))
        return s if ok else None

    return wait_until(check, timeout=SETTLE_TIMEOUT_S, what=f"{scope} to count {sent} requests")


def assert_summary_of(summary: MetricSummary, replicas: set[str]) -> None:
    assert set(summary.replicas) == replicas
    assert summary.error_rate == 0.0, summary  # requests were answered and none with 5xx: 0, not None
    assert summary.ttft.p50 is not None and summary.ttft.p50 > 0
    for name in ("ttft", "tpot", "e2e", "queue", "prefill", "decode"):
        assert_latencies(getattr(summary, name), name)
    assert summary.kv_usage_mean is not None and summary.kv_usage_max is not None
    assert 0 <= summary.kv_usage_mean <= summary.kv_usage_max <= 1
    assert summary.num_waiting is not None and summary.num_waiting >= 0
    assert summary.num_running is not None and summary.num_running >= 0


def test_summary_for_fleet_zone_and_replica(source: Telemetry, observed: Observed) -> None:
    a = observed.fleet.endpoint("az-a")
    fleet = settled_summary(source, Scope.parse("fleet"), observed, set(observed.sent))
    assert fleet.scope == "fleet" and fleet.window_s == WINDOW_S
    assert_summary_of(fleet, set(observed.sent))
    zone = settled_summary(source, Scope.parse("zone:az-a"), observed, {a.replica_id})
    assert zone.scope == "zone:az-a"
    assert_summary_of(zone, {a.replica_id})
    replica = settled_summary(source, Scope("replica", a.replica_id), observed, {a.replica_id})
    assert replica.scope == f"replica:{a.replica_id}"
    assert_summary_of(replica, {a.replica_id})


def test_summary_of_an_unknown_zone_has_no_made_up_numbers(source: Telemetry) -> None:
    summary = source.summary(Scope.parse("zone:nowhere"))
    assert summary.replicas == ()
    assert (summary.qps, summary.error_rate, summary.kv_usage_mean, summary.num_running,
            summary.generation_tokens_per_s) == (None, None, None, None, None)
    assert summary.ttft == Quantiles(None, None, None)


def test_range_gives_chart_series_per_replica(source: Telemetry, observed: Observed) -> None:
    settled_rates(source, observed)
    # A range's last point can lie up to a step and a half-second rounding before ``end`` (Prometheus'
    # client sends whole seconds), so it may miss the scrape an instant query at ``end`` saw: the
    # points checked lie a few scrapes after the traffic, and the range reaches past them.
    scraped_after = observed.sent_at[1] + 3 * SCRAPE_INTERVAL_S
    time.sleep(max(0.0, scraped_after + 3 - time.time()))
    end = time.time()
    start = observed.sent_at[0] - 10  # the chart spans the traffic: every window after it holds it
    lines = source.range("rate", GENERATION_TOKENS, start=start, end=end, step=2)
    assert [s.group for s in lines] == sorted((rid,) for rid in observed.sent), observed.explain()
    for line in lines:
        assert line.labels == {"replica": line.group[0]}
        times = [t for t, _ in line.points]
        assert times == sorted(times) and start - 1 <= times[0] and times[-1] <= end + 1
        after = [v for t, v in line.points if t >= scraped_after]
        assert after and all(v > 0 for v in after), (line, observed.explain())
    p99 = source.range("quantile", TTFT, start=start, end=end, step=5, q=0.99, by=())
    assert len(p99) == 1 and p99[0].points and all(v > 0 for _, v in p99[0].points)
