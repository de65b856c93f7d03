"""``GET /api/v1/metrics/experts`` and the client's ``expert_load``: a viewer reads the expert load as typed
records (tokens/s and tokens per replica and expert, the imbalance), narrowed by scope; a dense fleet is a
plain answer with no experts; no telemetry is a 503, a bad scope or window a 400 naming it.

The telemetry is the in-process scraper reading the replica's own metrics collector on a fake clock
(``tests/controlplane/telemetry/test_experts.py``), so the numbers are exact; the client talks to the
in-process API through its transport."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from controlplane.api.errors import install_error_handlers
from controlplane.api.experts import experts_router
from controlplane.api.guards import install
from controlplane.api.spec import document
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.client import ApiError, ControlPlaneClient, ExpertLoad, ReplicaExpertLoad
from controlplane.errors import Unavailable
from controlplane.store.database import Store
from controlplane.telemetry.base import Telemetry
from controlplane.telemetry.scraper import ScraperSource
from tests.controlplane.telemetry.test_experts import (
    EXPECTED_IMBALANCE,
    EXPECTED_RATES,
    EXPERTS,
    Clock,
    scrape,
    scraper_on,
)

from .conftest import Served

URL = "http://controlplane.test"
NAMES = itertools.count()


class Api:
    """The experts route on a bare app (auth and error handling as the factory installs them)."""

    def __init__(self, store: Store, telemetry: Telemetry | None) -> None:
        self.tokens = TokenAuthority(store)

        def source() -> Telemetry:
            if telemetry is None:
                raise Unavailable("telemetry is not running")
            return telemetry

        app = FastAPI()
        install(app, self.tokens, Auditor(store))
        install_error_handlers(app)
        app.include_router(experts_router(source))
        document(app)
        self.http = TestClient(app, base_url=URL)

    def client(self, role: str = "viewer") -> ControlPlaneClient:
        token = self.tokens.issue(f"{role}-{next(NAMES)}", Role(role))

        def forward(request: httpx.Request) -> httpx.Response:
            answer = self.http.request(request.method, str(request.url), headers=request.headers,
                                       content=request.content)
            return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

        return ControlPlaneClient(URL, token, transport=httpx.MockTransport(forward))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "state.db") as s:
        yield s


def scraped(rids: tuple[str, ...]) -> ScraperSource:
    clock = Clock()
    source = scraper_on(rids, clock)
    scrape(source, clock, 15)
    return source


def test_a_viewer_reads_the_expert_load_as_typed_records(store: Store) -> None:
    source = scraped(("r1", "r2", "dense"))
    try:
        with Api(store, source).client("viewer") as api:
            load = api.expert_load()
            zone = api.expert_load(scope="zone:az-a", window_s=10.0)
    finally:
        source.stop()
    assert isinstance(load, ExpertLoad) and load.is_moe and load.experts == EXPERTS
    assert all(isinstance(r, ReplicaExpertLoad) for r in load.replicas)
    for row in load.replicas:
        assert row.tokens_per_s == pytest.approx(EXPECTED_RATES[row.replica])
    assert {r.replica: r.imbalance for r in load.replicas} == pytest.approx(EXPECTED_IMBALANCE, rel=0.01)
    assert (load.scope, load.window_s) == ("fleet", 20.0)
    assert [r.replica for r in zone.replicas] == ["r1"] and (zone.scope, zone.window_s) == ("zone:az-a", 10.0)


def test_a_dense_fleet_is_an_answer_with_no_experts(store: Store) -> None:
    source = scraped(("dense",))
    try:
        with Api(store, source).client() as api:
            load = api.expert_load()
    finally:
        source.stop()
    assert not load.is_moe and load.experts == () and load.replicas == ()


def test_no_telemetry_is_a_503_and_a_bad_query_a_400_naming_it(store: Store) -> None:
    served = Api(store, None)
    with served.client() as api:
        with pytest.raises(ApiError) as down:
            api.expert_load()
        assert down.value.status == 503 and "telemetry is not running" in str(down.value)
    source = scraped(("r1",))
    try:
        with Api(store, source).client() as api:
            with pytest.raises(ApiError) as bad_scope:
                api.expert_load(scope="rack:7")
            with pytest.raises(ApiError) as bad_window:
                api.expert_load(window_s=0)
    finally:
        source.stop()
    assert (bad_scope.value.status, bad_scope.value.param) == (400, "scope")
    assert bad_window.value.status == 400 and "window_s" in str(bad_window.value)


def test_without_a_token_it_is_a_401(store: Store) -> None:
    assert Api(store, None).http.get("/api/v1/metrics/experts").status_code == 401


def test_the_controlplanes_spec_types_the_answer_and_takes_a_viewer(served: Served) -> None:
    spec = served.client.get("/openapi.json").json()
    operation = spec["paths"]["/api/v1/metrics/experts"]["get"]
    assert operation["x-access"] == "viewer"
    schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ExpertLoad"}
    fields = spec["components"]["schemas"]["ExpertLoad"]["properties"]
    assert {"scope", "window_s", "experts", "replicas"} <= set(fields)
    answer = served.client.get("/api/v1/metrics/experts",
                               headers={"authorization": f"Bearer {served.token('viewer')}"})
    assert answer.status_code == 200 and answer.json()["experts"] == []  # its fixed telemetry is dense
