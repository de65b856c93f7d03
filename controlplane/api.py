"""The control plane's REST API (FastAPI; OpenAPI spec at ``/openapi.json``).

Reads need a viewer token, mutations an operator token, token management an admin token. Every mutation
writes an audit record (who, what, when, outcome), also when it is refused or fails. The console, the
CLI and the Chaos Toolkit extension all go through this API (see ``controlplane.client``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from chaos.safety import FaultManager
from controlplane.auth import Auditor, Principal, Role, TokenAuthority, install, require
from controlplane.chaos_api import ChaosRefused, chaos_router
from controlplane.fleet import Fleet, FleetError
from controlplane.store import Store
from controlplane.telemetry import Scope, Telemetry

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ScaleRequest(BaseModel):
    replicas: int = Field(ge=0, le=64, description="desired number of replicas across all zones")


class RolloutRequest(BaseModel):
    model: str = Field(min_length=1, description="'default' or a Hugging Face model folder")


class TokenRequest(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")
    role: str = Field(pattern="^(viewer|operator|admin)$")
    ttl_s: float | None = Field(default=None, gt=0)


@dataclass
class Services:
    """What the API talks to; built by the app factory."""

    fleet: Fleet
    store: Store
    tokens: TokenAuthority
    auditor: Auditor
    telemetry: Telemetry | None = None
    chaos: FaultManager | None = None


def _error(status: int, message: str, *, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": None}},
                        status_code=status)


def create_api(services: Services) -> FastAPI:
    app = FastAPI(title="LLM SRE control plane", version="0.1.0")
    install(app, services.tokens, services.auditor)
    viewer, operator, admin = require(Role.VIEWER), require(Role.OPERATOR), require(Role.ADMIN)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{param}: {first.get('msg')}", type_="invalid_request_error", param=param)

    async def audited(principal: Principal, action: str, target: str, params: dict[str, Any],
                      run: Callable[[], Awaitable[T] | T]) -> T:
        try:
            result = run()
            if isinstance(result, Awaitable):
                result = await result
        except FleetError as exc:
            services.auditor.record(principal, action, target, params, "error", str(exc))
            raise _Refused(409, str(exc)) from exc
        services.auditor.record(principal, action, target, params, "ok")
        return result

    if services.chaos is not None:
        app.include_router(chaos_router(services.chaos, services.fleet, services.auditor))

    @app.exception_handler(ChaosRefused)
    async def _chaos_refused(_: Request, exc: ChaosRefused) -> JSONResponse:
        type_ = "conflict" if exc.status == 409 else "invalid_request_error"
        return _error(exc.status, exc.message, type_=type_)

    @app.exception_handler(_Refused)
    async def _refused(_: Request, exc: _Refused) -> JSONResponse:
        type_ = "conflict" if exc.status == 409 else "invalid_request_error"
        return _error(exc.status, exc.message, type_=type_)

    @app.get("/health", tags=["meta"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/fleet", tags=["fleet"])
    async def fleet_status(_: Principal = Depends(viewer)) -> dict[str, Any]:
        fleet = services.fleet
        rollout = fleet.rollout
        return {
            "desired_replicas": fleet.desired_total, "ready_replicas": fleet.num_ready(),
            "model": fleet.model, "generation": fleet.generation, "zones": fleet.config.zones,
            "rollout": None if rollout is None else {"model": rollout.model, "generation": rollout.generation,
                                                     "surge": rollout.surge},
            "replicas": [_endpoint_json(e) for e in fleet.endpoints()],
        }

    @app.post("/api/v1/fleet/scale", tags=["fleet"])
    async def scale(body: ScaleRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        await audited(who, "fleet.scale", "fleet", body.model_dump(),
                      lambda: services.fleet.scale(body.replicas))
        return {"desired_replicas": body.replicas}

    @app.post("/api/v1/fleet/replicas/{replica_id}/restart", tags=["fleet"])
    async def restart(replica_id: str, who: Principal = Depends(operator)) -> dict[str, Any]:
        await audited(who, "replica.restart", replica_id, {}, lambda: services.fleet.restart(replica_id))
        return {"restarting": replica_id}

    @app.post("/api/v1/fleet/rollout", tags=["fleet"])
    async def rollout(body: RolloutRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        ro = await audited(who, "fleet.rollout", "fleet", body.model_dump(),
                           lambda: services.fleet.start_rollout(body.model))
        return {"model": ro.model, "generation": ro.generation}

    @app.get("/api/v1/events", tags=["observability"])
    async def events(since_id: int = 0, kind: str | None = None, subject: str | None = None,
                     limit: int = Query(200, ge=1, le=5000),
                     _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [asdict(e) for e in services.store.events(since_id=since_id, kind_prefix=kind,
                                                         subject=subject, limit=limit)]

    @app.get("/api/v1/traces/slow", tags=["observability"])
    async def slow_traces(limit: int = Query(50, ge=1, le=1000), replica: str | None = None,
                          zone: str | None = None, _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [asdict(t) for t in services.store.slow_traces(limit=limit, replica=replica, zone=zone)]

    @app.get("/api/v1/metrics/summary", tags=["observability"])
    async def summary(scope: str = "fleet", _: Principal = Depends(viewer)) -> dict[str, Any]:
        if services.telemetry is None:
            raise _Refused(503, "telemetry is not running")
        try:
            parsed = Scope.parse(scope)
        except ValueError as exc:
            raise _Refused(400, f"scope: {exc}") from exc
        return asdict(services.telemetry.summary(parsed))

    @app.get("/api/v1/audit", tags=["security"])
    async def audit(limit: int = Query(200, ge=1, le=5000), actor: str | None = None,
                    _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [asdict(a) for a in services.store.audit(limit=limit, actor=actor)]

    @app.post("/api/v1/tokens", tags=["security"], status_code=201)
    async def issue_token(body: TokenRequest, who: Principal = Depends(admin)) -> dict[str, Any]:
        secret = await audited(who, "token.issue", body.name, {"role": body.role, "ttl_s": body.ttl_s},
                               lambda: services.tokens.issue(body.name, Role(body.role), body.ttl_s))
        return {"name": body.name, "role": body.role, "token": secret}

    return app


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _endpoint_json(e: Any) -> dict[str, Any]:
    return {"replica_id": e.replica_id, "zone": e.zone, "url": e.base_url, "state": e.state.value,
            "model": e.model, "pid": e.pid, "generation": e.generation}
