"""Process faults on a throwaway child process (``sleep``): stop, continue, and recycled-pid safety."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from chaos.faults.base import FaultError, FaultSpec, RevertToken
from chaos.faults.process import STOPPED, ProcessFault, process_start_time, process_state

from .fakes import FakeTarget

RUNNING = {psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING}


def wait_state(pid: int, wanted: set[str], timeout: float = 5.0) -> str | None:
    deadline = time.monotonic() + timeout
    while (state := process_state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_pause_stops_the_process_and_revert_continues_it(child: subprocess.Popen[bytes]) -> None:
    fault = ProcessFault("pause")
    target = FakeTarget("r0", pid=child.pid)
    token = asyncio.run(fault.inject(FaultSpec("pause"), target))
    assert wait_state(child.pid, set(STOPPED)) in STOPPED
    assert token.data == {"pid": child.pid, "start_time": process_start_time(child.pid), "signal": "SIGCONT"}
    asyncio.run(fault.revert(token))
    asyncio.run(fault.revert(token))  # twice is fine
    assert wait_state(child.pid, RUNNING) in RUNNING


def test_revert_never_signals_a_recycled_pid(child: subprocess.Popen[bytes]) -> None:
    fault = ProcessFault("pause")
    started = process_start_time(child.pid)
    assert started is not None
    child.send_signal(19)  # SIGSTOP by hand: only a SIGCONT from revert would wake it
    wait_state(child.pid, set(STOPPED))
    stale = RevertToken("pause", "r0", "signal", {"pid": child.pid, "start_time": started - 1,
                                                  "signal": "SIGCONT"})
    asyncio.run(fault.revert(stale))  # the pid "belongs to another process now": left alone, success
    time.sleep(0.1)
    assert process_state(child.pid) in STOPPED
    child.send_signal(18)


def test_kill_ends_the_process_and_revert_is_a_no_op(child: subprocess.Popen[bytes]) -> None:
    fault = ProcessFault("kill")
    token = asyncio.run(fault.inject(FaultSpec("kill"), FakeTarget("r0", pid=child.pid)))
    assert child.wait(5) == -9
    assert token.action == "none"
    asyncio.run(fault.revert(token))


def test_revert_of_a_process_that_is_gone_is_success(child: subprocess.Popen[bytes]) -> None:
    token = asyncio.run(ProcessFault("pause").inject(FaultSpec("pause"), FakeTarget("r0", pid=child.pid)))
    child.kill()
    child.wait()
    asyncio.run(ProcessFault("pause").revert(token))


def test_targets_without_a_local_process_are_refused() -> None:
    with pytest.raises(FaultError, match="no local process"):
        ProcessFault("terminate").prepare(FaultSpec("terminate"), FakeTarget("r0", pid=None))


def test_start_time_is_in_clock_ticks_since_boot_as_the_ledgers_tokens_hold_it(
        child: subprocess.Popen[bytes]) -> None:
    """Tokens written before the start time came from psutil hold the kernel's field 22 of
    ``/proc/<pid>/stat``: the value must stay the same for them to match their process."""
    stat = Path(f"/proc/{child.pid}/stat").read_text()
    assert process_start_time(child.pid) == int(stat[stat.rindex(")") + 2:].split()[19])
    child.kill()
    child.wait()
    assert process_start_time(child.pid) is None and process_state(child.pid) is None
