"""Requests the gateways refused for want of capacity, as a rate the autoscaler adds to the offered load.

Where it sits: the gateway supervisor (:mod:`controlplane.fleet.gateways`) reads each gateway's
``/admin/state`` every half second; its ``refused`` counts (by reason, since that gateway process started)
land in :class:`RefusalCounts`. The autoscaler asks it for a rate over its windows
(:func:`controlplane.autoscale.observe.observe_telemetry`).

Why: a request a gateway sheds (every replica at its in-flight limit for the request's priority) or answers
with a 503 (no routable replica) never reaches a replica, and the replicas' request rate is what sizes the
fleet. Without this, a fleet that sheds looks exactly full, never too small, and does not grow while the
gateways turn clients away. Requests refused by a per-key rate limit (the operator's policy, not load to
serve) and unauthenticated ones do not count.

A client that retries a refused request is counted at each refusal, so while the gateways shed the rate
overstates the new work; a scale-up sized on it is undone by the ordinary scale-down, after its
stabilization window, once nothing is refused.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

HORIZON_S = 900.0  # samples kept per gateway: longer than any metrics window the autoscaler takes


def for_capacity(reason: str) -> bool:
    """A refusal that more replicas would have avoided."""
    return reason == "no_replica" or reason.startswith("shed_")


class RefusalCounts:
    """Each gateway's running count of capacity refusals, sampled as the supervisor reads it."""

    def __init__(self, *, horizon_s: float = HORIZON_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon_s, self.clock = horizon_s, clock
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()  # observed on the event loop, read from the autoscaler's thread

    def observe(self, gateway: str, refused: Mapping[str, Any]) -> None:
        """The counts a gateway's ``/admin/state`` gave now (reasons it does not know are ignored)."""
        total = sum(int(n) for reason, n in refused.items()
                    if for_capacity(str(reason)) and isinstance(n, int) and n >= 0)
        now = self.clock()
        with self._lock:
            samples = self._samples.setdefault(gateway, deque())
            samples.append((now, total))
            while len(samples) > 2 and samples[1][0] < now - self.horizon_s:
                samples.popleft()

    def rate(self, window_s: float) -> float | None:
        """Capacity refusals per second over the last ``window_s``, every gateway together; None when no
        gateway was read twice in that window (nothing to take a rate from). A count that went down is a
        restarted gateway process: it counts from zero again, as Prometheus treats a counter reset."""
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        since = self.clock() - window_s
        rates: list[float] = []
        with self._lock:
            for samples in self._samples.values():
                inside = [s for s in samples if s[0] >= since]
                if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
                    continue
                increase = 0
                for (_, before), (_, after) in itertools.pairwise(inside):
                    increase += after - before if after >= before else after
                rates.append(increase / (inside[-1][0] - inside[0][0]))
        return sum(rates) if rates else None
