"""The whole REST API in this process, every router mounted (the gateways' too), for the access matrix and
the fuzz run: a simulated fleet of three ready replicas, recording fault kinds, the alert engine, the
autoscaler and the metrics routes on fixed telemetry, the drill scheduler with a recording starter, the
drill service with a fake port, and one gateway whose service token the test knows. Nothing listens on a
port; tokens are issued per role on demand (``Served.token``), so a test that revokes one (logout) does not
take it from the next."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from chaos.catalogue import Catalogue
from chaos.drills import DrillRunner
from chaos.safety import FaultManager
from controlplane.alerts.config import AlertsConfig
from controlplane.alerts.engine import build_engine
from controlplane.api.factory import Services, create_api
from controlplane.api.state_metrics import ActiveFaultCount
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.autoscale.loop import Autoscaler
from controlplane.config import ApiConfig
from controlplane.drills.service import DrillService
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.feed import EndpointsFeed
from controlplane.fleet.reconcile import Fleet
from controlplane.replicas import ReplicaEndpoint
from controlplane.rollouts.experiment import SliceExperiments
from controlplane.rollouts.traffic import TrafficSlices
from controlplane.schedules.scheduler import DrillScheduler, running
from controlplane.store.database import Store
from tests.chaos.fakes import RecordingFault
from tests.controlplane.autoscale.test_loop import PROFILE, busy_telemetry, config
from tests.controlplane.drills.test_requests import FakePort
from tests.controlplane.fleet.test_reconcile import SimBackend
from tests.controlplane.schedules.test_scheduler import FakeStarter

URL = "http://controlplane.test"
GATEWAY = "gw-0"
GATEWAY_TOKEN = "gateway-service-token-for-tests"


class FakeGateways:
    """The gateway supervisor as the API sees it: one gateway and its service token."""

    def service_tokens(self) -> dict[str, str]:
        return {GATEWAY: GATEWAY_TOKEN}

    def status(self) -> list[dict[str, Any]]:
        return [{"name": GATEWAY, "state": "ready"}]

    async def set_admission(self, changes: Mapping[str, float | int]) -> dict[str, Any]:
        return {"admission": dict(changes), "applied": [GATEWAY]}


@dataclass
class Served:
    """The in-process API: a client, the app, the store, and tokens per role on demand."""

    client: TestClient
    app: FastAPI
    store: Store
    tokens: TokenAuthority
    _names: Iterator[int] = field(default_factory=itertools.count)

    def token(self, role: str) -> str:
        """A fresh token of ``role`` ("gateway": the gateway's service token)."""
        if role == "gateway":
            return GATEWAY_TOKEN
        return self.tokens.issue(f"{role}-{next(self._names)}", Role(role))


def serve(tmp_path: Path, store: Store, api: ApiConfig) -> Iterator[Served]:
    async def is_ready(_: ReplicaEndpoint) -> bool:
        return True

    fleet = Fleet(FleetConfig(replicas=3, zones=["az-a", "az-b", "az-c"]), SimBackend(), store,
                  secret=b"s" * 32, ready_probe=is_ready)
    for _ in range(2):  # spawn, then probe: three replicas READY (simulated: no process, no port)
        asyncio.run(fleet.reconcile())
    tokens, auditor = TokenAuthority(store), Auditor(store)
    catalogue = Catalogue([RecordingFault(), RecordingFault(name="kill", takes_down=True)])
    ledger = ActiveFaultCount(store)  # as `controlplane up` wires it: /metrics/state counts faults from it
    faults = FaultManager(catalogue, ledger)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_json()))
    telemetry = busy_telemetry()
    autoscaler = Autoscaler(config(replica_profile=str(profile)), fleet, telemetry, store)
    with running(DrillScheduler(store, FakeStarter(), poll_s=0.05)) as scheduler:
        services = Services(
            fleet, store, tokens, auditor, telemetry, chaos=faults, autoscaler=autoscaler,
            schedules=scheduler,
            alerts=build_engine(AlertsConfig(), store=store, auditor=auditor, telemetry=None, fleet=fleet),
            drills=DrillService(DrillRunner(FakePort(), faults), store, tmp_path),
            feed=EndpointsFeed(fleet.endpoints, lambda _: None), gateways=FakeGateways(), api=api,
            active_faults=ledger,
            # slice experiments: the catalogue has no coloured fault kind, so none can start here
            experiments=SliceExperiments(TrafficSlices(store), faults, lambda: [], store))
        app = create_api(services)
        with TestClient(app, base_url=URL, raise_server_exceptions=False) as client:
            yield Served(client, app, store, tokens)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with Store(tmp_path / "state.db") as store:
        yield from serve(tmp_path, store, ApiConfig())
