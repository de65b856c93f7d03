"""The typed client: answers become frozen records (unknown keys ignored, numbers as typed, a missing or
mistyped field refused with its path), errors become ApiError with the server's message, type, field and
retry hint, and no answer at all is Unreachable. The transport is a mock: these are the client's own
rules; the CLI tests read every record from the real API."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controlplane.client import (
    ApiError,
    ControlPlaneClient,
    DrillReport,
    FleetView,
    Unreachable,
    as_json,
)
from controlplane.errors import Unavailable

FLEET = {"desired_replicas": 2, "ready_replicas": 1, "model": "default", "generation": 3, "zones": ["az-a"],
         "rollout": {"model": "m2", "generation": 4, "surge": "az-a-3"}, "new_field": "ignored",
         "replicas": [{"replica_id": "az-a-1", "zone": "az-a", "url": "http://127.0.0.1:8101",
                       "state": "ready", "model": "default", "pid": 1234, "generation": 3}]}


def client(answer: Callable[[httpx.Request], httpx.Response]) -> ControlPlaneClient:
    return ControlPlaneClient("http://cp.test", "t", transport=httpx.MockTransport(answer))


def test_an_answer_becomes_a_frozen_record_and_unknown_keys_are_ignored() -> None:
    with client(lambda _: httpx.Response(200, json=FLEET)) as api:
        fleet = api.fleet()
    assert isinstance(fleet, FleetView) and fleet.zones == ("az-a",)
    assert fleet.rollout is not None and (fleet.rollout.model, fleet.rollout.surge) == ("m2", "az-a-3")
    assert [(r.replica_id, r.pid) for r in fleet.replicas] == [("az-a-1", 1234)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fleet.model = "other"  # type: ignore[misc]


@pytest.mark.parametrize(("change", "where"), [
    ({"ready_replicas": "1"}, "FleetView.ready_replicas: expected int, got '1'"),
    ({"replicas": [{**FLEET["replicas"][0], "pid": 1.5}]}, "FleetView.replicas[0].pid"),  # type: ignore[index]
    ({"model": None}, "FleetView.model: expected str, got None"),
])
def test_a_mistyped_answer_is_refused_naming_the_field(change: dict[str, Any], where: str) -> None:
    with client(lambda _: httpx.Response(200, json={**FLEET, **change})) as api, \
            pytest.raises(ApiError) as refused:
        api.fleet()
    assert "unexpected answer from the control plane at http://cp.test" in str(refused.value)
    assert where in str(refused.value)


def test_a_missing_field_is_refused() -> None:
    without = {k: v for k, v in FLEET.items() if k != "generation"}
    with client(lambda _: httpx.Response(200, json=without)) as api, \
            pytest.raises(ApiError, match=r"FleetView\.generation: missing"):
        api.fleet()


def test_a_report_keeps_its_open_parts_as_mappings_and_the_whole_document() -> None:
    report = {"id": 7, "scenario": "replica-crash", "status": "passed", "figures": {"rto_service_s": 0.4,
              "requests_failed": 0}, "checks": [{"name": "max_failed_requests", "target": 0, "measured": 0,
                                                 "ok": True}], "config": {"rate": 2}}
    with client(lambda _: httpx.Response(200, json=report)) as api:
        got = api.drill(7)
    assert isinstance(got, DrillReport) and got.figures == {"rto_service_s": 0.4, "requests_failed": 0}
    assert got.checks[0].target == 0 and isinstance(got.checks[0].target, int)  # a count stays a count
    assert got.document == report  # what `drill show` prints
    assert "document" not in as_json(got) and as_json(got)["checks"][0]["ok"] is True


def test_an_error_carries_the_servers_message_type_field_and_retry_hint() -> None:
    body = {"error": {"message": "telemetry is not running", "type": "service_unavailable", "param": None,
                      "code": None}}
    with client(lambda _: httpx.Response(503, json=body, headers={"Retry-After": "5"})) as api, \
            pytest.raises(ApiError) as failed:
        api.summary()
    error = failed.value
    assert str(error) == "HTTP 503: telemetry is not running"
    assert (error.status, error.error_type, error.retry_after_s) == (503, "service_unavailable", 5.0)
    assert error.request is not None and error.request.url.path == "/api/v1/metrics/summary"
    assert not isinstance(error, Unreachable)

    refused = {"error": {"message": "scope: unknown", "type": "invalid_request_error", "param": "scope",
                         "code": None}}
    with client(lambda _: httpx.Response(400, json=refused)) as api, pytest.raises(ApiError) as bad:
        api.summary("nowhere")
    assert (bad.value.status, bad.value.param) == (400, "scope")


def test_no_answer_is_unreachable_a_kind_of_unavailable() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with client(down) as api, pytest.raises(Unreachable) as unreachable:
        api.fleet()
    assert str(unreachable.value).startswith("cannot reach the control plane at http://cp.test")
    assert unreachable.value.status is None and isinstance(unreachable.value, Unavailable)
