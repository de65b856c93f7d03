"""A gateway process's admin listener: metrics, state, link toxics and admission, for the control plane.

Where it sits: each gateway process serves clients on the shared data address (several gateways may share
it) and this app on an address of its own, so that Prometheus scrapes every gateway and the control plane
talks to one gateway at a time. Everything under ``/admin`` needs the gateway's admin token (a bearer
token the control plane derives from its secret and hands over in the environment); ``/metrics`` and
``/health`` are open, as on the replicas.

- ``GET /admin/state``: what it routes over (the replica set's source and version, whether the control
  plane is reachable), what is ejected, in flight per replica, its toxics, its report queues, and the
  requests it refused before routing since it started, by reason (the autoscaler counts the ones refused
  for want of capacity as demand the replicas never saw).
- ``PUT /admin/toxics/{id}`` / ``DELETE /admin/toxics/{id}`` / ``GET /admin/toxics``: link faults
  (:mod:`controlplane.gateway.toxics`), named by the control plane, each with an optional lifetime after
  which the gateway removes it by itself.
- ``PUT /admin/admission``: rate limits and the in-flight limit, changed at run time.
- ``GET /admin/slices?since=T``: each traffic slice's outcomes finished since ``T`` (wall clock), for the
  control plane's canary and slice-experiment analysis (:mod:`controlplane.gateway.slices`).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from controlplane.gateway.handler import Gateway
from controlplane.gateway.toxics import KINDS

MAX_TOXIC_SECONDS = 24 * 3600.0


class ToxicRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replica_id: str = Field(min_length=1, max_length=128)
    kind: str = Field(description=f"one of {', '.join(KINDS)}")
    latency_s: float = Field(0.0, ge=0, le=60)
    jitter_s: float = Field(0.0, ge=0, le=60)
    after_s: float = Field(0.0, ge=0, le=3600)
    duration_s: float | None = Field(None, gt=0, le=MAX_TOXIC_SECONDS,
                                     description="the gateway removes the toxic after this long")
    colour: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,31}$",
                               description="only requests of this traffic colour (none: every request)")


class AdmissionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate_limit_rps: float | None = Field(None, ge=0, le=1e6)
    rate_limit_tokens_per_s: float | None = Field(None, ge=0, le=1e9)
    max_inflight_per_replica: int | None = Field(None, ge=1, le=1_000_000)


def _error(status: int, message: str, *, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": None}},
                        status_code=status)


def create_admin_app(gateway: Gateway, *, name: str, admin_token: str,
                     status: Callable[[], dict[str, Any]]) -> FastAPI:
    """The admin listener's app; ``status`` adds the process's own parts (discovery, reports)."""
    app = FastAPI(title=f"gateway {name} (admin)", docs_url=None, redoc_url=None)
    expected = admin_token.encode()

    def admin(request: Request) -> None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(errors="replace"), expected):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def unauthorized(_: Request, __: _Unauthorized) -> JSONResponse:
        return _error(401, "missing or invalid admin token", type_="authentication_error")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.page(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {**gateway.health(), "gateway": name}

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    @router.get("/state")
    async def state() -> dict[str, Any]:
        now = gateway.clock()
        return {"gateway": name, **gateway.health(), **status(),
                "toxics": [t.to_json(now) for t in gateway.toxics.active()],
                "refused": dict(gateway.metrics.refused)}

    @router.get("/toxics")
    async def toxics() -> list[dict[str, Any]]:
        now = gateway.clock()
        return [t.to_json(now) for t in gateway.toxics.active()]

    @router.put("/toxics/{toxic_id}")
    async def put_toxic(toxic_id: str, body: ToxicRequest) -> JSONResponse:
        toxic = body.model_dump(exclude={"replica_id", "duration_s"})
        try:
            gateway.toxics.add(body.replica_id, toxic, toxic_id=toxic_id, duration_s=body.duration_s)
        except ValueError as exc:
            return _error(400, str(exc), type_="invalid_request_error", param=str(exc).split(":")[0])
        return JSONResponse({"toxic_id": toxic_id, "replica_id": body.replica_id, "kind": body.kind})

    @router.delete("/toxics/{toxic_id}")
    async def delete_toxic(toxic_id: str) -> dict[str, Any]:
        return {"toxic_id": toxic_id, "removed": gateway.toxics.remove(toxic_id)}

    @router.put("/admission")
    async def admission(body: AdmissionRequest) -> dict[str, Any]:
        changes = {k: v for k, v in body.model_dump().items() if v is not None and math.isfinite(v)}
        gateway.set_admission(**changes)
        cfg = gateway.config
        return {"rate_limit_rps": cfg.rate_limit_rps, "rate_limit_tokens_per_s": cfg.rate_limit_tokens_per_s,
                "max_inflight_per_replica": cfg.max_inflight_per_replica}

    @router.get("/slices")
    async def slices(since: float = 0.0) -> dict[str, Any]:
        return {"gateway": name, "plan": gateway.slice_plan().to_json(),
                "outcomes": gateway.ledger.samples.to_json(since)}

    app.include_router(router)
    return app


class _Unauthorized(Exception):
    pass
