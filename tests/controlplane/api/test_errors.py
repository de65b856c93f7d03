"""The API's one error mapping: each kind of the tree (the control plane's and chaos's) is answered with its
status in the OpenAI error shape, naming the field where the error does; a 503 says when to retry; an error
of no kind is a 500 that keeps its message; a bad request body is a 400 naming the first bad field."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from chaos import errors as chaos_errors
from chaos.drills import DrillBusy, LoadNotFlowing
from chaos.experiment_format import InvalidExperiment
from chaos.safety import BlastRadiusExceeded, Halted
from controlplane import errors
from controlplane.alerts.engine import UnknownRule
from controlplane.api.errors import install_error_handlers
from controlplane.config import ConfigError
from controlplane.fleet.reconcile import FleetConflict, UnknownReplica
from controlplane.schedules.scheduler import InvalidSchedule, ScheduleConflict, UnknownSchedule
from controlplane.store.database import StoreError
from controlplane.telemetry.base import TelemetryError

RAISED: dict[str, Exception] = {
    "refused": errors.Refused("replicas: must be >= 0", param="replicas"),
    "conflict": errors.Conflict("a rollout is already in progress"),
    "not-found": errors.NotFound("no drill 7", subject="7"),
    "forbidden": errors.Forbidden("operators only"),
    "unavailable": errors.Unavailable("prometheus is starting", retry_after_s=2.5),
    "chaos-refused": InvalidExperiment("method[0].provider: unknown module"),
    "chaos-conflict": Halted("halted: new faults are refused until release()"),
    "chaos-unavailable": LoadNotFlowing("the load never reached the gateway"),
    "failed": StoreError("write audit: disk I/O error"),
}


class Body(BaseModel):
    replicas: int = Field(ge=0)


@pytest.fixture
def api() -> Iterator[TestClient]:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/raise/{name}")
    async def raise_(name: str) -> None:
        raise RAISED[name]

    @app.post("/body")
    async def body(_: Body) -> dict[str, str]:
        return {}

    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize(("name", "status", "type_", "param"), [
    ("refused", 400, "invalid_request_error", "replicas"),
    ("conflict", 409, "conflict", None),
    ("not-found", 404, "not_found_error", None),
    ("forbidden", 403, "permission_error", None),
    ("unavailable", 503, "service_unavailable", None),
    ("chaos-refused", 400, "invalid_request_error", None),
    ("chaos-conflict", 409, "conflict", None),
    ("chaos-unavailable", 503, "service_unavailable", None),
    ("failed", 500, "server_error", None),
])
def test_each_kind_has_its_status_in_the_openai_shape(api: TestClient, name: str, status: int, type_: str,
                                                      param: str | None) -> None:
    answer = api.get(f"/raise/{name}")
    assert answer.status_code == status
    assert answer.json() == {"error": {"message": str(RAISED[name]), "type": type_, "param": param,
                                       "code": None}}


def test_a_503_says_when_to_retry_when_the_error_knows(api: TestClient) -> None:
    assert api.get("/raise/unavailable").headers["retry-after"] == "3"  # 2.5 s, rounded up
    assert "retry-after" not in api.get("/raise/chaos-unavailable").headers


def test_a_bad_body_is_a_400_naming_the_field(api: TestClient) -> None:
    answer = api.post("/body", json={"replicas": -1})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "replicas")
    assert error["message"].startswith("replicas: ")


@pytest.mark.parametrize(("error", "kind", "also"), [
    (ConfigError("fleet.replicas: must be int"), errors.Refused, ValueError),
    (InvalidSchedule("cron: expected 5 fields"), errors.Refused, ValueError),
    (UnknownSchedule("no schedule with id 'x'"), errors.NotFound, KeyError),
    (ScheduleConflict("schedule 'nightly' exists"), errors.Conflict, None),
    (UnknownRule("no alert rule named 'x'"), errors.NotFound, None),
    (UnknownReplica("no replica 'az-z-9'"), errors.NotFound, None),
    (FleetConflict("the fleet already runs m"), errors.Conflict, None),
    (TelemetryError("prometheus did not answer"), errors.Unavailable, None),
    (InvalidExperiment("title: required"), chaos_errors.Refused, ValueError),
    (Halted("halted"), chaos_errors.Conflict, None),
    (BlastRadiusExceeded("too many down"), chaos_errors.Conflict, None),
    (DrillBusy("drill 3 is running"), chaos_errors.Conflict, None),
])
def test_module_errors_are_kinds_of_the_tree_and_keep_the_bases_callers_catch(
        error: Exception, kind: type[Exception], also: type[Exception] | None) -> None:
    assert isinstance(error, kind)
    root = chaos_errors.ChaosError if issubclass(kind, chaos_errors.ChaosError) else errors.ControlPlaneError
    assert isinstance(error, root)
    if also is not None:
        assert isinstance(error, also)
    assert str(error) == error.args[0]  # the message as given, also for a KeyError
