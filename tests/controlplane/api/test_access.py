"""Who may call what, derived from the API's own OpenAPI spec: every operation declares its guard
(``x-access``), and every operation x {no token, viewer, operator, admin, a gateway's service token} gets
what that guard promises: 401 without a valid token, 403 with too small a role, and for a caller that is
allowed an answer that is neither (2xx, or the 4xx a dummy body earns). A route without a declared guard
fails here, the hidden ones (``include_in_schema=False``) included.

Bodies are the JSON ``[]``: no route takes a list, so an allowed caller gets its 400 without changing
anything, and a refused one shows the guard ran first (401/403, not 400)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.api.gate import route_table
from controlplane.api.guards import ACCESS

from .conftest import Served

CALLERS = ("none", "viewer", "operator", "admin", "gateway")
# access -> the callers it lets in; everyone else gets 401 (no valid token of that kind) or 403
ALLOWED = {
    "public": set(CALLERS),
    "viewer": {"viewer", "operator", "admin"},
    "operator": {"operator", "admin"},
    "admin": {"admin"},
    "gateway": {"gateway"},
    "gateway-or-viewer": {"viewer", "operator", "admin", "gateway"},
}
# a caller that is refused: 401 when its token is not one this guard knows at all, else 403
UNKNOWN_TO = {
    "viewer": {"none", "gateway"}, "operator": {"none", "gateway"}, "admin": {"none", "gateway"},
    "gateway": {"none"}, "gateway-or-viewer": {"none"}, "public": set(),
}
PATH_VALUES = {"integer": "1", "string": "x"}
FASTAPI_DOCS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # FastAPI's own, public


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, item in spec["paths"].items()
            for method, op in item.items() if method in ("get", "put", "post", "delete", "patch")]


def concrete(path: str, op: dict[str, Any]) -> str:
    for param in op.get("parameters", []):
        if param["in"] == "path":
            kind = param.get("schema", {}).get("type", "string")
            path = path.replace("{" + param["name"] + "}", PATH_VALUES.get(kind, "x"))
    return path


def call(served: Served, method: str, path: str, op: dict[str, Any], caller: str) -> int:
    headers = {} if caller == "none" else {"authorization": f"Bearer {served.token(caller)}"}
    body = b"[]" if "requestBody" in op else None
    if body is not None:
        headers["content-type"] = "application/json"
    return served.client.request(method, concrete(path, op), headers=headers, content=body).status_code


def test_every_operation_declares_who_may_call_it(served: Served) -> None:
    spec = served.client.get("/openapi.json").json()
    undeclared = [f"{m} {p}" for m, p, op in operations(spec) if op.get("x-access") not in ACCESS]
    assert undeclared == [], f"operations without a guard (x-access): {undeclared}"
    hidden = [f"{sorted(r.methods)} {r.path}" for r in route_table(served.app.routes)
              if r.guard is None and r.path not in FASTAPI_DOCS]
    assert hidden == [], f"routes without a guard: {hidden}"


def test_each_role_gets_what_the_spec_promises(served: Served) -> None:
    spec = served.client.get("/openapi.json").json()
    wrong: list[str] = []
    for method, path, op in operations(spec):
        access = op["x-access"]
        for caller in CALLERS:
            status = call(served, method, path, op, caller)
            if caller in ALLOWED[access]:
                ok = status < 500 and status not in (401, 403)
                want = "2xx or a 4xx other than 401/403"
            else:
                want_status = 401 if caller in UNKNOWN_TO[access] else 403
                ok, want = status == want_status, str(want_status)
            if not ok:
                wrong.append(f"{method} {path} ({access}) as {caller}: {status}, expected {want}")
    assert wrong == []


def test_the_matrix_covers_every_kind_of_guard(served: Served) -> None:
    spec = served.client.get("/openapi.json").json()
    assert {op["x-access"] for _, _, op in operations(spec)} == set(ACCESS)


@pytest.mark.parametrize(("path", "role"), [
    ("/api/v1/gateway/endpoints", "gateway"), ("/api/v1/gateway/endpoints", "viewer"),
])
def test_the_gateway_feed_takes_a_gateway_or_a_viewer(served: Served, path: str, role: str) -> None:
    answer = served.client.get(path, headers={"authorization": f"Bearer {served.token(role)}"})
    assert answer.status_code == 200 and len(answer.json()["endpoints"]) == 3


def test_only_a_gateway_may_report_and_only_for_itself(served: Served) -> None:
    report = {"gateway": "gw-0", "traces": [], "events": []}
    as_admin = served.client.post("/api/v1/gateway/reports", json=report,
                                  headers={"authorization": f"Bearer {served.token('admin')}"})
    assert as_admin.status_code == 403
    gateway = {"authorization": f"Bearer {served.token('gateway')}"}
    assert served.client.post("/api/v1/gateway/reports", json=report, headers=gateway).status_code == 200
    other = served.client.post("/api/v1/gateway/reports", json={**report, "gateway": "gw-9"}, headers=gateway)
    assert other.status_code == 403


def test_the_control_planes_state_page_takes_a_viewer_and_the_public_page_keeps_to_runtime(
        served: Served) -> None:
    assert served.client.get("/metrics/state").status_code == 401
    viewer = {"authorization": f"Bearer {served.token('viewer')}"}
    as_viewer = served.client.get("/metrics/state", headers=viewer)
    assert as_viewer.status_code == 200
    assert "llmsre_fleet_ready_replicas 3.0" in as_viewer.text
    assert "llmsre_faults_active 0.0" in as_viewer.text
    public = served.client.get("/metrics")
    assert public.status_code == 200 and "llmsre_asyncio_tasks" in public.text
    assert "fleet" not in public.text and "faults" not in public.text and "autoscaler" not in public.text
