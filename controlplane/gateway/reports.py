"""What a gateway tells the control plane: per-request traces and its events, buffered and delivered.

Where it sits: the gateway hands every finished request's :class:`~controlplane.traces.TraceRecord` and
every event (ejected, readmitted, resumed, stalled...) to :class:`Reports` synchronously, on its request
path, so both calls only append to bounded queues. A background task delivers batches to the control
plane (``POST /api/v1/gateway/reports``) and keeps them while it is unreachable. When a queue is full the
oldest entry makes room and is counted; the count goes with the next delivery (the control plane records
it as a ``gateway.reports_dropped`` event) and stays visible as a metric, so nothing is lost silently.

Traces are sampled here, before they are queued (every request above the running P95 and a sample of the
rest: :class:`~controlplane.traces.TraceSampler`), so the queue holds what the store would keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx

from controlplane.traces import TraceRecord, TraceSampler

logger = logging.getLogger(__name__)

REPORTS_PATH = "/api/v1/gateway/reports"
DEFAULT_MAX_TRACES = 20_000
DEFAULT_MAX_EVENTS = 5_000
DEFAULT_INTERVAL_S = 1.0
BATCH = 1_000  # entries of each kind per delivery
TIMEOUT_S = 10.0


@dataclasses.dataclass(slots=True, frozen=True)
class GatewayEvent:
    kind: str  # without the "gateway." prefix: ejected, readmitted, resumed, stalled, ...
    replica_id: str
    detail: str
    at: float  # POSIX seconds when it happened (the control plane stores it as it arrives)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Reports:
    """Bounded queues of traces and events, delivered to the control plane by :meth:`run`."""

    def __init__(self, *, gateway: str, control_plane: str | None, token: str | None, sampler: TraceSampler,
                 max_traces: int = DEFAULT_MAX_TRACES, max_events: int = DEFAULT_MAX_EVENTS,
                 interval_s: float = DEFAULT_INTERVAL_S, transport: httpx.AsyncBaseTransport | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.gateway, self.sampler, self.interval_s, self.wall = gateway, sampler, interval_s, wall
        self.url = control_plane.rstrip("/") + REPORTS_PATH if control_plane else None
        self.traces: deque[TraceRecord] = deque()
        self.events: deque[GatewayEvent] = deque()
        self.max_traces, self.max_events = max_traces, max_events
        self.dropped = {"traces": 0, "events": 0}  # since the last delivery that carried the count
        self.dropped_total = {"traces": 0, "events": 0}
        self.delivered_total = {"traces": 0, "events": 0}
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(transport=transport, trust_env=False, timeout=TIMEOUT_S)
        self._task: asyncio.Task[None] | None = None

    # ---- the request path (sync, bounded) ----
    def trace(self, record: TraceRecord) -> None:
        if self.sampler.keep(record):
            self._push(self.traces, record, self.max_traces, "traces")

    def event(self, kind: str, replica_id: str, detail: str) -> None:
        event = GatewayEvent(kind, replica_id, detail, self.wall())
        self._push(self.events, event, self.max_events, "events")

    def _push(self, queue: deque[Any], item: Any, limit: int, kind: str) -> None:
        if len(queue) >= limit:
            queue.popleft()
            self.dropped[kind] += 1
            self.dropped_total[kind] += 1
        queue.append(item)

    def status(self) -> dict[str, Any]:
        return {"buffered": {"traces": len(self.traces), "events": len(self.events)},
                "dropped_total": dict(self.dropped_total), "delivered_total": dict(self.delivered_total)}

    # ---- delivery ----
    def start(self) -> None:
        if self.url is not None and self._task is None:
            self._task = asyncio.create_task(self.run(), name="gateway-reports")

    async def stop(self, *, flush: bool = True) -> None:
        """End delivery; with ``flush``, one last attempt to deliver what is queued."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if flush and self.url is not None:
            with contextlib.suppress(httpx.HTTPError):
                await self.deliver()
        await self._client.aclose()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                while await self.deliver() >= BATCH:
                    pass  # a backlog after an outage goes out batch after batch
            except httpx.HTTPError as exc:
                logger.debug("[%s] reports not delivered (kept: %d traces, %d events): %s", self.gateway,
                             len(self.traces), len(self.events), exc)

    async def deliver(self) -> int:
        """Send one batch; entries that did not reach the control plane go back to the front of their
        queue. Returns how many entries went out; ``httpx.HTTPError`` when they did not."""
        if self.url is None:
            return 0
        traces = [self.traces.popleft() for _ in range(min(BATCH, len(self.traces)))]
        events = [self.events.popleft() for _ in range(min(BATCH, len(self.events)))]
        dropped = dict(self.dropped)
        if not traces and not events and not any(dropped.values()):
            return 0
        body = {"gateway": self.gateway, "traces": [dataclasses.asdict(t) for t in traces],
                "events": [e.to_json() for e in events], "dropped": dropped}
        try:
            response = await self._client.post(self.url, json=body, headers=self._headers)
            response.raise_for_status()
        except httpx.HTTPError:
            self._requeue(self.traces, traces, self.max_traces, "traces")
            self._requeue(self.events, events, self.max_events, "events")
            raise
        for kind in dropped:
            self.dropped[kind] -= dropped[kind]
        self.delivered_total["traces"] += len(traces)
        self.delivered_total["events"] += len(events)
        return len(traces) + len(events)

    def _requeue(self, queue: deque[Any], items: list[Any], limit: int, kind: str) -> None:
        queue.extendleft(reversed(items))
        while len(queue) > limit:  # what arrived meanwhile filled the queue: the oldest make room
            queue.popleft()
            self.dropped[kind] += 1
            self.dropped_total[kind] += 1
