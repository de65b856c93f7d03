"""The login backoff's bookkeeping, on a simulated clock: the wait doubles per failure after the free ones
and stops at the cap; a quiet key is forgotten; the tables stay bounded, and a flood of made-up names cannot
push out the flooding client's own entry; an attempt counts until it succeeds."""

from __future__ import annotations

import pytest

from controlplane.api.throttle import Backoff, LoginThrottle
from controlplane.config import LoginLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backoff(clock: Clock, *, free: int = 2, capacity: int = 100) -> Backoff:
    return Backoff(free=free, backoff_s=1.0, max_backoff_s=8.0, capacity=capacity, clock=clock)


def test_the_wait_doubles_after_the_free_failures_and_stops_at_the_cap() -> None:
    clock = Clock()
    table = backoff(clock)
    waits = []
    for _ in range(7):
        table.fail("alice")
        waits.append(table.wait_s("alice"))
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    clock.now += 3
    assert table.wait_s("alice") == 5.0  # counted from the last failure


def test_a_key_quiet_for_longer_than_the_cap_is_forgotten() -> None:
    clock = Clock()
    table = backoff(clock)
    for _ in range(5):
        table.fail("alice")
    clock.now += 8.5
    assert table.wait_s("alice") == 0.0
    table.fail("alice")
    assert table.wait_s("alice") == 0.0  # one failure again, within the free ones


def test_the_table_is_bounded_and_keeps_the_most_recent_keys() -> None:
    clock = Clock()
    table = backoff(clock, capacity=3)
    for _ in range(3):
        table.fail("attacker")
    for name in ("a", "b", "c", "d"):
        table.fail(name)
        table.fail("attacker")  # the flooding client fails with every made-up name
    assert len(table) == 3
    assert table.wait_s("attacker") > 0
    assert table.wait_s("a") == 0.0  # forgotten: the least recent


def test_an_attempt_counts_until_it_succeeds() -> None:
    clock = Clock()
    throttle = LoginThrottle(LoginLimits(user_free_failures=2, client_free_failures=3, backoff_s=1.0,
                                         max_backoff_s=8.0), clock=clock)
    assert [throttle.admit("alice", "10.0.0.1") for _ in range(3)] == [0.0, 0.0, 1.0]  # parallel attempts
    throttle.succeeded("alice", "10.0.0.1")
    assert throttle.admit("alice", "10.0.0.1") == 0.0  # the user's failures are cleared
    # the client: two attempts counted, one taken back by the success, alice's again, bob's: three
    assert throttle.admit("bob", "10.0.0.1") == 0.0
    assert throttle.admit("carol", "10.0.0.1") == 1.0


@pytest.mark.parametrize("kwargs", [{"free": 0}, {"capacity": 0}, {"backoff_s": 0.0}, {"backoff_s": 9.0}])
def test_nonsense_limits_are_refused(kwargs: dict[str, float]) -> None:
    values = {"free": 2, "backoff_s": 1.0, "max_backoff_s": 8.0, "capacity": 10, **kwargs}
    with pytest.raises(ValueError):
        Backoff(clock=Clock(), **values)  # type: ignore[arg-type]
