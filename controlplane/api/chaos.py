"""The chaos endpoints of the REST API: the fault catalogue, inject (or dry run), list, revert, halt-all,
and experiments (Chaos Toolkit format, run natively here; journals in the store's "experiments" records).

The control plane satisfies the chaos layer's protocols: fleet endpoints become fault targets (with the
replica's admin token, derived and never stored), and the store is the fault ledger. Reads need a viewer
token, everything else an operator token; every mutation is audited.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from chaos import ctk
from chaos.egress import HostAllowList, host_entry, loopback_entries
from chaos.experiment import (
    ExperimentRunner,
    InvalidExperiment,
    check_python_modules,
    redact,
    resolve_secrets,
    resolve_values,
    validate_experiment,
)
from chaos.faults.base import FaultError, FaultSpec
from chaos.safety import (
    ActiveFault,
    FaultManager,
    StopCondition,
    error_rate_above,
    p99_ttft_above,
    ready_replicas_below,
)
from chaos.targets import Selector
from controlplane.api.guards import bearer_token, require
from controlplane.auth import Auditor, Principal, Role
from controlplane.drills.port import fleet_targets
from controlplane.errors import Conflict, NotFound, Refused
from controlplane.fleet.reconcile import Fleet


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


EXPERIMENTS = "experiments"  # store collection of experiment journals
EXPERIMENT_MODULES = ("chaos.ctk",)  # python providers a request may run in this process
KEEP_JOURNALS = 500

logger = logging.getLogger(__name__)


class ExperimentRequest(BaseModel):
    experiment: dict[str, Any] = Field(description="a Chaos Toolkit-format experiment (chaos.ctk activities)")
    dry_run: bool = False
    rollback_strategy: Literal["always", "never", "deviated", "default"] = "always"
    max_error_rate: float | None = Field(None, ge=0, le=1, description="stop condition (share 0..1)")
    max_p99_ttft_s: float | None = Field(None, gt=0, description="stop condition (seconds)")
    min_ready: int | None = Field(None, ge=1, description="stop condition: ready replicas floor")
    check_interval_s: float = Field(1.0, gt=0, le=60)


def chaos_router(manager: FaultManager, fleet: Fleet, auditor: Auditor, *,
                 experiment_hosts: Sequence[str] = ()) -> APIRouter:
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
        except (ValueError, KeyError) as exc:
            auditor.record(who, "chaos.inject", body.kind, params, "error", str(exc))
            raise Refused(str(exc).strip("'\"")) from exc
        except FaultError as exc:  # FaultUnavailable: a kind that cannot run here (400)
            auditor.record(who, "chaos.inject", body.kind, params, "error", str(exc))
            raise
        summary = {"kind": spec.kind, "duration_s": spec.duration_s,
                   "targets": [t.replica_id for t in plan.targets], "reasons": list(plan.reasons),
                   "allowed": plan.allowed}
        if body.dry_run:
            return {"dry_run": True, "plan": summary}
        if not plan.allowed:
            auditor.record(who, "chaos.inject", body.kind, params, "denied", "; ".join(plan.reasons))
            raise Conflict("; ".join(plan.reasons))
        try:
            faults = await manager.inject(spec, fleet_targets(fleet), allow_all=body.allow_all)
        except FaultError as exc:  # Halted, BlastRadiusExceeded: conflicts (409)
            auditor.record(who, "chaos.inject", body.kind, params, "denied", str(exc))
            raise
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

    if hasattr(manager.ledger, "add_record"):  # the store: journals live next to the fault ledger
        _experiment_routes(router, manager, fleet, auditor, manager.ledger, tuple(experiment_hosts))
    return router


def _experiment_routes(router: APIRouter, manager: FaultManager, fleet: Fleet, auditor: Auditor,
                       store: Any, experiment_hosts: tuple[str, ...]) -> None:
    """POST /experiments runs one natively in this process (its chaos.ctk activities call this API back
    with the caller's own token); journals are store records of collection "experiments"."""
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)
    running: set[asyncio.Task[None]] = set()
    for left in store.records(EXPERIMENTS, limit=KEEP_JOURNALS):  # a run the last control plane died in
        if left.body.get("status") == "running":
            store.update_record(left.id, {**left.body, "status": "interrupted",
                                          "error": "the control plane stopped during the run"})

    @router.post("/experiments", status_code=202)
    async def run_experiment(body: ExperimentRequest, request: Request,
                             who: Principal = Depends(operator)) -> dict[str, Any]:
        title = str(body.experiment.get("title", ""))[:200]
        params = {"title": title, "dry_run": body.dry_run, "min_ready": body.min_ready,
                  "max_error_rate": body.max_error_rate, "max_p99_ttft_s": body.max_p99_ttft_s}
        own = {ctk.URL_KEY: _own_url(request)}
        experiment = {**body.experiment, "configuration": {**(body.experiment.get("configuration") or {}),
                                                           **own}}
        try:
            check_python_modules(experiment, EXPERIMENT_MODULES)
            validate_experiment(experiment)
            resolve_values(experiment.get("configuration"), "configuration", allow_env=False)
            resolve_secrets(experiment.get("secrets"), allow_env=False)
        except InvalidExperiment as exc:
            auditor.record(who, "chaos.experiment", title, params, "error", str(exc))
            raise
        secrets = {ctk.TOKEN_KEY: bearer_token(request)}
        runner = ExperimentRunner(revert_faults=_reverter(manager), base_configuration=own,
                                  base_secrets=secrets, allow_env=False,
                                  egress=_egress(request, fleet, experiment_hosts))
        conditions = _stop_conditions(body, fleet, own, secrets)
        record = store.add_record(EXPERIMENTS, {"title": title, "status": "running", "by": who.name,
                                                "dry": body.dry_run}, key=title)

        async def run() -> dict[str, Any]:
            try:
                journal = await runner.run(experiment, dry_run=body.dry_run, stop_conditions=conditions,
                                           check_interval_s=body.check_interval_s,
                                           rollback_strategy=body.rollback_strategy)
            except InvalidExperiment as exc:  # e.g. an environment lookup in its configuration
                journal = {"title": title, "status": "failed", "error": str(exc)}
            except Exception as exc:
                error = redact(f"{type(exc).__name__}: {exc}", [v for v in secrets.values() if v])
                logger.error("experiment %d (%s) crashed: %s", record.id, title, error)
                journal = {"title": title, "status": "failed", "error": error}
            journal = {**journal, "id": record.id, "title": title, "by": who.name}
            store.update_record(record.id, journal)
            store.trim_records(EXPERIMENTS, KEEP_JOURNALS)
            return journal

        auditor.record(who, "chaos.experiment", title, params, "ok", f"experiment {record.id}")
        if body.dry_run:
            return {"id": record.id, "status": "completed", "journal": await run()}
        task = asyncio.create_task(_discard(run()), name=f"experiment-{record.id}")
        running.add(task)
        task.add_done_callback(running.discard)
        return {"id": record.id, "status": "running"}

    @router.get("/experiments")
    async def experiments(limit: int = Query(50, ge=1, le=KEEP_JOURNALS),
                          _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        keys = ("title", "status", "deviated", "dry", "start", "end", "duration", "by", "stop_condition",
                "fault_ids")
        return [{"id": r.id, **{k: r.body.get(k) for k in keys}} for r in store.records(EXPERIMENTS,
                                                                                        limit=limit)]

    @router.get("/experiments/{experiment_id}")
    async def journal(experiment_id: int, _: Principal = Depends(viewer)) -> dict[str, Any]:
        record = store.record(experiment_id, EXPERIMENTS)
        if record is None:
            raise NotFound(f"experiment {experiment_id}: not found", subject=str(experiment_id))
        return {"id": record.id, **record.body}


def _own_address(request: Request) -> tuple[str, int]:
    """This API's address as the connection reached it (the server's socket, never the ``Host`` header,
    which the caller writes: it would point the caller's token and the allow-list anywhere)."""
    server = request.scope.get("server")
    if server and server[1] is not None:
        return str(server[0]), int(server[1])
    return "127.0.0.1", request.url.port or (443 if request.url.scheme == "https" else 80)


def _own_url(request: Request) -> str:
    host, port = _own_address(request)
    return f"{request.url.scheme}://{host_entry(host, port)}"


def _egress(request: Request, fleet: Fleet, configured: Sequence[str]) -> HostAllowList:
    """Where an experiment's http providers may go: this API, the control plane's other listeners and its
    replicas (on loopback, as the fleet knows them now), and the configured hosts."""
    host, port = _own_address(request)
    own = [*loopback_entries({port, *fleet.reserved_ports}), host_entry(host, port), *configured]

    def replicas() -> list[str]:
        endpoints = fleet.endpoints()
        ports = [e.port for e in endpoints]
        return [*loopback_entries(ports), *(host_entry(e.host, e.port) for e in endpoints)]

    return HostAllowList(own, replicas)


async def _discard(work: Any) -> None:
    await work


def _reverter(manager: FaultManager) -> Any:
    async def revert(ids: Sequence[int]) -> list[Any]:
        return list(await asyncio.gather(*(manager.revert(i) for i in ids)))

    return revert


def _stop_conditions(body: ExperimentRequest, fleet: Fleet, configuration: dict[str, Any],
                     secrets: dict[str, Any]) -> list[StopCondition]:
    conditions = []
    if body.max_error_rate is not None:
        conditions.append(error_rate_above(
            lambda: asyncio.to_thread(ctk.error_rate, "fleet", configuration, secrets), body.max_error_rate))
    if body.max_p99_ttft_s is not None:
        conditions.append(p99_ttft_above(
            lambda: asyncio.to_thread(ctk.p99_ttft, "fleet", configuration, secrets), body.max_p99_ttft_s))
    if body.min_ready is not None:
        conditions.append(ready_replicas_below(fleet.num_ready, body.min_ready))
    return conditions


def _fault_json(fault: ActiveFault, now: float) -> dict[str, Any]:
    return {"id": fault.fault_id, "kind": fault.kind, "target": fault.target_id,
            "remaining_s": round(max(fault.expires_at - now, 0.0), 3), "error": fault.error}
