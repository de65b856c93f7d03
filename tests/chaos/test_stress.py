"""Resource stress with the real stress-ng (and the Python burner) next to a real process: the stressor runs
on the target's CPUs and burns CPU and memory there; revert leaves no stressor behind, also when a new
control plane reverts from the ledger alone; a recycled pid is never signalled.

The target is a ``sleep`` process pinned to one CPU: the fault only needs a pid and its affinity, and a
model replica would add a minute of start-up on this 2-core machine without testing anything more.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos.catalogue import Catalogue, default_catalogue
from chaos.faults.base import FaultSpec, RevertToken
from chaos.faults.process import process_start_time
from chaos.faults.stress import StressFault, group_pids, tagged_pids
from chaos.safety import FaultManager
from chaos.targets import Selector
from tests.polling import wait_until

from .fakes import MemoryLedger

pytestmark = pytest.mark.timeout(120)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    replica_id: str
    pid: int | None
    zone: str = "az-a"
    port: int = 0
    admin_url: str = "http://127.0.0.1:1/admin/faults"
    admin_token: str | None = None


@pytest.fixture
def target() -> Iterator[Proc]:
    sleeper = subprocess.Popen(["sleep", "300"])
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(sleeper.pid, {cpu})
    try:
        yield Proc("r1", sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait(10)


def stressor_pids(token: RevertToken) -> list[int]:
    """Every live (not zombie) process of the stressor the token names."""
    pids = set(tagged_pids(str(token.data["tag"])))
    prefix = "stress-ng" if token.data["backend"] == "stress-ng" else "python"
    pids |= set(group_pids(int(token.data["pid"] or 0), since=int(token.data["start_time"] or 0),
                           comm_prefix=prefix))
    return sorted(p for p in pids if _state(p) not in (None, "Z"))


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / CLOCK_TICKS


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def oom_score_adj(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/oom_score_adj").read_text())
    except OSError:
        return None


def spec(duration_s: float = 30, **params: float) -> FaultSpec:
    return FaultSpec("stress", params or {"cpu_workers": 1, "cpu_load": 60}, duration_s,
                     Selector.parse("ALL"))


def test_catalogue_says_which_backend_it_uses() -> None:
    info = default_catalogue().info("stress")
    assert info.available and info.family == "resource" and not info.takes_down
    assert ("stress-ng at" in info.description) == (shutil.which("stress-ng") is not None)
    assert "Python burner" in StressFault(backend="python").describe().description


def test_bad_params_are_refused_with_the_field_named() -> None:
    fault = StressFault()
    with pytest.raises(ValueError, match=r"params\.cpu_load: must be 1\.\.100"):
        fault.validate(spec(cpu_workers=1, cpu_load=150))
    with pytest.raises(ValueError, match="nothing to stress"):
        fault.validate(spec(cpu_workers=0, vm_bytes=0))
    with pytest.raises(ValueError, match=r"params\.vm_bytes: must be a number"):
        fault.validate(FaultSpec("stress", {"vm_bytes": "lots"}, 10))


@pytest.mark.parametrize("backend", ["stress-ng", "python"])
def test_stressor_burns_cpu_and_memory_on_the_targets_cpus_and_revert_leaves_nothing(
        target: Proc, backend: str) -> None:
    if backend == "stress-ng":
        assert shutil.which("stress-ng"), "stress-ng is installed on these machines"
    ledger = MemoryLedger()
    vm_bytes = 48 * 2**20

    async def run() -> RevertToken:
        manager = FaultManager(Catalogue([StressFault(backend=backend)]), ledger)
        # A fleet of one: stressing it impairs all of it, which the blast radius allows only on purpose.
        [active] = await manager.inject(spec(cpu_workers=1, cpu_load=80, vm_bytes=vm_bytes), [target],
                                        allow_all=True)
        assert active.ok and active.token is not None, active.error
        token = active.token
        assert token.data["backend"] == backend
        def loaded() -> list[int]:
            pids = stressor_pids(token)
            return pids if rss_bytes(pids) >= 0.8 * vm_bytes else []

        pids = wait_until(loaded, timeout=20, what="stressor workers running with their memory")
        assert {frozenset(os.sched_getaffinity(p)) for p in pids} == {frozenset(os.sched_getaffinity(
            target.pid or 0))}
        holder = max(pids, key=lambda p: rss_bytes([p]))
        assert oom_score_adj(holder) == 1000  # what holds the memory is the OOM killer's first choice
        before, started = cpu_seconds(pids), time.monotonic()
        await asyncio.sleep(3.0)
        used = (cpu_seconds(stressor_pids(token)) - before) / (time.monotonic() - started)
        # 0.8 of a CPU when the CPU is free; the 2-core test machine is shared, so only "clearly busy"
        assert used > 0.1, f"stressor used {used:.2f} CPU, expected up to 0.8"
        print(f"{backend}: stressor used {used:.2f} CPU (asked 0.8) and {rss_bytes(pids) / 2**20:.0f} MiB "
              f"(asked {vm_bytes / 2**20:.0f}) on CPUs {sorted(os.sched_getaffinity(pids[0]))}")
        result = await manager.revert(active.fault_id or 0)
        assert result.ok, result.detail
        return token

    token = asyncio.run(run())
    assert stressor_pids(token) == []
    wait_until(lambda: not [p for p in tagged_pids(str(token.data["tag"])) if _state(p) is not None]
               and not group_pids(int(token.data["pid"] or 0), since=int(token.data["start_time"] or 0),
                                  comm_prefix="stress-ng" if backend == "stress-ng" else "python"),
               timeout=10, what="stressor processes reaped")
    assert ledger.rows[1].state == "reverted"


def test_new_manager_kills_a_stressor_left_by_a_crashed_one(target: Proc) -> None:
    ledger = MemoryLedger()

    async def crash() -> RevertToken:
        manager = FaultManager(Catalogue([StressFault()]), ledger)
        [active] = await manager.inject(spec(duration_s=300), [target], allow_all=True)
        assert active.token is not None
        await manager.aclose()  # timers gone: the stressor keeps running
        return active.token

    async def restart() -> None:
        manager = FaultManager(Catalogue([StressFault()]), ledger)
        [result] = await manager.revert_leftovers()
        assert result.ok, result.detail

    token = asyncio.run(crash())
    assert stressor_pids(token), "the stressor survived its manager"
    row = ledger.rows[1]
    assert row.revert["data"]["tag"] == token.data["tag"]  # in the ledger before it started
    asyncio.run(restart())
    assert stressor_pids(token) == []
    assert ledger.state(1) == "reverted"


@pytest.mark.parametrize(("command", "backend"), [
    (["sleep", "60"], "stress-ng"),
    # a Python process leading its own session, as a replica or an expiry guard does: its name passes the
    # python burner's group filter, so only the leader's start time tells it from the stressor's group
    ([sys.executable, "-c", "import time; time.sleep(60)"], "python"),
])
def test_revert_never_signals_a_recycled_pid(target: Proc, command: list[str], backend: str) -> None:
    """A token whose pid now belongs to another process (other start time, no tag) leaves it alone."""
    other = subprocess.Popen(command, start_new_session=True)
    try:
        started = process_start_time(other.pid)
        assert started is not None
        token = RevertToken("stress", "r1", "kill_stressor", {
            "tag": "not-a-live-tag", "backend": backend, "pid": other.pid, "start_time": started - 1})
        asyncio.run(StressFault().revert(token))
        assert other.poll() is None and _state(other.pid) in ("S", "R")
    finally:
        other.kill()
        other.wait(10)


def test_stressor_stops_by_itself_when_nobody_reverts(target: Proc) -> None:
    """The second safety net: stress-ng's own --timeout (duration + grace) ends it without a revert."""
    fault = StressFault()
    fault_spec = spec(duration_s=0.5, cpu_workers=1, cpu_load=20)
    fault.prepare(fault_spec, target)
    token = asyncio.run(fault.inject(fault_spec, target))
    assert stressor_pids(token)
    wait_until(lambda: not stressor_pids(token), timeout=20, what="stressor ended by its own timeout")
    asyncio.run(fault.revert(token))  # idempotent: nothing left is success


# ---- limits: relative to the host, across every stress fault, never on the control plane ---------
HOST_CPUS = os.cpu_count() or 1
HOST_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fleet(n: int) -> list[Proc]:
    """Targets for plans only (a plan starts nothing, so no process is needed)."""
    return [Proc(f"r{i}", None) for i in range(1, n + 1)]


def test_one_fault_may_not_ask_more_than_the_hosts_cpus_or_half_its_memory() -> None:
    fault = StressFault()
    too_many = rf"params\.cpu_workers: must be 0\.\.{HOST_CPUS} \(the host's CPUs\)"
    with pytest.raises(ValueError, match=too_many):
        fault.validate(spec(cpu_workers=HOST_CPUS + 1))
    with pytest.raises(ValueError, match=r"params\.vm_bytes: .* \(half the host's memory\)"):
        fault.validate(spec(cpu_workers=0, vm_bytes=int(HOST_MEMORY * 0.6)))
    with pytest.raises(ValueError, match=r"params\.vm_bytes"):
        fault.validate(spec(cpu_workers=0, vm_bytes=64 * 2**30 * 1024))  # what the old fixed cap let through
    fault.validate(spec(cpu_workers=HOST_CPUS, vm_bytes=int(HOST_MEMORY * 0.4)))


def test_memory_is_budgeted_over_every_target_of_a_plan() -> None:
    manager = FaultManager(Catalogue([StressFault()]), MemoryLedger())
    each = int(HOST_MEMORY * 0.3)  # fits one replica; two of them hold 60% of the host
    params = {"cpu_workers": 0, "vm_bytes": each}
    plan = manager.plan(FaultSpec("stress", params, 10, Selector.parse("COUNT(2)")), fleet(4))
    assert not plan.allowed
    assert any("stress budget" in r and "half the host's memory" in r for r in plan.reasons), plan.reasons
    one = manager.plan(FaultSpec("stress", params, 10, Selector.parse("COUNT(1)")), fleet(4))
    assert one.allowed, one.reasons


def test_stress_counts_against_the_blast_radius() -> None:
    manager = FaultManager(Catalogue([StressFault()]), MemoryLedger())
    cpu = {"cpu_workers": 0, "vm_bytes": 2**20}
    every = manager.plan(FaultSpec("stress", cpu, 10, Selector.parse("ALL")), fleet(3))
    assert "blast radius: stress would impair all 3 replicas (pass allow_all=True to mean it)" \
        in every.reasons
    most = manager.plan(FaultSpec("stress", cpu, 10, Selector.parse("COUNT(2)")), fleet(3))
    assert any("2 of 3 replicas down or impaired exceeds" in r for r in most.reasons), most.reasons
    assert manager.plan(FaultSpec("stress", cpu, 10, Selector.parse("COUNT(1)")), fleet(3)).allowed


def test_stacked_stress_faults_share_the_hosts_cpus(target: Proc) -> None:
    """Faults stack: while one stressor runs every CPU's worker, another is refused until it is reverted."""
    ledger = MemoryLedger()

    async def run() -> None:
        manager = FaultManager(Catalogue([StressFault()]), ledger)
        [first] = await manager.inject(spec(cpu_workers=HOST_CPUS, cpu_load=5), [target], allow_all=True)
        assert first.ok, first.error
        try:
            second = manager.plan(spec(cpu_workers=1, cpu_load=5), [target], allow_all=True)
            assert not second.allowed
            assert any(f"exceed the host's {HOST_CPUS} CPUs" in r for r in second.reasons), second.reasons
        finally:
            assert (await manager.revert(first.fault_id or 0)).ok
        assert manager.plan(spec(cpu_workers=1, cpu_load=5), [target], allow_all=True).allowed

    asyncio.run(run())


def test_the_control_planes_own_process_is_never_stressed() -> None:
    ledger = MemoryLedger()

    async def run() -> None:
        manager = FaultManager(Catalogue([StressFault()]), ledger)
        [refused] = await manager.inject(spec(), [Proc("cp", os.getpid())], allow_all=True)
        assert not refused.ok
        assert "the control plane's own process; it is never stressed" in str(refused.error)

    asyncio.run(run())
    assert ledger.rows == {}  # refused before anything was registered or started


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin apart")
def test_stress_stays_off_the_cpus_the_control_plane_is_pinned_to() -> None:
    """A replica that may run anywhere, a control plane pinned to one CPU: the stressor gets the others."""
    ours = os.sched_getaffinity(0)
    mine, *others = sorted(ours)
    sleeper = subprocess.Popen(["sleep", "60"])
    fault = StressFault()
    replica = Proc("r1", sleeper.pid)
    try:
        os.sched_setaffinity(0, {mine})  # this test process plays the control plane
        fault_spec = spec(cpu_workers=1, cpu_load=5)
        fault.prepare(fault_spec, replica)
        token = asyncio.run(fault.inject(fault_spec, replica))
    finally:
        os.sched_setaffinity(0, ours)
    try:
        pids = wait_until(lambda: stressor_pids(token), timeout=10, what="the stressor running")
        assert {frozenset(os.sched_getaffinity(p)) for p in pids} == {frozenset(others)}
        assert token.data["cpus"] == ",".join(map(str, others))
    finally:
        asyncio.run(fault.revert(token))
        sleeper.kill()
        sleeper.wait(10)

