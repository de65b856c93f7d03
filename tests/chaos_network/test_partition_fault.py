"""The ``partition`` fault kind through the chaos catalogue and fault manager, against a real replica:
while it is in, the replica's port does not answer; after its duration it reverts by itself."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from chaos.catalogue import default_catalogue
from chaos.faults.base import FaultSpec
from chaos.faults.network import PortPartition, availability
from chaos.safety import FaultManager
from chaos.targets import Selector
from inference.launcher import ReplicaProcess, free_port
from inference.models.default import ensure_default_model

from ..chaos.fakes import MemoryLedger

pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(180)]


@dataclass(frozen=True)
class Replica:
    replica_id: str
    zone: str
    pid: int | None
    port: int
    admin_url: str
    admin_token: str | None = None


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[Replica]:
    ok, reason = availability()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"eBPF network faults must run in CI: {reason}")
        pytest.skip(reason or "unavailable")
    state = tmp_path / "state"
    ensure_default_model(state)
    process = ReplicaProcess(free_port(), replica_id="p1", extra_args=["--num-threads", "1"],
                             env={"LLMSRE_STATE_DIR": str(state)}, log_path=tmp_path / "p1.log").start()
    try:
        process.wait_ready()
        assert process.process is not None
        yield Replica("p1", "az-a", process.process.pid, process.port, f"{process.base_url}/admin/faults")
    finally:
        for record in PortPartition().active():
            PortPartition().revert(record)
        process.stop()


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_partition_cuts_the_replica_off_and_reverts_by_itself(replica: Replica) -> None:
    catalogue = default_catalogue()
    assert catalogue.info("partition").available
    ledger = MemoryLedger()

    async def run() -> None:
        manager = FaultManager(catalogue, ledger)
        spec = FaultSpec("partition", {}, duration_s=3.0, selector=Selector.parse("ALL"))
        [active] = await manager.inject(spec, [replica], allow_all=True)  # the only replica
        assert active.error is None
        assert not answers(replica.port)
        assert [r["port"] for r in PortPartition().active()] == [replica.port]
        await asyncio.sleep(4.0)  # the fault's own timer reverts it
        assert answers(replica.port)
        assert PortPartition().active() == []
        await manager.aclose()

    asyncio.run(run())
    assert ledger.active_faults() == []
