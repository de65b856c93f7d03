"""The gateways' capacity refusals as a rate (controlplane/fleet/refusals.py), on a fake clock: the counts
are what a gateway's /admin/state says. tests/controlplane/up/test_autoscale_live.py has a real gateway
shed load and the fleet scale up on it."""

from __future__ import annotations

import pytest

from controlplane.fleet.refusals import RefusalCounts, for_capacity
from tests.controlplane.conftest import FakeClock


def test_only_refusals_more_replicas_would_avoid_count() -> None:
    assert for_capacity("no_replica") and for_capacity("shed_batch") and for_capacity("shed_interactive")
    assert not for_capacity("rate_limited") and not for_capacity("unauthorized")


def test_the_rate_is_the_increase_over_the_window_summed_over_gateways(clock: FakeClock) -> None:
    counts = RefusalCounts(clock=clock)
    for step in range(11):  # gw-0 sheds 4/s for 10 s; gw-1 2/s, its 503s included; rate limits ignored
        counts.observe("gw-0", {"shed_standard": 4 * step, "rate_limited": 100 * step})
        counts.observe("gw-1", {"shed_batch": step, "no_replica": step, "unauthorized": 7})
        clock.now += 1.0
    clock.now -= 1.0
    assert counts.rate(10.0) == pytest.approx(6.0)
    assert counts.rate(3.0) == pytest.approx(6.0)


def test_a_restarted_gateway_counts_from_zero_as_a_counter_reset(clock: FakeClock) -> None:
    counts = RefusalCounts(clock=clock)
    for total in (10, 20, 3, 8):  # +10, restart (+3), +5 over 3 s
        counts.observe("gw-0", {"shed_standard": total})
        clock.now += 1.0
    clock.now -= 1.0
    assert counts.rate(60.0) == pytest.approx(18 / 3)


def test_unknown_until_a_gateway_was_read_twice_in_the_window(clock: FakeClock) -> None:
    counts = RefusalCounts(clock=clock)
    assert counts.rate(30.0) is None
    counts.observe("gw-0", {"shed_standard": 5})
    assert counts.rate(30.0) is None
    clock.now += 40.0
    counts.observe("gw-0", {"shed_standard": 5})
    assert counts.rate(30.0) is None  # the first read is out of the window
    clock.now += 1.0
    counts.observe("gw-0", {"shed_standard": 5, "bogus": "x", "shed_batch": -3})
    assert counts.rate(30.0) == 0.0  # read twice, nothing refused: known to be zero
    with pytest.raises(ValueError, match="window_s"):
        counts.rate(0.0)


def test_samples_older_than_the_horizon_are_dropped(clock: FakeClock) -> None:
    counts = RefusalCounts(horizon_s=10.0, clock=clock)
    for step in range(100):
        counts.observe("gw-0", {"no_replica": step})
        clock.now += 1.0
    assert len(counts._samples["gw-0"]) <= 12
