"""Toxics on the gateway's links to replicas (the gateway side of ``chaos.faults.link``).

``latency``: a request waits ``latency_s`` (plus up to ``jitter_s``) before it goes to the replica; a
link with constant delay shifts every chunk of a stream alike, so only the time to first token grows.
``refuse``: new upstream connections to the replica fail at once (a retryable connect failure, which
also counts towards ejection). ``reset``: streams to the replica are cut ``after_s`` after they started
or after the toxic was added, whichever is later; the gateway resumes them elsewhere.

A toxic may carry a lifetime (``duration_s``): it then ends by itself in the gateway, so a link fault
expires on time even while the control plane that injected it is down. A toxic may name a ``colour``:
then only requests of that traffic slice (:mod:`controlplane.gateway.slices`) feel it. The control plane
names each toxic (the same id on every gateway), which makes adding and removing idempotent.

With no toxic in place the gateway pays one truth test per request and per chunk.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from inference.faults import COLOUR_PATTERN

KINDS = ("latency", "refuse", "reset")


@dataclass(slots=True, frozen=True)
class Toxic:
    toxic_id: str
    replica_id: str
    kind: str
    added_at: float
    latency_s: float = 0.0
    jitter_s: float = 0.0
    after_s: float = 0.0
    expires_at: float | None = None  # the gateway's clock; None: until removed
    colour: str | None = None  # only requests of this colour; None: every request

    def to_json(self, now: float) -> dict[str, str | float | None]:
        left = None if self.expires_at is None else round(max(self.expires_at - now, 0.0), 3)
        return {"toxic_id": self.toxic_id, "replica_id": self.replica_id, "kind": self.kind,
                "latency_s": self.latency_s, "jitter_s": self.jitter_s, "after_s": self.after_s,
                "expires_in_s": left, "colour": self.colour}

    def touches(self, colour: str | None) -> bool:
        return self.colour is None or self.colour == colour


class LinkToxics:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> None:
        self._clock = clock
        self._random = random.Random(seed)
        self._ids = itertools.count(1)
        self._toxics: dict[str, Toxic] = {}

    def __bool__(self) -> bool:
        if not self._toxics:  # the common case, once per request and per chunk: no clock read
            return False
        self._expire()
        return bool(self._toxics)

    def add(self, replica_id: str, toxic: Mapping[str, str | int | float | bool | None], *,
            toxic_id: str | None = None, duration_s: float | None = None) -> str:
        """Add a toxic (``ValueError`` for a bad one); the same ``toxic_id`` again replaces it."""
        kind = toxic.get("kind")
        if kind not in KINDS:
            raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
        values = {name: float(v) for name in ("latency_s", "jitter_s", "after_s")
                  if isinstance(v := toxic.get(name, 0.0), (int, float)) and not isinstance(v, bool)}
        if any(not math.isfinite(v) or v < 0 for v in values.values()):
            raise ValueError("latency_s, jitter_s and after_s must be finite and >= 0")
        if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s: must be > 0, got {duration_s}")
        colour = toxic.get("colour")
        if colour is not None and not (isinstance(colour, str) and COLOUR_PATTERN.match(colour)):
            raise ValueError(f"colour: 1-32 of a-z, 0-9 and '-', got {colour!r}")
        toxic_id = toxic_id or f"toxic-{next(self._ids)}"
        now = self._clock()
        expires_at = None if duration_s is None else now + duration_s
        self._toxics[toxic_id] = Toxic(toxic_id, replica_id, str(kind), now, **values, expires_at=expires_at,
                                       colour=colour)
        return toxic_id

    def remove(self, toxic_id: str) -> bool:
        return self._toxics.pop(toxic_id, None) is not None

    def active(self, replica_id: str | None = None) -> list[Toxic]:
        self._expire()
        return [t for t in self._toxics.values() if replica_id is None or t.replica_id == replica_id]

    def _expire(self) -> bool:
        """Drop toxics whose lifetime is over; True when any was dropped."""
        now = self._clock()
        over = [i for i, t in self._toxics.items() if t.expires_at is not None and now >= t.expires_at]
        for toxic_id in over:
            del self._toxics[toxic_id]
        return bool(over)

    def request_delay(self, replica_id: str, colour: str | None = None) -> float:
        """Seconds a request of ``colour`` to ``replica_id`` waits before it is sent."""
        return sum(t.latency_s + self._random.uniform(0, t.jitter_s)
                   for t in self.active(replica_id) if t.kind == "latency" and t.touches(colour))

    def refuses(self, replica_id: str, colour: str | None = None) -> bool:
        return any(t.kind == "refuse" and t.touches(colour) for t in self.active(replica_id))

    def reset_due(self, replica_id: str, stream_started: float, colour: str | None = None) -> bool:
        """Whether a stream of ``colour`` to ``replica_id`` opened at ``stream_started`` must be cut now."""
        now = self._clock()
        return any(t.kind == "reset" and t.touches(colour)
                   and now >= max(t.added_at, stream_started) + t.after_s for t in self.active(replica_id))


class LocalLinks:
    """The chaos layer's ``LinkControl`` for a gateway in this process (tests, the benchmark)."""

    def __init__(self, toxics: LinkToxics) -> None:
        self.toxics = toxics

    async def add(self, replica_id: str, toxic: Mapping[str, str | int | float | bool | None], *,
                  duration_s: float | None = None) -> str:
        return self.toxics.add(replica_id, toxic, duration_s=duration_s)

    async def remove(self, toxic_id: str) -> bool:
        return self.toxics.remove(toxic_id)
