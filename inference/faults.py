"""The replica's fault hooks: what ``/admin/faults`` injects and how the engine loop honours it.

Each fault has a kind, its parameters and a duration; it expires by itself even if nobody deletes it.
The engine thread calls :meth:`ReplicaFaults.apply_before_step` before every step (and while idle), which
is where delays, hangs, device failures and KV pressure take effect; error-rate faults are checked by the
server when a request arrives, and a crash ends the process at once.

A token-latency, prefill-delay or error-rate fault may name a ``colour``: then it touches only requests
that carry that colour (the ``x-llmsre-colour`` header, or ``llmsre.colour`` in W3C ``baggage``, which the
gateway sets on the slice of traffic a chaos experiment owns). A coloured delay is served per request, on
that request's stream (before its first token, between its tokens), not by slowing the engine's steps,
so the uncoloured requests batched with it are untouched.
"""

from __future__ import annotations

import enum
import itertools
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

MAX_FAULT_SECONDS = 3600.0
HANG_POLL_SECONDS = 0.05
COLOUR_HEADER = "x-llmsre-colour"
BAGGAGE_COLOUR_KEY = "llmsre.colour"
COLOUR_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
COLOURABLE = frozenset({"token_latency", "prefill_delay", "error_rate"})


def request_colour(headers: Mapping[str, str]) -> str | None:
    """A request's colour: the colour header, else the ``llmsre.colour`` member of W3C baggage."""
    colour = headers.get(COLOUR_HEADER)
    if colour is None:
        for member in headers.get("baggage", "").split(","):
            key, _, value = member.partition("=")
            if key.strip() == BAGGAGE_COLOUR_KEY:
                colour = value.split(";")[0].strip()
                break
    return colour if colour is not None and COLOUR_PATTERN.match(colour) else None


class FaultKind(enum.Enum):
    TOKEN_LATENCY = "token_latency"  # extra seconds per decode step (every token of every request)
    PREFILL_DELAY = "prefill_delay"  # extra seconds before each step that computes a prompt
    ERROR_RATE = "error_rate"  # refuse a share of new requests with status_code
    HANG = "hang"  # accept requests, emit nothing
    DEVICE_FAILURE = "device_failure"  # in-flight requests fail, readiness and liveness go 503
    KV_PRESSURE = "kv_pressure"  # hold back a fraction of the KV blocks
    CRASH = "crash"  # exit at once


@dataclass(slots=True, frozen=True)
class FaultSpec:
    kind: FaultKind
    duration_s: float
    seconds: float = 0.0
    probability: float = 0.0
    status_code: int = 500
    fraction: float = 0.0
    colour: str | None = None  # only requests of this colour (COLOURABLE kinds)

    def __post_init__(self) -> None:
        if self.colour is not None:
            if self.kind.value not in COLOURABLE:
                raise ValueError(f"colour: only {', '.join(sorted(COLOURABLE))} faults take a colour")
            if not COLOUR_PATTERN.match(self.colour):
                raise ValueError(f"colour: 1-32 of a-z, 0-9 and '-', got {self.colour!r}")
        if not 0 < self.duration_s <= MAX_FAULT_SECONDS:
            raise ValueError(f"duration_s: must be in (0, {MAX_FAULT_SECONDS:g}], got {self.duration_s!r}")
        if self.kind in (FaultKind.TOKEN_LATENCY, FaultKind.PREFILL_DELAY) and not 0 < self.seconds <= 60:
            raise ValueError(f"seconds: must be in (0, 60] for {self.kind.value}, got {self.seconds!r}")
        if self.kind is FaultKind.ERROR_RATE:
            if not 0 < self.probability <= 1:
                raise ValueError(f"probability: must be in (0, 1], got {self.probability!r}")
            if self.status_code not in (500, 503):
                raise ValueError(f"status_code: must be 500 or 503, got {self.status_code!r}")
        if self.kind is FaultKind.KV_PRESSURE and not 0 < self.fraction <= 1:
            raise ValueError(f"fraction: must be in (0, 1], got {self.fraction!r}")

    @classmethod
    def from_json(cls, body: Any) -> FaultSpec:
        """Parse a PUT body; unknown kinds, unknown fields and bad values raise ValueError."""
        if not isinstance(body, dict):
            raise ValueError("body: must be a JSON object")
        allowed = {"kind", "duration_s", "seconds", "probability", "status_code", "fraction", "colour"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")
        kinds = [k.value for k in FaultKind]
        if body.get("kind") not in kinds:
            raise ValueError(f"kind: must be one of {', '.join(kinds)}, got {body.get('kind')!r}")
        values = {k: v for k, v in body.items() if k not in ("kind", "colour")}
        colour = body.get("colour")
        if colour is not None and not isinstance(colour, str):
            raise ValueError(f"colour: must be a string, got {colour!r}")
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}: must be a number, got {value!r}")
        if "duration_s" not in values:
            raise ValueError("duration_s: required")
        return cls(kind=FaultKind(body["kind"]), colour=colour, **values)


@dataclass(slots=True)
class ActiveFault:
    fault_id: str
    spec: FaultSpec
    started_at: float  # wall clock, for people
    expires_at: float  # monotonic
    expires_at_wall: float = field(default=0.0)

    def to_json(self, now: float) -> dict[str, Any]:
        s = self.spec
        return {"id": self.fault_id, "kind": s.kind.value, "duration_s": s.duration_s, "seconds": s.seconds,
                "probability": s.probability, "status_code": s.status_code, "fraction": s.fraction,
                "colour": s.colour, "started_at": self.started_at, "expires_at": self.expires_at_wall,
                "remaining_s": round(max(self.expires_at - now, 0.0), 3)}


class ReplicaFaults:
    """Active faults of one replica; safe to use from the event loop and the engine thread."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 crash: Callable[[], None] | None = None) -> None:
        self.clock = clock
        self.rng = rng or random.Random()
        self.crash = crash
        self._faults: dict[str, ActiveFault] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, spec: FaultSpec) -> ActiveFault:
        now, wall = self.clock(), time.time()
        fault = ActiveFault(f"f{next(self._ids)}", spec, wall, now + spec.duration_s, wall + spec.duration_s)
        with self._lock:
            self._faults[fault.fault_id] = fault
        logger.warning("fault injected: %s %s for %.1fs", fault.fault_id, spec.kind.value, spec.duration_s)
        if spec.kind is FaultKind.CRASH and self.crash is not None:
            self.crash()
        return fault

    def remove(self, fault_id: str) -> bool:
        with self._lock:
            found = self._faults.pop(fault_id, None) is not None
        if found:
            logger.warning("fault removed: %s", fault_id)
        return found

    def clear(self) -> int:
        with self._lock:
            n = len(self._faults)
            self._faults.clear()
        if n:
            logger.warning("all %d faults removed", n)
        return n

    def active(self) -> list[ActiveFault]:
        now = self.clock()
        with self._lock:
            for fault_id in [f for f, a in self._faults.items() if a.expires_at <= now]:
                logger.warning("fault expired: %s", fault_id)
                del self._faults[fault_id]
            return list(self._faults.values())

    def of_kind(self, kind: FaultKind) -> list[FaultSpec]:
        return [a.spec for a in self.active() if a.spec.kind is kind]

    def _touching(self, kind: FaultKind, colour: str | None) -> list[FaultSpec]:
        """Faults of ``kind`` that reach a request of ``colour``: the uncoloured ones and its own."""
        return [s for s in self.of_kind(kind) if s.colour is None or s.colour == colour]

    # ---- what the hooks ask --------------------------------------------------------------------
    def token_delay(self) -> float:
        """Engine-wide: the uncoloured token-latency faults (coloured ones are per request)."""
        return sum(s.seconds for s in self.of_kind(FaultKind.TOKEN_LATENCY) if s.colour is None)

    def prefill_delay(self) -> float:
        return sum(s.seconds for s in self.of_kind(FaultKind.PREFILL_DELAY) if s.colour is None)

    def request_delays(self, colour: str | None) -> tuple[float, float]:
        """(before the first token, before each later token) for one request of ``colour``."""
        if colour is None:
            return 0.0, 0.0
        first = sum(s.seconds for s in self.of_kind(FaultKind.PREFILL_DELAY) if s.colour == colour)
        per_token = sum(s.seconds for s in self.of_kind(FaultKind.TOKEN_LATENCY) if s.colour == colour)
        return first + per_token, per_token

    def injected_error(self, colour: str | None = None) -> int | None:
        """The status code to fail a new request of ``colour`` with, or None."""
        for spec in self._touching(FaultKind.ERROR_RATE, colour):
            if self.rng.random() < spec.probability:
                return spec.status_code
        return None

    def is_hung(self) -> bool:
        return bool(self.of_kind(FaultKind.HANG))

    def device_failed(self) -> bool:
        return bool(self.of_kind(FaultKind.DEVICE_FAILURE))

    def kv_pressure(self) -> float:
        return max((s.fraction for s in self.of_kind(FaultKind.KV_PRESSURE)), default=0.0)

    # ---- the engine-thread hook ----------------------------------------------------------------
    def apply_before_step(self, aengine: AsyncEngine) -> None:
        """Make the active faults true for the next step; runs on the engine thread."""
        engine = aengine.engine
        blocks = engine.block_manager
        reserve = int(self.kv_pressure() * blocks.num_blocks)
        if blocks.num_reserved != reserve:
            blocks.reserve(reserve)
        while self.is_hung() and not aengine.is_stopping:
            time.sleep(HANG_POLL_SECONDS)
        if self.device_failed():
            if engine.has_unfinished_requests():
                aengine.fail_in_flight("device failure: the accelerator reported an error (injected fault)")
            return
        if engine.has_unfinished_requests():
            delay = self.token_delay()
            if engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
                delay += self.prefill_delay()
            if delay:
                time.sleep(delay)
