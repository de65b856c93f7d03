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
import contextlib
import logging
import time

from .gateway_errors import UpstreamError
from .upstream import Upstream

logger = logging.getLogger(__name__)

STALL_REASONS = ("stall", "timeout")  # a replica that stops producing tokens, not one that refuses


class Liveness:
    def __init__(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.suspects: set[str] = set()
        self._watch: dict[str, asyncio.Event] = {}  # set when the replica next stalls
        self._last_heard: dict[str, float] = {}  # monotonic time of the replica's latest token

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
        watch = self._watch.pop(replica_id, None)
        if watch is not None:
            watch.set()

    async def first_token(self, upstream: Upstream, timeout: float) -> None:
        """Wait up to ``timeout`` for the stream's first token, unless its replica stalls meanwhile
        (:class:`UpstreamError` ``stall``; the caller tries another replica)."""
        rid, stall = upstream.replica_id, self.stall_timeout_s
        if rid in self.suspects:  # routed here anyway (no other replica left): wait it out
            await upstream.prime(timeout)
            self.heard(rid)
            return
        priming = asyncio.ensure_future(upstream.prime(timeout))
        watching = asyncio.ensure_future(self._event(rid).wait())
        sent = time.monotonic()
        try:
            while not (await asyncio.wait((priming, watching), timeout=stall / 2,
                                          return_when=asyncio.FIRST_COMPLETED))[0]:
                if time.monotonic() - max(self._last_heard.get(rid, sent), sent) >= stall:
                    self.stalled(rid)  # silent: this request and every other waiting there move
        finally:
            watching.cancel()
            if not priming.done():
                priming.cancel()
                with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                    await priming
        if not priming.cancelled():
            priming.result()  # the first token, or its UpstreamError
            self.heard(rid)
            return
        raise UpstreamError(rid, "stall", f"the replica produced no token for {stall:g}s; not waiting for "
                                          "a first token there")

    def _event(self, replica_id: str) -> asyncio.Event:
        event = self._watch.get(replica_id)
        if event is None or event.is_set():
            event = self._watch[replica_id] = asyncio.Event()
        return event
