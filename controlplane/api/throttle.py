"""Backoff for failed logins, per user name and per client address; bookkeeping only (no I/O, a clock).

Where it sits: ``POST /api/v1/auth/login`` (``controlplane.api.auth``) asks :meth:`LoginThrottle.admit`
before it checks a password. Every attempt counts as a failure until it succeeds (so attempts sent in
parallel cannot all slip in before the first failure is counted); :meth:`LoginThrottle.succeeded` takes
the attempt back and clears the user's failures. After the free failures, each attempt waits
``backoff_s * 2 ** (failures - free)`` seconds, at most ``max_backoff_s``, counted from the last failure.

The state lives in memory only (a restart forgets it) and is bounded: at most ``max_tracked`` names and as
many addresses, the least recently failed forgotten first, and an entry forgotten ``max_backoff_s`` after
its last failure. A flood of made-up names cannot push out the flooding client's own entry: it is the
most recent one.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.config import LoginLimits


@dataclass(slots=True)
class _Failures:
    count: int
    last: float


class Backoff:
    """Failures per key, with the wait they impose; bounded to ``capacity`` keys (least recent out)."""

    def __init__(self, *, free: int, backoff_s: float, max_backoff_s: float, capacity: int,
                 clock: Callable[[], float]) -> None:
        if free < 1 or capacity < 1 or not 0 < backoff_s <= max_backoff_s:
            raise ValueError("free and capacity must be >= 1, and 0 < backoff_s <= max_backoff_s")
        self.free, self.backoff_s, self.max_backoff_s = free, backoff_s, max_backoff_s
        self.capacity = capacity
        self._clock = clock
        self._failures: OrderedDict[str, _Failures] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def wait_s(self, key: str) -> float:
        """Seconds until ``key`` may try again; 0.0 when it may now."""
        entry = self._current(key)
        if entry is None or entry.count < self.free:
            return 0.0
        delay = min(self.max_backoff_s, math.ldexp(self.backoff_s, min(entry.count - self.free, 62)))
        return max(0.0, entry.last + delay - self._clock())

    def fail(self, key: str) -> None:
        entry = self._current(key)
        now = self._clock()
        if entry is None:
            self._failures[key] = _Failures(1, now)
        else:
            entry.count, entry.last = entry.count + 1, now
            self._failures.move_to_end(key)
        while len(self._failures) > self.capacity:
            self._failures.popitem(last=False)

    def forgive_one(self, key: str) -> None:
        """Take back one failure (an attempt that succeeded after all)."""
        entry = self._failures.get(key)
        if entry is not None:
            entry.count -= 1
            if entry.count <= 0:
                del self._failures[key]

    def clear(self, key: str) -> None:
        self._failures.pop(key, None)

    def _current(self, key: str) -> _Failures | None:
        entry = self._failures.get(key)
        if entry is not None and self._clock() - entry.last > self.max_backoff_s:
            del self._failures[key]  # quiet for longer than the longest wait: forgotten
            return None
        return entry


class LoginThrottle:
    """Per-user and per-client backoff for logins; thread-safe (the login route runs in worker threads)."""

    def __init__(self, limits: LoginLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        def backoff(free: int) -> Backoff:
            return Backoff(free=free, backoff_s=limits.backoff_s, max_backoff_s=limits.max_backoff_s,
                           capacity=limits.max_tracked, clock=clock)

        self.users = backoff(limits.user_free_failures)
        self.clients = backoff(limits.client_free_failures)
        self._lock = threading.Lock()

    def admit(self, user: str, client: str) -> float:
        """0.0 when this attempt may go ahead (it is counted as a failure until :meth:`succeeded`), else
        the seconds to wait (the attempt is not counted)."""
        with self._lock:
            wait = max(self.users.wait_s(user), self.clients.wait_s(client))
            if wait > 0:
                return wait
            self.users.fail(user)
            self.clients.fail(client)
            return 0.0

    def succeeded(self, user: str, client: str) -> None:
        with self._lock:
            self.users.clear(user)
            self.clients.forgive_one(client)
