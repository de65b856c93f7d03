"""Process faults on a throwaway child process (``sleep``): stop, continue, and recycled-pid safety."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.faults.base import FaultError, FaultSpec, RevertToken
from chaos.faults.process import ProcessFault, process_start_time, process_state

from .fakes import FakeTarget


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
    assert wait_state(child.pid, {"T", "t"}) in ("T", "t")
    assert token.data == {"pid": child.pid, "start_time": process_start_time(child.pid), "signal": "SIGCONT"}
    asyncio.run(fault.revert(token))
    asyncio.run(fault.revert(token))  # twice is fine
    assert wait_state(child.pid, {"S", "R"}) in ("S", "R")


def test_revert_never_signals_a_recycled_pid(child: subprocess.Popen[bytes]) -> None:
    fault = ProcessFault("pause")
    started = process_start_time(child.pid)
    assert started is not None
    child.send_signal(19)  # SIGSTOP by hand: only a SIGCONT from revert would wake it
    wait_state(child.pid, {"T", "t"})
    stale = RevertToken("pause", "r0", "signal", {"pid": child.pid, "start_time": started - 1,
                                                  "signal": "SIGCONT"})
    asyncio.run(fault.revert(stale))  # the pid "belongs to another process now": left alone, success
    time.sleep(0.1)
    assert process_state(child.pid) in ("T", "t")
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


def test_start_time_is_read_after_a_command_name_with_spaces(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    fields = ["S"] + [str(i) for i in range(4, 22)] + ["777", "0"]
    (tmp_path / "42" / "stat").write_text("42 (we ird) name) " + " ".join(fields))
    assert process_start_time(42, tmp_path) == 777
    assert process_state(42, tmp_path) == "S"
    assert process_start_time(43, tmp_path) is None
