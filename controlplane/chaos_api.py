"""The chaos endpoints of the REST API: the fault catalogue, inject (or dry run), list, revert, halt-all.

The control plane satisfies the chaos layer's protocols: fleet endpoints become fault targets (with the
replica's admin token, derived and never stored), and the store is the fault ledger. Reads need a viewer
token, everything else an operator token; every mutation is audited.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from chaos.faults.base import FaultError, FaultSpec, FaultUnavailable
from chaos.safety import ActiveFault, FaultManager
from chaos.targets import Selector
from controlplane.auth import Auditor, Principal, Role, require
from controlplane.fleet import Fleet
from controlplane.replicas import ReplicaState


@dataclass(slots=True, frozen=True)
class ChaosTarget:
    """A replica as the chaos layer sees it."""

    replica_id: str
    zone: str
    pid: int | None
    port: int
    admin_url: str
    admin_token: str | None


def fleet_targets(fleet: Fleet) -> list[ChaosTarget]:
    return [ChaosTarget(e.replica_id, e.zone, e.pid, e.port, e.admin_url, fleet.admin_token(e.replica_id))
            for e in fleet.endpoints() if e.state is not ReplicaState.STOPPED]


class InjectRequest(BaseModel):
    kind: str = Field(min_length=1)
    params: dict[str, float | int | str | bool] = Field(default_factory=dict)
    duration_s: float = Field(30.0, gt=0, le=3600)
    selector: str = "COUNT(1)"
    replicas: list[str] = Field(default_factory=list, description="limit targets to these replica ids")
    zones: list[str] = Field(default_factory=list, description="limit targets to these zones")
    seed: int | None = None
    allow_all: bool = False
    dry_run: bool = False


class ChaosRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def chaos_router(manager: FaultManager, fleet: Fleet, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1/chaos", tags=["chaos"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    @router.get("/catalogue")
    async def catalogue(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [asdict(info) for info in manager.catalogue.describe()]

    @router.get("/faults")
    async def active(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [_fault_json(a, manager.now()) for a in manager.active()]

    @router.post("/faults")
    async def inject(body: InjectRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        params = body.model_dump()
        try:
            selector = Selector.parse(body.selector, replica_ids=body.replicas, zones=body.zones,
                                      seed=body.seed)
            spec = FaultSpec(body.kind, body.params, body.duration_s, selector)
            plan = manager.plan(spec, fleet_targets(fleet), allow_all=body.allow_all)
        except (ValueError, KeyError, FaultUnavailable) as exc:
            auditor.record(who, "chaos.inject", body.kind, params, "error", str(exc))
            raise ChaosRefused(400, str(exc).strip("'\"")) from exc
        summary = {"kind": spec.kind, "duration_s": spec.duration_s,
                   "targets": [t.replica_id for t in plan.targets], "reasons": list(plan.reasons),
                   "allowed": plan.allowed}
        if body.dry_run:
            return {"dry_run": True, "plan": summary}
        if not plan.allowed:
            auditor.record(who, "chaos.inject", body.kind, params, "denied", "; ".join(plan.reasons))
            raise ChaosRefused(409, "; ".join(plan.reasons))
        try:
            faults = await manager.inject(spec, fleet_targets(fleet), allow_all=body.allow_all)
        except FaultError as exc:
            auditor.record(who, "chaos.inject", body.kind, params, "denied", str(exc))
            raise ChaosRefused(409, str(exc)) from exc
        failed = [f.error for f in faults if not f.ok]
        auditor.record(who, "chaos.inject", body.kind, params, "error" if failed else "ok", "; ".join(
            str(e) for e in failed))
        return {"dry_run": False, "plan": summary, "faults": [_fault_json(f, manager.now()) for f in faults]}

    @router.delete("/faults/{fault_id}")
    async def revert(fault_id: int, who: Principal = Depends(operator)) -> dict[str, Any]:
        result = await manager.revert(fault_id)
        auditor.record(who, "chaos.revert", str(fault_id), {}, "ok" if result.ok else "error", result.detail)
        return asdict(result)

    @router.post("/halt")
    async def halt(who: Principal = Depends(operator)) -> dict[str, Any]:
        report = await manager.halt_all()
        auditor.record(who, "chaos.halt", "all", {}, "ok" if report.ok else "error",
                       f"{len(report.reverted)} reverted, {len(report.failed)} failed")
        return {"reverted": list(report.reverted), "failed": dict(report.failed),
                "elapsed_s": report.elapsed_s, "halted": manager.is_halted}

    @router.post("/release")
    async def release(who: Principal = Depends(operator)) -> dict[str, Any]:
        manager.release()
        auditor.record(who, "chaos.release", "all", {}, "ok")
        return {"halted": manager.is_halted}

    return router


def _fault_json(fault: ActiveFault, now: float) -> dict[str, Any]:
    return {"id": fault.fault_id, "kind": fault.kind, "target": fault.target_id,
            "remaining_s": round(max(fault.expires_at - now, 0.0), 3), "error": fault.error}
