"""The control plane's batch work yields the CPU: what-if simulations run on threads of lowered priority.

Where it sits: the gateways and the replicas are processes of their own, so nothing the control plane does
blocks their event loops; but on a shared host they still compete with it for CPU time. A what-if
simulation can keep a core busy for seconds to minutes, so it runs on a thread of its own whose nice
value is raised (Linux schedules threads, and ``setpriority`` on a thread id changes only that thread):
the data plane, and the control plane's own loops and API, come first. Raising a nice value needs no
privilege; lowering it back would, so the thread is never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

BATCH_NICE = 10  # as `nice` does by default


def as_batch_work(nice: int = BATCH_NICE) -> None:
    """Lower the calling thread's CPU priority (a no-op where the platform has no per-thread nice)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


async def in_batch_thread(work: Callable[[], T]) -> T:
    """Run ``work`` on a new thread of lowered priority and wait for it without blocking the loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        as_batch_work()
        try:
            result = work()
        except BaseException as exc:  # handed to the awaiting task, raised there
            loop.call_soon_threadsafe(_set_exception, done, exc)
            return
        loop.call_soon_threadsafe(_set_result, done, result)

    threading.Thread(target=run, name="batch-work", daemon=True).start()
    return await done


def _set_result(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[T], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
