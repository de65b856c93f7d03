"""Which replicas are alive as the gateway sees them, from the tokens they send.

A replica is *stalled* when one of its streams stopped (the gateway's stall timeout mid-stream, or no response
headers within it), or when it produced nothing at all (no token on any stream) for the stall timeout while a
request waited there for its first token, or when it left a readiness probe unanswered for the stall timeout
(:mod:`controlplane.gateway.health_checks`). With continuous batching every running stream gets a token each
step and prefill comes in chunks, so a live replica is never silent that long. A stalled replica is routed
around while another one is left, and the requests waiting there for a first token move at once: they have
sent nothing to their clients yet. Its next token, or a readiness probe it passes, clears it.

Silence is timed on the real clock, like every other upstream timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from controlplane.gateway.errors import UpstreamError

logger = logging.getLogger(__name__)

WATCH_TICKS = 4  # silence checks per stall timeout: a silent replica is found within 1.25 timeouts


@dataclass(slots=True, eq=False)
class _Waiter:
    """A request waiting for its headers or first token on one replica."""

    task: asyncio.Task[Any]
    sent: float  # monotonic
    moved: bool = False  # cancelled because its replica stalled


class Liveness:
    """Tracks silence per replica. Requests waiting for headers or a first token register here; one watchdog
    task (running only while some wait) moves them when their replica has been silent for the stall timeout,
    so that a waiting request costs no task or timer of its own."""

    def __init__(self, stall_timeout_s: float,
                 on_event: Callable[[str, str, str], None] = lambda kind, replica_id, detail: None) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.suspects: set[str] = set()
        self._on_event = on_event  # ("stalled" | "recovered", replica id, why); must not raise
        self._waiting: dict[str, set[_Waiter]] = {}  # replica -> requests waiting for their first token
        self._last_heard: dict[str, float] = {}  # monotonic time of the replica's latest token
        self._watchdog: asyncio.Task[None] | None = None

    def heard(self, replica_id: str) -> None:
        """A token came from ``replica_id``: it is alive."""
        self._last_heard[replica_id] = time.monotonic()
        if self.suspects and replica_id in self.suspects:
            self._recovered(replica_id, "it produced a token")

    def answered(self, replica_id: str) -> None:
        """It passed a readiness probe (a forward pass): it steps again, whether or not it is sent tokens."""
        self._last_heard[replica_id] = time.monotonic()
        if replica_id in self.suspects:
            self._recovered(replica_id, "it passed a readiness probe")

    def silent_since(self, replica_id: str, since: float) -> None:
        """A readiness probe sent at ``since`` (monotonic) got no answer: stalled, unless a token came
        from it since (a busy replica can be slow to answer a probe and still serve)."""
        if self._last_heard.get(replica_id, float("-inf")) < since:
            self.stalled(replica_id, f"it left a readiness probe unanswered for {self.stall_timeout_s:g}s")

    def failed(self, exc: UpstreamError) -> None:
        """An upstream failure: a stall or timeout marks the replica stalled; refusals and resets do not."""
        if exc.is_silence:
            self.stalled(exc.replica_id, str(exc))

    def stalled(self, replica_id: str, why: str) -> None:
        """``replica_id`` went silent: route around it and move the requests waiting there."""
        if replica_id not in self.suspects:
            self.suspects.add(replica_id)
            logger.warning("[%s] stalled (%s): routed around until it serves again", replica_id, why)
            self._on_event("stalled", replica_id, why)
        for waiter in self._waiting.get(replica_id, ()):
            if not waiter.moved:
                waiter.moved = True
                waiter.task.cancel()

    def _recovered(self, replica_id: str, why: str) -> None:
        self.suspects.discard(replica_id)
        logger.warning("[%s] serving again (%s): routed to again", replica_id, why)
        self._on_event("recovered", replica_id, why)

    @contextlib.asynccontextmanager
    async def watching(self, replica_id: str) -> AsyncIterator[None]:
        """Around sending a request to ``replica_id`` and waiting for its headers and first token: when
        the replica is found stalled meanwhile, the block stops with :class:`UpstreamError` ``stall`` (the
        caller tries another replica). Not watched when it is a suspect already: routed there anyway (no
        other replica left), the request waits it out."""
        if replica_id in self.suspects:
            yield
            return
        task = asyncio.current_task()
        assert task is not None
        waiter = _Waiter(task, time.monotonic())
        self._waiting.setdefault(replica_id, set()).add(waiter)
        self._ensure_watchdog()
        try:
            yield
        except asyncio.CancelledError:
            if not waiter.moved or task.uncancel() > 0:  # cancelled by someone else too: stop here
                raise
        finally:
            waiting = self._waiting.get(replica_id)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiting[replica_id]
        if waiter.moved:  # a first token that came with the move does not undo it
            raise UpstreamError(replica_id, "stall", f"the replica produced no token for "
                                                     f"{self.stall_timeout_s:g}s; not waiting there")

    def stop(self) -> None:
        """Cancel the watchdog (the gateway is stopping)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="liveness-watchdog")

    async def _watch(self) -> None:
        """Every quarter of the stall timeout: a replica silent that long, since both its latest token
        and the oldest request waiting there was sent, has stalled. Ends when nobody waits."""
        stall = self.stall_timeout_s
        while self._waiting:
            await asyncio.sleep(stall / WATCH_TICKS)
            now = time.monotonic()
            for rid, waiters in list(self._waiting.items()):
                oldest = min((w.sent for w in waiters if not w.moved), default=None)
                if oldest is not None and now - max(self._last_heard.get(rid, oldest), oldest) >= stall:
                    # silent: this request and every other waiting there move
                    self.stalled(rid, f"no token for {stall:g}s while a request waited there")
