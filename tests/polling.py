"""Waiting for something observable in behaviour tests: poll with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {value!r})")
        time.sleep(interval)
