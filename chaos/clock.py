"""The clock the chaos layer runs on: fault expiry, stop-condition checks and experiment pauses.

A :class:`Clock` gives the time and sleeps; :class:`MonotonicClock` is the real one. Tests plug in a fake
clock (see ``tests/chaos/fakes.py``) so a fault's ten-minute duration or a check interval takes no time.
:mod:`chaos.safety` and :mod:`chaos.stop_conditions` both take one; ``chaos.safety`` re-exports both names.
Drills (:mod:`chaos.drills`) run on a :class:`WallClock`: their times are POSIX seconds, compared with the
load client's per-request timestamps and the fleet's samples.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class WallClock:
    """POSIX seconds (``time.time()``): the clock to compare with timestamps written by other processes."""

    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
