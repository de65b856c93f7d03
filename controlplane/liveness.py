"""Which replicas are alive as the gateway sees them, from the tokens they send.

A replica is *stalled* when one of its streams stopped (the gateway's stall timeout mid-stream, or no
response headers within it), or when it produced nothing at all (no token on any stream) for the stall
timeout while a request waited there for its first token. With continuous batching every running stream
gets a token each step and prefill comes in chunks, so a live replica is never silent that long. A
stalled replica is routed around while another one is left, and the requests waiting there for a first
token move at once: they have sent nothing to their clients yet. Its next token clears it.

Silence is timed on the real clock, like every other upstream timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from .gateway_errors import UpstreamError
from .upstream import Upstream

logger = logging.getLogger(__name__)

STALL_REASONS = ("stall", "timeout")  # a replica that stops producing tokens, not one that refuses
WATCH_TICKS = 4  # silence checks per stall timeout: a silent replica is found within 1.25 timeouts


@dataclass(slots=True, eq=False)
class _Waiter:
    """A request waiting for its first token on one replica."""

    task: asyncio.Task[Any]
    sent: float  # monotonic
    moved: bool = False  # cancelled because its replica stalled


class Liveness:
    """Tracks silence per replica. Requests waiting for a first token register here; one watchdog task
    (running only while some wait) moves them when their replica has been silent for the stall timeout,
    so that a waiting request costs no task or timer of its own."""

    def __init__(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.suspects: set[str] = set()
        self._waiting: dict[str, set[_Waiter]] = {}  # replica -> requests waiting for a first token
        self._last_heard: dict[str, float] = {}  # monotonic time of the replica's latest token
        self._watchdog: asyncio.Task[None] | None = None

    def heard(self, replica_id: str) -> None:
        """A token came from ``replica_id``: it is alive."""
        self._last_heard[replica_id] = time.monotonic()
        if self.suspects:
            self.suspects.discard(replica_id)

    def failed(self, exc: UpstreamError) -> None:
        """An upstream failure: a stall or timeout marks the replica stalled; refusals and resets do not."""
        if exc.reason in STALL_REASONS:
            self.stalled(exc.replica_id)

    def stalled(self, replica_id: str) -> None:
        """``replica_id`` stopped a stream: route around it and move the requests waiting there."""
        if replica_id not in self.suspects:
            logger.warning("[%s] stalled: routed around until it produces a token again", replica_id)
        self.suspects.add(replica_id)
        for waiter in self._waiting.get(replica_id, ()):
            if not waiter.moved:
                waiter.moved = True
                waiter.task.cancel()

    async def first_token(self, upstream: Upstream, timeout: float) -> None:
        """Wait up to ``timeout`` for the stream's first token, unless its replica stalls meanwhile
        (:class:`UpstreamError` ``stall``; the caller tries another replica)."""
        rid = upstream.replica_id
        if rid in self.suspects:  # routed here anyway (no other replica left): wait it out
            await upstream.prime(timeout)
            self.heard(rid)
            return
        task = asyncio.current_task()
        assert task is not None
        waiter = _Waiter(task, time.monotonic())
        self._waiting.setdefault(rid, set()).add(waiter)
        self._ensure_watchdog()
        try:
            await upstream.prime(timeout)
        except asyncio.CancelledError:
            if not waiter.moved or task.uncancel() > 0:  # cancelled by someone else too: stop here
                raise
        finally:
            waiting = self._waiting.get(rid)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiting[rid]
        if not waiter.moved:  # the first token (a stall that came with it does not undo it)
            self.heard(rid)
            return
        raise UpstreamError(rid, "stall", f"the replica produced no token for {self.stall_timeout_s:g}s; "
                                          "not waiting for a first token there")

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
                    self.stalled(rid)  # silent: this request and every other waiting there move
