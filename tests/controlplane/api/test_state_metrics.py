"""The control plane's state page, ``/metrics/state``: fleet size, the autoscaler's loop and last
decision, drills and faults, read from their owners at each scrape (nothing made up before the first
decision), to a viewer token only; the public ``/metrics`` keeps to runtime gauges. The fault count is kept
as the fault manager writes the ledger, so a scrape reads no SQLite on the API's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from chaos.catalogue import Catalogue
from chaos.faults.base import FaultSpec
from chaos.safety import FaultManager, Ledger
from controlplane.api.guards import install
from controlplane.api.process_metrics import STATE_PATH, process_metrics_router
from controlplane.api.state_metrics import ActiveFaultCount, ControlPlaneState, StateSources
from controlplane.auth import Role, TokenAuthority
from controlplane.store.database import FaultRow, Store
from tests.chaos.fakes import FakeClock, RecordingFault, fleet


@dataclass
class Fleet:
    desired_total: int = 3
    ready: int = 2

    def num_ready(self) -> int:
        return self.ready


@dataclass
class Autoscaler:
    ticks: int = 0
    last: dict[str, Any] | None = None
    mode: str = "active"


@dataclass
class Drills:
    running: bool = False

    def is_running(self) -> bool:
        return self.running


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "state.db") as s:
        yield s


def _client(store: Store, sources: StateSources) -> TestClient:
    app = FastAPI()
    install(app, TokenAuthority(store))
    app.include_router(process_metrics_router(ControlPlaneState(sources)))
    return TestClient(app)


@dataclass
class Page:
    store: Store
    fleet: Fleet = field(default_factory=Fleet)
    autoscaler: Autoscaler = field(default_factory=Autoscaler)
    drills: Drills = field(default_factory=Drills)
    faults: int = 0

    def read(self) -> dict[str, float]:
        sources = StateSources(self.fleet, self.autoscaler, self.drills, lambda: self.faults)
        viewer = TokenAuthority(self.store).issue(f"viewer-{id(sources)}", Role.VIEWER)
        answer = _client(self.store, sources).get(STATE_PATH, headers={"authorization": f"Bearer {viewer}"})
        assert answer.status_code == 200, answer.text
        return _values(answer.text)


def _values(text: str) -> dict[str, float]:
    return {_key(s.name, s.labels): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_fresh_control_plane_shows_its_fleet_and_no_decision_yet(store: Store) -> None:
    values = Page(store).read()

    assert values["llmsre_fleet_desired_replicas"] == 3 and values["llmsre_fleet_ready_replicas"] == 2
    assert values["llmsre_autoscaler_ticks_total"] == 0
    assert "llmsre_autoscaler_recommended_replicas" not in values  # no decision: no number
    assert "llmsre_autoscaler_profile_drift_ratio" not in values
    assert "llmsre_autoscaler_engine_on_cpu_ratio" not in values
    assert "llmsre_autoscaler_engine_waiting_core_ratio" not in values
    assert values["llmsre_autoscaler_mode{mode=active}"] == 1
    assert values["llmsre_autoscaler_mode{mode=paused}"] == 0
    assert values["llmsre_drill_running"] == 0 and values["llmsre_faults_active"] == 0
    assert values["llmsre_asyncio_tasks"] >= 1  # the task serving this page


def test_the_page_follows_the_loop_the_drill_and_the_ledger_at_each_scrape(store: Store) -> None:
    page = Page(store)
    page.read()
    page.autoscaler.ticks, page.autoscaler.mode = 7, "observe_only"
    page.autoscaler.last = {"recommendation": 5, "final": 4,
                            "inputs": {"profile_drift": {"ratio": 1.31, "stale": True, "on_cpu": 0.77,
                                                         "waiting_core": 0.09}}}
    page.drills.running, page.faults, page.fleet.ready = True, 2, 3

    values = page.read()

    assert values["llmsre_autoscaler_ticks_total"] == 7
    assert values["llmsre_autoscaler_recommended_replicas"] == 5
    assert values["llmsre_autoscaler_final_replicas"] == 4
    assert values["llmsre_autoscaler_profile_drift_ratio"] == 1.31
    assert values["llmsre_autoscaler_engine_on_cpu_ratio"] == 0.77
    assert values["llmsre_autoscaler_engine_waiting_core_ratio"] == 0.09
    assert values["llmsre_autoscaler_mode{mode=observe_only}"] == 1
    assert values["llmsre_autoscaler_mode{mode=active}"] == 0
    assert values["llmsre_drill_running"] == 1 and values["llmsre_faults_active"] == 2
    assert values["llmsre_fleet_ready_replicas"] == 3


def test_without_an_autoscaler_or_drills_their_series_are_absent(store: Store) -> None:
    viewer = TokenAuthority(store).issue("viewer", Role.VIEWER)

    text = _client(store, StateSources(Fleet())).get(STATE_PATH,
                                                     headers={"authorization": f"Bearer {viewer}"}).text

    assert "llmsre_fleet_desired_replicas 3.0" in text
    assert "autoscaler" not in text and "drill" not in text and "faults" not in text


def test_the_state_needs_a_viewer_token_and_the_public_page_shows_none_of_it(store: Store) -> None:
    client = _client(store, StateSources(Fleet(), Autoscaler(), Drills(running=True), lambda: 2))
    viewer = TokenAuthority(store).issue("viewer", Role.VIEWER)

    assert client.get(STATE_PATH).status_code == 401
    assert client.get(STATE_PATH, headers={"authorization": "Bearer not-a-token"}).status_code == 401
    assert client.get(STATE_PATH, headers={"authorization": f"Bearer {viewer}"}).status_code == 200
    public = client.get("/metrics")
    assert public.status_code == 200
    assert set(_values(public.text)) == {"llmsre_asyncio_tasks"}  # runtime gauges only


def test_the_fault_count_follows_the_ledger_without_reading_it_per_scrape(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.register_fault("record", "r9", {}, {})  # left active by an earlier control plane
    ledger = ActiveFaultCount(store)
    checked: Ledger = ledger  # mypy refuses this line if the count stops fitting the fault manager
    manager = FaultManager(Catalogue([RecordingFault()]), checked, clock=FakeClock())

    async def drill() -> tuple[int, int]:
        [injected] = await manager.inject(FaultSpec("record", duration_s=60), fleet(1))
        during = ledger()
        assert injected.fault_id is not None and (await manager.revert(injected.fault_id)).ok
        return during, ledger()

    counts = asyncio.run(drill())
    reads: list[int] = []
    real_read = store.active_faults

    def counted_read() -> list[FaultRow]:
        reads.append(1)
        return real_read()

    monkeypatch.setattr(store, "active_faults", counted_read)
    viewer = TokenAuthority(store).issue("viewer", Role.VIEWER)
    client = _client(store, StateSources(Fleet(), active_faults=ledger))
    scraped = [_values(client.get(STATE_PATH, headers={"authorization": f"Bearer {viewer}"}).text)
               for _ in range(3)]

    assert counts == (2, 1)  # the leftover stays until something reverts it
    assert [v["llmsre_faults_active"] for v in scraped] == [1, 1, 1]
    assert reads == []  # no scrape read the store's faults


def test_the_count_hands_the_stores_journals_through(store: Store) -> None:
    ledger = ActiveFaultCount(store)

    assert ledger.add_record == store.add_record  # the chaos API finds its experiment journals there


def _key(name: str, labels: dict[str, str]) -> str:
    return name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
