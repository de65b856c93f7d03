"""The control plane's batch work (what-if simulations) runs on threads the data plane preempts at once:
``SCHED_IDLE`` and a raised nice value, on that thread alone (``controlplane.sim.batch``)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from controlplane.sim.batch import BATCH_NICE, as_batch_work, in_batch_thread

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="per-thread SCHED_IDLE is Linux's")


def priority() -> tuple[int, int]:
    tid = threading.get_native_id()
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


def test_batch_work_runs_on_an_idle_thread_and_leaves_the_others_as_they_were() -> None:
    before = priority()
    seen: list[tuple[int, int]] = []

    def work() -> None:
        as_batch_work()
        seen.append(priority())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == [(os.SCHED_IDLE, max(before[1], BATCH_NICE))]
    assert priority() == before  # the calling thread (the event loop's, in the control plane) is untouched


def test_in_batch_thread_runs_the_work_there_and_hands_back_its_result_or_error() -> None:
    async def main() -> tuple[int, int]:
        return await in_batch_thread(priority)

    policy, nice = asyncio.run(main())
    assert policy == os.SCHED_IDLE and nice >= BATCH_NICE

    async def failing() -> None:
        await in_batch_thread(lambda: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        asyncio.run(failing())
