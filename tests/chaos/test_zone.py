"""Zone outage through the fault manager, on real processes: every replica of the zone goes down (kill) or
is cut off (eBPF partition), the other zones keep serving, the blast radius still holds, and a partition
left by a crashed control plane is removed by the next one.

The "replicas" are small real HTTP servers (``python -m http.server``) with a pid and a port: the fault only
needs a process to signal and a port to cut, and three inference replicas would cost a minute of start-up
on this 2-core machine without testing anything more of this kind.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from chaos.catalogue import Catalogue, default_catalogue
from chaos.faults.base import FaultSpec, FaultUnavailable
from chaos.faults.network import PortPartition, availability
from chaos.faults.process import process_state
from chaos.faults.zone import ZoneOutageFault
from chaos.safety import BlastRadiusExceeded, FaultManager
from inference.launcher import free_port
from tests.polling import wait_until

from .fakes import MemoryLedger

pytestmark = [pytest.mark.exclusive, pytest.mark.timeout(180)]


@dataclass(frozen=True)
class Server:
    replica_id: str
    zone: str
    pid: int | None
    port: int
    admin_url: str = "http://127.0.0.1:1/admin/faults"
    admin_token: str | None = None


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def alive(pid: int | None) -> bool:
    """Running: not gone and not a zombie waiting to be reaped."""
    return pid is not None and process_state(pid) not in (None, psutil.STATUS_ZOMBIE)


@pytest.fixture
def servers(tmp_path: object) -> Iterator[list[Server]]:
    procs: list[subprocess.Popen[bytes]] = []
    out: list[Server] = []
    for rid, zone in (("az-a-1", "az-a"), ("az-a-2", "az-a"), ("az-b-1", "az-b")):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(tmp_path))
        procs.append(proc)
        out.append(Server(rid, zone, proc.pid, port))
    try:
        wait_until(lambda: all(answers(s.port) for s in out), timeout=30, what="test servers up")
        yield out
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def zone_spec(zone: str, mode: str = "kill", duration_s: float = 60) -> FaultSpec:
    return FaultSpec("zone-outage", {"zone": zone, "mode": mode}, duration_s)


def test_catalogue_lists_zone_outage_with_its_params() -> None:
    info = default_catalogue().info("zone-outage")
    assert info.available and info.takes_down and info.family == "zone"
    assert [p.name for p in info.params] == ["zone", "mode"]


def test_unknown_zone_and_bad_mode_are_refused_with_the_field_named(servers: list[Server]) -> None:
    manager = FaultManager(Catalogue([ZoneOutageFault()]), MemoryLedger())
    with pytest.raises(ValueError, match=r"params\.zone: no replica in zone 'az-x' \(zones: az-a, az-b\)"):
        manager.plan(zone_spec("az-x"), servers)
    with pytest.raises(ValueError, match=r"params\.mode: must be one of kill, partition"):
        manager.plan(zone_spec("az-a", mode="flood"), servers)
    with pytest.raises(ValueError, match=r"params\.zone: required"):
        manager.plan(FaultSpec("zone-outage", {}, 10), servers)


def test_zone_kill_takes_down_every_replica_of_the_zone_and_no_other(servers: list[Server]) -> None:
    ledger = MemoryLedger()

    async def run() -> None:
        manager = FaultManager(Catalogue([ZoneOutageFault()]), ledger, max_fraction_down=1.0)
        plan = manager.plan(zone_spec("az-a"), servers)
        assert [t.replica_id for t in plan.targets] == ["az-a-1", "az-a-2"] and plan.allowed
        faults = await manager.inject(zone_spec("az-a"), servers)
        assert [(f.target_id, f.ok) for f in faults] == [("az-a-1", True), ("az-a-2", True)]
        wait_until(lambda: not alive(servers[0].pid) and not alive(servers[1].pid), timeout=10,
                   what="zone az-a killed")
        assert alive(servers[2].pid) and answers(servers[2].port)
        results = [await manager.revert(f.fault_id) for f in faults if f.fault_id is not None]
        assert all(r.ok for r in results)

    asyncio.run(run())
    assert [r.state for r in ledger.rows.values()] == ["reverted", "reverted"]
    assert {r.revert["data"]["zone"] for r in ledger.rows.values()} == {"az-a"}


def test_zone_holding_every_replica_is_refused_unless_allow_all(servers: list[Server]) -> None:
    single_zone = [Server(s.replica_id, "az-a", s.pid, s.port) for s in servers]
    manager = FaultManager(Catalogue([ZoneOutageFault()]), MemoryLedger(), max_fraction_down=1.0)

    async def run() -> None:
        with pytest.raises(BlastRadiusExceeded, match="would take down all 3 replicas"):
            await manager.inject(zone_spec("az-a"), single_zone)
        assert all(alive(s.pid) for s in servers)  # refused before anything was touched
        assert manager.plan(zone_spec("az-a"), single_zone, allow_all=True).allowed

    asyncio.run(run())
    default = FaultManager(Catalogue([ZoneOutageFault()]), MemoryLedger())  # max_fraction_down 0.5
    assert "exceeds max_fraction_down" in default.plan(zone_spec("az-a"), servers).reasons[0]


@pytest.mark.slow
def test_zone_partition_cuts_the_zone_off_and_a_new_manager_removes_leftovers(servers: list[Server]) -> None:
    ok, reason = availability()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"eBPF network faults must run in CI: {reason}")
        pytest.skip(reason or "unavailable")
    ledger = MemoryLedger()
    zone_ports = {servers[0].port, servers[1].port}
    try:
        async def crash_with_partition_in_place() -> None:
            manager = FaultManager(default_catalogue(), ledger, max_fraction_down=1.0)
            faults = await manager.inject(zone_spec("az-a", mode="partition", duration_s=600), servers)
            assert all(f.ok for f in faults), [f.error for f in faults]
            assert not answers(servers[0].port) and not answers(servers[1].port)
            assert answers(servers[2].port)
            await manager.aclose()  # the control plane dies: timers gone, the filters stay

        async def next_start() -> None:
            manager = FaultManager(default_catalogue(), ledger)
            results = await manager.revert_leftovers()
            assert len(results) == 2 and all(r.ok for r in results)

        asyncio.run(crash_with_partition_in_place())
        ours = {r["port"] for r in PortPartition().active()} & zone_ports
        assert ours == zone_ports
        asyncio.run(next_start())
        assert not {r["port"] for r in PortPartition().active()} & zone_ports
        assert answers(servers[0].port) and answers(servers[1].port)
        assert [r.state for r in ledger.rows.values()] == ["reverted", "reverted"]
    finally:
        for record in PortPartition().active():
            if record["port"] in zone_ports:
                PortPartition().revert(record)


def test_partition_mode_is_refused_with_the_reason_where_ebpf_cannot_run() -> None:
    ok, reason = availability()
    if ok:
        ZoneOutageFault().validate(zone_spec("az-a", mode="partition"))  # accepted where eBPF can run
        assert "partition (eBPF port partition)" in ZoneOutageFault().describe().description
        return
    with pytest.raises(FaultUnavailable, match="partition is unavailable"):
        ZoneOutageFault().validate(zone_spec("az-a", mode="partition"))
    assert f"partition mode {reason}" in ZoneOutageFault().describe().description


def test_zone_replica_without_a_local_process_is_reported_not_faulted(servers: list[Server]) -> None:
    remote = [Server("az-a-1", "az-a", None, servers[0].port), servers[1], servers[2]]
    ledger = MemoryLedger()

    async def run() -> None:
        manager = FaultManager(Catalogue([ZoneOutageFault()]), ledger, max_fraction_down=1.0)
        first, second = await manager.inject(zone_spec("az-a"), remote)
        assert first.error is not None and "no local process" in first.error
        assert second.ok

    asyncio.run(run())
    wait_until(lambda: not alive(servers[1].pid), timeout=10, what="az-a-2 killed")
    assert alive(servers[0].pid) and alive(servers[2].pid)
