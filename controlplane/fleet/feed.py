"""The replica set as the gateways watch it: versioned snapshots of the fleet's endpoints, with loads and
the traffic slices (a canary's share, the colours of a slice experiment).

Where it sits: between the fleet and the gateway processes. ``GET /api/v1/gateway/endpoints`` asks
:meth:`EndpointsFeed.wait` for a snapshot newer than the one a gateway holds; the answer comes as soon as
the replica set or the slices change (a replica becomes ready, drains, crashes, moves port; a canary step
moves its share; an abort sends it back to 0) or after the long poll's
wait with the same version and fresh loads. The version counts changes within one run of the control
plane; ``epoch`` names the run, so a gateway that sees a new epoch takes the set whatever its version.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controlplane.gateway.slices import SlicePlan
from controlplane.replicas import ReplicaEndpoint, ReplicaLoad

POLL_S = 0.1  # how often a waiting long poll looks at the fleet (endpoints() is a cheap in-memory read)
MAX_WAIT_S = 30.0


@dataclass(slots=True, frozen=True)
class FeedSnapshot:
    epoch: str
    version: int
    endpoints: tuple[ReplicaEndpoint, ...]
    loads: tuple[ReplicaLoad, ...]
    slices: SlicePlan = field(default_factory=SlicePlan)

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "version": self.version,
                "endpoints": [e.to_json() for e in self.endpoints],
                "loads": [x.to_json() for x in self.loads], "slices": self.slices.to_json()}


class EndpointsFeed:
    def __init__(self, endpoints: Callable[[], list[ReplicaEndpoint]],
                 loads: Callable[[str], ReplicaLoad | None] = lambda _: None, *,
                 slices: Callable[[], SlicePlan] = SlicePlan,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._endpoints, self._loads, self._slices, self.clock = endpoints, loads, slices, clock
        self.epoch = uuid.uuid4().hex[:12]
        self.version = 0
        self._last: tuple[tuple[ReplicaEndpoint, ...], SlicePlan] | None = None
        self.closed = False

    def close(self) -> None:
        """The control plane is stopping: every waiting long poll answers now, so the API server's graceful
        shutdown finds no request open (one left waiting would be cancelled and logged as an error)."""
        self.closed = True

    def current(self) -> FeedSnapshot:
        """The replica set and slices now; a change since the last look is a new version."""
        endpoints = tuple(sorted(self._endpoints(), key=lambda e: e.replica_id))
        slices = self._slices()
        if (endpoints, slices) != self._last:
            self._last = (endpoints, slices)
            self.version += 1
        loads = tuple(load for e in endpoints if (load := self._loads(e.replica_id)) is not None)
        return FeedSnapshot(self.epoch, self.version, endpoints, loads, slices)

    async def wait(self, *, epoch: str | None, after: int, wait_s: float) -> FeedSnapshot:
        """A snapshot newer than (``epoch``, ``after``), or the current one after ``wait_s``."""
        deadline = self.clock() + min(max(wait_s, 0.0), MAX_WAIT_S)
        while True:
            snapshot = self.current()
            if snapshot.epoch != epoch or snapshot.version > after or self.clock() >= deadline or self.closed:
                return snapshot
            await asyncio.sleep(POLL_S)
