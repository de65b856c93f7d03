"""The ``/api/v1/drills`` router: scenarios, run (or dry run), list, show, compare, export, abort.

Reads need a viewer token, run and abort an operator token, and both are audited. A run request may aim the
drill (``replicas``, ``zones``: checked against the fleet when it starts) and pick its load (``load``:
Poisson at a rate, or an Azure LLM trace replayed; the bare ``rate`` still works). Bad input is a 400 in
the OpenAI error shape whose ``param`` names the field.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from chaos.drills import DrillError
from chaos.scenarios import SCENARIOS
from controlplane.api.errors import field_of
from controlplane.api.guards import require
from controlplane.auth import Auditor, Principal, Role
from controlplane.drills.report import compare, to_markdown
from controlplane.drills.service import KEEP_REPORTS, DrillService
from controlplane.errors import Conflict, NotFound, Refused


class LoadRequest(BaseModel):
    """``{"kind": "rate", "rate": R}`` (Poisson) or ``{"kind": "trace", "trace": "azure" | PATH, "compress":
    X, "token_scale": Y}`` (an Azure LLM trace replayed X times faster from ``trace_start_s``, token counts
    times Y, prompts capped at ``max_input_len`` and outputs at ``max_tokens``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["rate", "trace"]
    rate: float | None = Field(None, gt=0, le=100, description="requests per second (rate)")
    trace: str | None = Field(None, min_length=1, description="'azure' or the path of an Azure LLM trace CSV")
    compress: float | None = Field(None, gt=0, le=10_000, description="trace replay speed-up")
    token_scale: float | None = Field(None, gt=0, le=100, description="multiplies trace token counts")
    trace_start_s: float | None = Field(None, ge=0, description="seconds into the trace")
    max_input_len: int | None = Field(None, ge=1, le=8192, description="cap on trace prompts (tokens)")

    def override(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class RunRequest(BaseModel):
    scenario: str = Field(min_length=1)
    rate: float | None = Field(None, gt=0, le=100, description="requests per second (a rate load)")
    load: LoadRequest | None = Field(None, description="the load profile: rate or trace")
    replicas: list[str] | None = Field(None, description="the replica a single-replica fault hits")
    zones: list[str] | None = Field(None, description="the zone a zone fault takes, or whose busiest "
                                                      "replica a single-replica fault hits")
    duration_s: float | None = Field(None, gt=0, le=600, description="load duration")
    fault_at_s: float | None = Field(None, gt=0, description="t0, seconds into the load")
    max_tokens: int | None = Field(None, ge=1, le=1024)
    capacity_deadline_s: float | None = Field(None, gt=0, le=1800)
    steady_state_timeout_s: float | None = Field(None, gt=0, le=3600, description="wait this long at most "
                                                 "for the steady state (a fleet still starting)")
    targets: dict[str, float] = Field(default_factory=dict, description="target overrides by name")
    dry_run: bool = False

    def overrides(self) -> dict[str, Any]:
        fields = ("rate", "duration_s", "fault_at_s", "max_tokens", "capacity_deadline_s",
                  "steady_state_timeout_s", "replicas", "zones")
        out: dict[str, Any] = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        if self.load is not None:
            out["load"] = self.load.override()
        out.update({f"targets.{k}": v for k, v in self.targets.items()})
        return out


def drills_router(service: DrillService, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1/drills", tags=["drills"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    @router.get("/scenarios")
    async def scenarios(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [s.describe() for s in SCENARIOS.values()]

    @router.post("/run")
    async def run(body: RunRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        params = body.model_dump()
        try:
            if body.dry_run:
                return {"dry_run": True, "plan": service.plan(body.scenario, body.overrides())}
            drill_id = service.start_here(body.scenario, body.overrides())
        except (KeyError, ValueError) as exc:
            message = str(exc).strip("'\"")
            auditor.record(who, "drill.run", body.scenario, params, "error", message)
            raise Refused(message, param=field_of(message)) from exc
        except DrillError as exc:  # DrillBusy: one at a time (409)
            auditor.record(who, "drill.run", body.scenario, params, "denied", str(exc))
            raise
        auditor.record(who, "drill.run", body.scenario, params, "ok", f"drill {drill_id}")
        return {"id": drill_id, "scenario": body.scenario, "status": "running"}

    @router.get("")
    async def listing(limit: int = Query(50, ge=1, le=KEEP_REPORTS),
                      _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return service.list(limit)

    @router.get("/compare")
    async def compared(ids: str = Query(..., description="comma-separated drill ids"),
                       _: Principal = Depends(viewer)) -> dict[str, Any]:
        try:
            wanted = [int(i) for i in ids.split(",") if i.strip()]
        except ValueError as exc:
            raise Refused(f"ids: expected comma-separated integers, got {ids!r}", param="ids") from exc
        if len(wanted) < 2:
            raise Refused("ids: give at least two drill ids", param="ids")
        return compare([_report(service, i) for i in wanted])

    @router.get("/{drill_id:int}")
    async def show(drill_id: int, _: Principal = Depends(viewer)) -> dict[str, Any]:
        return _report(service, drill_id)

    @router.get("/{drill_id:int}/report.md", response_class=PlainTextResponse,
                responses={200: {"content": {"text/markdown": {"schema": {"type": "string"}}}}})
    async def markdown(drill_id: int, _: Principal = Depends(viewer)) -> PlainTextResponse:
        return PlainTextResponse(to_markdown(_report(service, drill_id)), media_type="text/markdown")

    @router.post("/{drill_id:int}/abort")
    async def abort(drill_id: int, who: Principal = Depends(operator)) -> dict[str, Any]:
        report = _report(service, drill_id)
        if not service.abort(drill_id):
            auditor.record(who, "drill.abort", str(drill_id), {}, "denied", "not running")
            raise Conflict(f"drill {drill_id} is not running (status {report.get('status')})",
                           subject=str(drill_id))
        auditor.record(who, "drill.abort", str(drill_id), {}, "ok")
        return {"id": drill_id, "aborting": True}

    @router.put("/{drill_id:int}/report")
    async def external_report(drill_id: int, body: dict[str, Any],
                              who: Principal = Depends(operator)) -> dict[str, Any]:
        """The report (or progress) of a drill whose runner lives outside the control plane (the
        control-plane-crash drill, with the token issued for it); audited once it is final."""
        stored = service.external_report(drill_id, body)
        if stored.get("status") != "running":
            auditor.record(who, "drill.report", str(drill_id), {"status": stored.get("status")}, "ok")
        return {"id": drill_id, "status": stored.get("status")}

    return router


def _report(service: DrillService, drill_id: int) -> dict[str, Any]:
    report = service.get(drill_id)
    if report is None:
        raise NotFound(f"no drill {drill_id}", subject=str(drill_id))
    return report
