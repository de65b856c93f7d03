"""The gateways' side of the REST API: the replica set they watch, the reports they send, and their state.

- ``GET /api/v1/gateway/endpoints?epoch=&after=&wait_s=``: a long poll on the fleet's endpoints
  (:class:`~controlplane.fleet.feed.EndpointsFeed`), answered as soon as the replica set is newer than
  the one the caller holds, else after ``wait_s`` (at most 30 s) with fresh loads. A gateway's service token
  or a viewer token.
- ``POST /api/v1/gateway/reports``: a batch of traces and events from one gateway (its service token
  only). Traces go to the store as the in-process gateway's did; events become ``gateway.<kind>`` events;
  entries the gateway had to drop are recorded as a ``gateway.reports_dropped`` event. Not audited: it is
  the data plane's telemetry, not an operator's mutation.
- ``PUT /api/v1/gateway/admission``: rate limits and the in-flight limit of every gateway, through each
  gateway's admin API, kept in the store for gateways that start later (operator, audited).
- ``GET /api/v1/gateways``: each gateway process with its state (viewer).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.guards import AuthError, bearer_token, guard, require
from controlplane.auth import Auditor, Principal, Role
from controlplane.errors import Refused
from controlplane.fleet.feed import MAX_WAIT_S, EndpointsFeed
from controlplane.gateway.admin import AdmissionRequest
from controlplane.store.database import Store
from controlplane.traces import TraceRecord

logger = logging.getLogger(__name__)

MAX_BATCH = 5_000  # entries of one kind per report (a gateway sends at most 1,000)


class Gateways(Protocol):
    def service_tokens(self) -> dict[str, str]: ...

    def status(self) -> list[dict[str, Any]]: ...

    async def set_admission(self, changes: Mapping[str, float | int]) -> dict[str, Any]: ...


class ReportEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = Field(min_length=1, max_length=64, pattern=r"^[a-z_]+$")
    replica_id: str = Field(max_length=128)
    detail: str = Field(max_length=4_000)
    at: float


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gateway: str = Field(min_length=1, max_length=64)
    traces: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_BATCH)
    events: list[ReportEvent] = Field(default_factory=list, max_length=MAX_BATCH)
    dropped: dict[str, int] = Field(default_factory=dict)


def gateway_principal(gateways: Gateways) -> Callable[[Request], Principal | None]:
    """The calling gateway (``gateway:<name>``) when the bearer token is one of theirs, else None."""
    def dependency(request: Request) -> Principal | None:
        token = bearer_token(request)
        if token is None:
            return None
        given = token.encode(errors="replace")
        for name, expected in gateways.service_tokens().items():
            if hmac.compare_digest(given, expected.encode()):
                return Principal(f"gateway:{name}", Role.VIEWER)
        return None

    return dependency


def gateways_router(feed: EndpointsFeed, gateways: Gateways, store: Store, auditor: Auditor) -> APIRouter:
    router = APIRouter(tags=["gateways"])
    as_gateway = gateway_principal(gateways)
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    @guard("gateway-or-viewer")
    def gateway_or_viewer(request: Request) -> Principal:
        gateway = as_gateway(request)
        return gateway if gateway is not None else viewer(request)

    @guard("gateway")
    def gateway_only(request: Request) -> Principal:
        gateway = as_gateway(request)
        if gateway is not None:
            return gateway
        if bearer_token(request) is None:
            raise AuthError(401, "missing bearer token", type_="invalid_request_error", code="invalid_token",
                            headers={"WWW-Authenticate": "Bearer"})
        raise AuthError(403, "only a gateway may send reports", type_="permission_error",
                        code="insufficient_role")

    @router.get("/api/v1/gateway/endpoints")
    async def endpoints(epoch: str | None = Query(None, max_length=64),
                        after: int = Query(0, ge=0, le=2**62),
                        wait_s: float = Query(0.0, ge=0, le=MAX_WAIT_S),
                        _: Principal = Depends(gateway_or_viewer)) -> dict[str, Any]:
        snapshot = await feed.wait(epoch=epoch, after=after, wait_s=wait_s)
        return snapshot.to_json()

    @router.post("/api/v1/gateway/reports")
    async def reports(body: Report, who: Principal = Depends(gateway_only)) -> dict[str, int]:
        if who.name != f"gateway:{body.gateway}":
            raise AuthError(403, f"a gateway reports for itself only (token of {who.name})",
                            type_="permission_error", code="insufficient_role")
        traces = [_trace(raw) for raw in body.traces]
        kept = [t for t in traces if t is not None]
        await asyncio.to_thread(_store_report, store, body, kept)
        return {"traces": len(kept), "events": len(body.events), "refused": len(traces) - len(kept)}

    @router.put("/api/v1/gateway/admission")
    async def admission(body: AdmissionRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        """Admission limits of every gateway, changed now and kept for the gateways that start later."""
        changes = {k: v for k, v in body.model_dump().items() if v is not None}
        if not changes:
            raise Refused("give at least one of rate_limit_rps, rate_limit_tokens_per_s, "
                          "max_inflight_per_replica", param="body")
        result = await gateways.set_admission(changes)
        auditor.record(who, "gateway.admission", "gateways", changes, "ok",
                       f"applied on {', '.join(result['applied']) or 'no gateway yet'}")
        return result

    @router.get("/api/v1/gateways")
    async def listing(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return gateways.status()

    return router


def _trace(raw: Mapping[str, Any]) -> TraceRecord | None:
    try:
        return TraceRecord(**raw)
    except TypeError:
        logger.warning("a gateway sent a trace that does not parse; dropped")
        return None


def _store_report(store: Store, body: Report, traces: list[TraceRecord]) -> None:
    for trace in traces:
        store.add_trace(trace)
    for event in body.events:
        store.add_event(f"gateway.{event.kind}", event.replica_id,
                        {"detail": event.detail, "gateway": body.gateway, "at": event.at})
    dropped = {k: v for k, v in body.dropped.items() if v > 0}
    if dropped:
        store.add_event("gateway.reports_dropped", body.gateway, {"dropped": dropped})
