"""The host whose cores the simulated replicas share (``SimSettings.host_cores``).

By default each replica has a core of its own and no :class:`SharedCores` is made. Given ``host_cores``,
the replicas share that many cores (as local replica processes of one torch thread each share a host): a
segment's step time is stretched by ``max(1, busy / host_cores)``, ``busy`` counting the replicas running
a segment when it starts, itself included; by ``max(1, busy * limit / host_cores)`` for replicas measured
under a CPU limit of ``limit`` cores (``ReplicaProfile.cpu_limit``), whose profile already runs at that
share. Other processes on those cores (the gateway relaying the streams, a load client on the same host,
the control plane) take ``cpu_per_request_s`` core-seconds per request: at the arrival rate of the last
``window_s`` that many cores fewer are left to the replicas (at least a quarter of the host's), so a step
stretches by ``busy / (cores - other)`` once the busy replicas want more than what is left.
"""

from __future__ import annotations

from collections import deque


class SharedCores:
    """How much slower the busy replicas step on the host's cores than each on a core of its own."""

    def __init__(self, cores: int, *, cpu_per_request_s: float = 0.0, window_s: float = 6.0,
                 replica_cpu_limit: float | None = None) -> None:
        if cores < 1:
            raise ValueError(f"host_cores: must be >= 1 or None, got {cores}")
        if not cpu_per_request_s >= 0:
            raise ValueError(f"host_cpu_per_request_s: must be >= 0, got {cpu_per_request_s!r}")
        self.cores = cores
        self.cpu_per_request_s = cpu_per_request_s
        self.window_s = window_s
        # a replica wants a core, or its CPU limit where the profile was measured under one
        self.per_replica = min(1.0, replica_cpu_limit or 1.0)
        self._recent: deque[float] = deque()  # arrivals of the last window_s (the other processes' CPU)

    def arrived(self, now: float) -> None:
        if self.cpu_per_request_s:
            self._recent.append(now)

    def stretch(self, busy: int, now: float) -> float:
        """The cores ``busy`` replicas want over the cores the host's other processes leave them, >= 1."""
        return max(1.0, busy * self.per_replica / self._cores_left(now))

    def _cores_left(self, now: float) -> float:
        if not self.cpu_per_request_s:
            return float(self.cores)
        while self._recent and self._recent[0] < now - self.window_s:
            self._recent.popleft()
        rate = len(self._recent) / self.window_s  # early in a run, the window's share of it
        return max(self.cores - rate * self.cpu_per_request_s, self.cores / 4)
