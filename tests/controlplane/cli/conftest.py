"""A control plane's API in this process for the CLI tests: a simulated fleet of three ready replicas, the
fault manager with recording fault kinds (and one listed unavailable), the alert engine, the autoscaler
on fixed telemetry, the drill scheduler with a recording starter, and the drill service (its reports
written straight into the store: a real drill needs processes). The CLI reaches it through ``main``'s
``transport`` slot, so nothing listens on a port."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from chaos.catalogue import Catalogue
from chaos.drills import DrillRunner
from chaos.safety import FaultManager
from controlplane.alerts.config import AlertsConfig
from controlplane.alerts.engine import build_engine
from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.autoscale.loop import Autoscaler
from controlplane.drills.service import DrillService
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.replicas import ReplicaEndpoint
from controlplane.schedules.scheduler import DrillScheduler, running
from controlplane.store.database import Store
from tests.chaos.fakes import RecordingFault
from tests.controlplane.autoscale.test_loop import PROFILE, busy_telemetry, config
from tests.controlplane.drills.test_requests import FakePort
from tests.controlplane.fleet.test_reconcile import SimBackend
from tests.controlplane.schedules.test_scheduler import FakeStarter
from tests.in_process import InProcess

URL = "http://controlplane.test"


@dataclass
class Api:
    """The in-process API: its transport for ``main``, a token per role, and the parts tests prepare."""

    transport: httpx.BaseTransport
    tokens: dict[str, str]
    store: Store
    fleet: Fleet
    autoscaler: Autoscaler

    folder: Path

    def argv(self, *command: str, role: str = "operator") -> list[str]:
        """A command line with ``--url`` and ``--token-file`` before the command (a token as an argument
        would be warned about: ``ps`` shows it)."""
        path = self.folder / f"{role}.token"
        if not path.exists():
            path.write_text(self.tokens[role])
            path.chmod(0o600)
        return ["--url", URL, f"--token-file={path}", *command]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with Store(tmp_path / "state.db") as store:
        yield from _api(tmp_path, store)


def _api(tmp_path: Path, store: Store) -> Iterator[Api]:
    async def is_ready(_: ReplicaEndpoint) -> bool:
        return True

    fleet = Fleet(FleetConfig(replicas=3, zones=["az-a", "az-b", "az-c"]), SimBackend(), store,
                  secret=b"s" * 32, ready_probe=is_ready)
    for _ in range(2):  # spawn, then probe: three replicas READY (simulated: no process, no port)
        asyncio.run(fleet.reconcile())
    tokens, auditor = TokenAuthority(store), Auditor(store)
    catalogue = Catalogue([RecordingFault(), RecordingFault(name="kill", takes_down=True)])
    catalogue.register_unavailable("partition", "bcc is not installed", family="network")
    faults = FaultManager(catalogue, store)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_json()))
    autoscaler = Autoscaler(config(replica_profile=str(profile)), fleet, busy_telemetry(), store)
    with running(DrillScheduler(store, FakeStarter(), poll_s=0.05)) as scheduler:
        services = Services(
            fleet, store, tokens, auditor, chaos=faults, autoscaler=autoscaler, schedules=scheduler,
            alerts=build_engine(AlertsConfig(), store=store, auditor=auditor, telemetry=None, fleet=fleet),
            drills=DrillService(DrillRunner(FakePort(), faults), store, tmp_path))
        with TestClient(create_api(services), base_url=URL) as client:
            yield Api(InProcess(client), {role.value: tokens.issue(f"{role.value}-1", role) for role in Role},
                      store, fleet, autoscaler, tmp_path)
