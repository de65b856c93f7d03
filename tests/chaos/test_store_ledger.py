"""The control plane's SQLite store is the ledger chaos needs: a fault left behind by one manager (and one
store connection) is reverted by the next, as after a control-plane crash.

Tests may use both layers; the ``chaos`` package itself never imports ``controlplane``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from chaos.catalogue import Catalogue
from chaos.faults.base import FaultSpec
from chaos.safety import FaultManager, Ledger
from controlplane.store.database import Store

from .fakes import FakeClock, RecordingFault, fleet


def test_fault_left_in_the_store_is_reverted_after_a_restart(tmp_path: Path) -> None:
    fault = RecordingFault()
    path = tmp_path / "cp.db"

    async def first_life() -> None:
        with Store(path) as store:
            ledger: Ledger = store  # the protocol check: mypy refuses this line if Store stops fitting
            manager = FaultManager(Catalogue([fault]), ledger, clock=FakeClock())
            [active] = await manager.inject(FaultSpec("record", duration_s=60), fleet(1))
            assert active.ok
            await manager.aclose()

    async def second_life() -> None:
        with Store(path) as store:
            [row] = store.active_faults()
            assert row.state == "injected" and json.loads(row.detail)["token"]["target"] == "r0"
            results = await FaultManager(Catalogue([fault]), store, clock=FakeClock()).revert_leftovers()
            assert [r.ok for r in results] == [True]
            assert store.active_faults() == []
            assert store.faults()[0].state == "reverted"

    asyncio.run(first_life())
    asyncio.run(second_life())
    assert [t.data["stage"] for t in fault.reverted] == ["injected"]
