"""The gateway's admission control: per-key token buckets, the retry budget, load-shedding limits per
priority class, and passive outlier ejection. Pure bookkeeping with an injectable clock."""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


# Share of max_inflight_per_replica at which a class is shed: batch first, interactive last.
SHED_FRACTIONS = {"interactive": 1.0, "standard": 0.9, "batch": 0.5}

RETRY_BUDGET_WINDOW_S = 10.0  # "recent requests" for the retry budget
RETRY_BUDGET_MIN_RETRIES = 3  # retries always allowed per window, so a quiet gateway can still retry
RATE_LIMIT_BURST_S = 1.0  # a bucket holds this many seconds of its rate

Clock = Callable[[], float]


# ---- admission -------------------------------------------------------------------------------
@dataclass(slots=True)
class TokenBucket:
    """``rate`` per second, holding at most ``capacity``; a request costlier than the capacity waits
    for a full bucket and leaves it in debt, so big requests are slowed, never refused forever."""

    rate: float
    capacity: float
    level: float
    updated: float

    @classmethod
    def full(cls, rate: float, now: float) -> TokenBucket:
        capacity = max(rate * RATE_LIMIT_BURST_S, 1.0)
        return cls(rate, capacity, capacity, now)

    def seconds_until(self, cost: float, now: float) -> float:
        """0 when ``cost`` can be taken now, else how long until it can."""
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        need = min(cost, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost


class RateLimiter:
    """Per-API-key request and token buckets; a rate of 0 turns its bucket off."""

    def __init__(self, *, requests_per_s: float, tokens_per_s: float, clock: Clock) -> None:
        self.requests_per_s, self.tokens_per_s, self.clock = requests_per_s, tokens_per_s, clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def admit(self, key: str, num_tokens: int) -> float:
        """0.0 when admitted (and charged), else the seconds to wait before asking again."""
        now = self.clock()
        costs = list(self._buckets_of(key, num_tokens, now))
        wait = max((bucket.seconds_until(cost, now) for bucket, cost in costs), default=0.0)
        if wait > 0:
            return wait
        for bucket, cost in costs:
            bucket.take(cost)
        return 0.0

    def _buckets_of(self, key: str, num_tokens: int, now: float) -> Iterable[tuple[TokenBucket, float]]:
        for kind, rate, cost in (("requests", self.requests_per_s, 1.0),
                                 ("tokens", self.tokens_per_s, float(num_tokens))):
            if rate > 0:
                yield self._buckets.setdefault((kind, key), TokenBucket.full(rate, now)), cost


class RetryBudget:
    """Retries allowed as a share of the requests of the last window (with a small floor)."""

    def __init__(self, ratio: float, *, clock: Clock, window_s: float = RETRY_BUDGET_WINDOW_S,
                 min_retries: int = RETRY_BUDGET_MIN_RETRIES) -> None:
        self.ratio, self.clock, self.window_s, self.min_retries = ratio, clock, window_s, min_retries
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def record_request(self) -> None:
        now = self.clock()
        self._forget(now)  # here too: a gateway that never retries would otherwise keep every request's time
        self._requests.append(now)

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        now = self.clock()
        self._forget(now)
        if len(self._retries) >= max(self.min_retries, self.ratio * len(self._requests)):
            return False
        self._retries.append(now)
        return True

    def _forget(self, now: float) -> None:
        """Drop the times that left the window."""
        for times in (self._requests, self._retries):
            while times and times[0] < now - self.window_s:
                times.popleft()

    @property
    def num_remembered(self) -> int:
        return len(self._requests) + len(self._retries)


class RetryBudgets:
    """A retry budget per colour, ``None`` being the uncoloured traffic. A slice experiment's fault fails its
    colour's requests on every replica, and each would spend retries; were the budget shared, the colour
    would spend the uncoloured requests' retries, a way out of the slice the experiment promises to keep."""

    def __init__(self, ratio: float, *, clock: Clock) -> None:
        self.ratio, self.clock = ratio, clock
        self._budgets: dict[str | None, RetryBudget] = {}

    def of(self, colour: str | None) -> RetryBudget:
        budget = self._budgets.get(colour)
        if budget is None:
            budget = self._budgets[colour] = RetryBudget(self.ratio, clock=self.clock)
        return budget


def shed_limit(priority: str, max_inflight: int) -> int:
    """In-flight requests per replica at which requests of ``priority`` are refused."""
    return max(1, math.ceil(SHED_FRACTIONS[priority] * max_inflight))


# ---- outlier ejection ------------------------------------------------------------------------
class OutlierDetector:
    """Consecutive failures per replica; ``eject_after`` of them eject it until a probe re-admits it."""

    def __init__(self, eject_after: int) -> None:
        self.eject_after = eject_after
        self._failures: dict[str, int] = defaultdict(int)
        self.ejected: set[str] = set()

    def record_success(self, replica_id: str) -> None:
        self._failures[replica_id] = 0

    def record_failure(self, replica_id: str) -> bool:
        """True when this failure ejected the replica."""
        self._failures[replica_id] += 1
        return self._failures[replica_id] >= self.eject_after and self.eject(replica_id)

    def eject(self, replica_id: str) -> bool:
        """Eject at once (it said it cannot serve); True unless it already was."""
        if replica_id in self.ejected:
            return False
        self.ejected.add(replica_id)
        return True

    def readmit(self, replica_id: str) -> None:
        self.ejected.discard(replica_id)
        self._failures[replica_id] = 0


