"""The alert endpoints of the REST API, including the Alertmanager webhook receiver.

``/api/v1/alerts``: the rules (JSON, or as a Prometheus rule file at ``rules.yml``), the active alerts,
their transition history, switching a rule on or off, and ``POST /webhook`` for Alertmanager's v4
webhook payload (configure Alertmanager's ``http_config.authorization.credentials`` with an operator
token). Reads need a viewer token, the rest an operator token; every mutation is audited.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from controlplane.alerts.engine import AlertEngine, AlertError, ExternalAlert
from controlplane.api.guards import require
from controlplane.auth import Auditor, Principal, Role

MAX_WEBHOOK_ALERTS = 1_000


class RuleSwitch(BaseModel):
    enabled: bool


class WebhookAlert(BaseModel):
    """One alert as Alertmanager sends it (fields we do not use are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: datetime  # Alertmanager's field names
    endsAt: datetime | None = None
    fingerprint: str = Field(min_length=1, max_length=128)


class WebhookPayload(BaseModel):
    """Alertmanager's webhook payload, version 4."""

    model_config = ConfigDict(extra="allow")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    alerts: list[WebhookAlert] = Field(max_length=MAX_WEBHOOK_ALERTS)
    groupKey: str = ""


def alerts_router(engine: AlertEngine, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1/alerts", tags=["alerts"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    @router.get("/rules")
    async def rules(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return engine.rules_json()

    @router.get("/rules.yml", response_class=PlainTextResponse,
                responses={200: {"description": "a Prometheus rule file",
                                 "content": {"application/yaml": {"schema": {"type": "object"}}}}})
    async def rules_yml(_: Principal = Depends(viewer)) -> PlainTextResponse:
        return PlainTextResponse(engine.export(), media_type="application/yaml")

    @router.put("/rules/{name}")
    async def switch(name: str, body: RuleSwitch, who: Principal = Depends(operator)) -> dict[str, Any]:
        action = "alerts.enable" if body.enabled else "alerts.disable"
        try:
            resolved = engine.set_enabled(name, body.enabled)
        except AlertError as exc:  # UnknownRule: 404
            auditor.record(who, action, name, {}, "error", str(exc))
            raise
        auditor.record(who, action, name, {}, "ok", f"{len(resolved)} active alerts resolved")
        return {"name": name, "enabled": body.enabled, "resolved": [t.key for t in resolved]}

    @router.get("/active")
    @router.get("", include_in_schema=False)  # the console's client reads the collection itself
    async def active(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return engine.active_alerts()

    @router.get("/history")
    async def history(limit: int = Query(200, ge=1, le=5000), rule: str | None = None,
                      since: float | None = None, _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return engine.history(limit=limit, rule=rule, since=since)

    @router.post("/webhook", response_model=None)
    async def webhook(body: WebhookPayload, who: Principal = Depends(operator)) -> dict[str, Any]:
        alerts = [ExternalAlert(a.status, a.labels, a.annotations, a.startsAt.isoformat(),
                                a.endsAt.isoformat() if a.endsAt else "", a.fingerprint) for a in body.alerts]
        results = await engine.receive(alerts)
        fired = sum(1 for r in results if r["outcome"] == "fired")
        auditor.record(who, "alerts.webhook", body.receiver or "alertmanager",
                       {"status": body.status, "alerts": len(alerts), "group_key": body.groupKey}, "ok",
                       f"{fired} fired, {len(results) - fired} without new action")
        return {"received": len(alerts), "results": results}

    return router
