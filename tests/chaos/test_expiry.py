"""Expiry guards: a paused process is continued at the fault's expiry although the manager that paused it
is gone, and a revert by the manager stops the guard so that nothing is reverted twice behind its back."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from chaos.catalogue import Catalogue
from chaos.expiry import ExpiryGuards, needs_guard
from chaos.faults.base import FaultSpec, RevertToken
from chaos.faults.process import process_faults, process_state
from chaos.safety import FaultManager
from chaos.targets import Selector

from .fakes import FakeTarget, MemoryLedger

STOPPED = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
RUNNING = {psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING, psutil.STATUS_DISK_SLEEP}
PAUSE_S = 2.0


def wait_state(pid: int, wanted: set[str], timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while (state := process_state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.05)
    return state


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _guards_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if "chaos.expiry" in (p.info["cmdline"] or [])
            and p.pid == pid]


def _shown(pid: int, timeout: float = 10.0) -> bool:
    """Whether ``pid`` shows as a guard within ``timeout``. Right after ``Popen`` returns, the new program's
    command line may not be readable yet: the kernel closes the exec-error pipe (which ``Popen`` waits on)
    before it lays out the new program's arguments, so ``/proc/PID/cmdline`` can read empty for a moment
    (a guard seen as missing right after its start, once in a CI run on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not _guards_of(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(_guards_of(pid))


def test_a_pause_outlives_no_manager_its_guard_continues_the_process_on_time(
        child: subprocess.Popen[bytes]) -> None:
    guards = ExpiryGuards()

    async def inject_then_die() -> int:
        manager = FaultManager(Catalogue(process_faults()), MemoryLedger(), guards=guards)
        spec = FaultSpec("pause", {}, PAUSE_S, Selector())
        (fault,) = await manager.inject(spec, [FakeTarget("r0", pid=child.pid)], allow_all=True)
        assert fault.ok, fault.error
        await manager.aclose()  # as if the control plane died: its own timer never fires
        return fault.fault_id or 0

    started = time.monotonic()
    asyncio.run(inject_then_die())
    assert wait_state(child.pid, STOPPED, 5) in STOPPED
    state = wait_state(child.pid, RUNNING, PAUSE_S + 10)
    elapsed = time.monotonic() - started
    assert state in RUNNING, f"still {state} {elapsed:.1f}s after a {PAUSE_S:g}s pause"
    assert elapsed >= PAUSE_S - 0.2  # not before its time either


def test_a_revert_by_the_manager_stops_the_guard(child: subprocess.Popen[bytes]) -> None:
    guards = ExpiryGuards()
    ledger = MemoryLedger()

    async def inject_and_revert() -> int | None:
        manager = FaultManager(Catalogue(process_faults()), ledger, guards=guards)
        (fault,) = await manager.inject(FaultSpec("pause", {}, 60, Selector()),
                                        [FakeTarget("r0", pid=child.pid)], allow_all=True)
        guard = manager._running[fault.fault_id or 0].guard_pid
        assert guard is not None and _shown(guard)
        result = await manager.revert(fault.fault_id or 0)
        assert result.ok
        return guard

    guard = asyncio.run(inject_and_revert())
    assert wait_state(child.pid, RUNNING, 5) in RUNNING
    assert guard is not None
    deadline = time.monotonic() + 5
    while _guards_of(guard) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _guards_of(guard)
    assert '"guard_pid"' in ledger.rows[1].detail or ledger.rows[1].state == "reverted"


def test_faults_that_end_by_themselves_get_no_guard() -> None:
    kinds = {f.kind: f for f in process_faults()}
    pause = RevertToken("pause", "r0", "signal", {"pid": 1, "start_time": 1, "signal": "SIGCONT"})
    kill = RevertToken("kill", "r0", "none", {})
    assert needs_guard(kinds["pause"], pause)
    assert not needs_guard(kinds["kill"], kill)


def home(state_dir: str) -> Callable[[], dict[str, str]]:
    """A guard environment naming ``state_dir`` as its control plane's state folder."""
    return lambda: {"LLMSRE_STATE_DIR": state_dir, "PATH": "/usr/bin:/bin"}


def started_guard(guards: ExpiryGuards, fault_id: int) -> int:
    """A guard for a pause of pid 1 (whose start time never matches: its revert is a no-op), once its
    command line shows it; its pid."""
    token = RevertToken("pause", "r0", "signal", {"pid": 1, "start_time": 0, "signal": "SIGCONT"})
    pid = guards.start(fault_id, token, expires_in_s=60)
    assert pid is not None
    assert _shown(pid)
    return pid


def test_a_guard_carries_the_environment_it_is_given_and_stops_once() -> None:
    """The control plane gives its guards its state folder (a crash drill tells its own orphans from
    another control plane's by it); stop() of a guard that already exited signals nothing."""
    guards = ExpiryGuards(environment=home("/srv/llm-sre"))
    pid = started_guard(guards, 7)
    try:
        assert psutil.Process(pid).environ().get("LLMSRE_STATE_DIR") == "/srv/llm-sre"
    finally:
        guards.stop(pid)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    guards.stop(pid)  # again: nothing left to signal, nothing raised


def test_a_guard_of_an_earlier_run_is_stopped_only_by_its_fault_and_its_state_folder() -> None:
    """A guard pid read from the ledger after a restart is signalled only while that pid still runs the
    guard of that fault for this state folder: not another fault's guard, nor another control plane's."""
    first = ExpiryGuards(environment=home("/srv/a"))
    pid = started_guard(first, 7)
    try:
        restarted, other = ExpiryGuards(environment=home("/srv/a")), ExpiryGuards(environment=home("/srv/b"))
        restarted.stop(pid, 8)  # the ledger's fault 8 had a guard at this pid once: not this one
        other.stop(pid, 7)  # another control plane's fault 7
        restarted.stop(pid)  # no fault named: nothing to match
        time.sleep(0.5)
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        restarted.stop(pid, 7)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        first.stop(pid)
