"""Model versions and canary releases over HTTP.

- ``GET /api/v1/versions`` (viewer), ``POST /api/v1/versions`` (operator): the registry.
- ``GET /api/v1/rollouts`` (viewer): the current version, the traffic split now, the running or last
  release with every step's analysis, and the history.
- ``POST /api/v1/rollouts/canary`` (operator): start a canary release of a version.
- ``POST /api/v1/rollouts/{id}/{action}`` (operator): promote, abort, pause or resume it.

Every mutation is audited. A plain rolling update stays ``POST /api/v1/fleet/rollout``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.guards import require
from controlplane.auth import Auditor, Principal, Role
from controlplane.errors import ControlPlaneError
from controlplane.rollouts.analysis import Thresholds
from controlplane.rollouts.canary import CanaryController, CanaryPolicy
from controlplane.rollouts.versions import VersionRegistry


class VersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=32, description="a-z, 0-9, '.' and '-'")
    model: str = Field(min_length=1, max_length=4096, description="a bundled model or a Hugging Face folder")
    notes: str = Field("", max_length=2000)


class CanaryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(min_length=1, max_length=32)
    steps: list[float] = Field([5, 20, 50, 100], min_length=1, max_length=20,
                               description="percent of traffic at each step; the last is 100")
    interval_s: float = Field(60.0, ge=1, le=3600, description="each step's analysis window")
    max_extensions: int = Field(3, ge=0, le=20, description="extra windows for a step short of traffic")
    replicas: int = Field(1, ge=1, le=16)
    warmup_s: float = Field(2.0, ge=0, le=600, description="not analysed at the start of the first step")
    alpha: float = Field(0.01, gt=0, lt=0.5, description="significance of each one-sided test")
    max_error_increase: float = Field(0.02, ge=0, lt=1, description="failure share above stable's")
    max_latency_ratio: float = Field(1.25, ge=1, le=100, description="canary median over stable's")
    min_latency_increase_s: float = Field(0.005, ge=0, le=60, description="and at least this much slower")
    min_samples: int = Field(30, ge=5, le=100_000, description="per side before a step decides")

    def policy(self) -> CanaryPolicy:
        thresholds = Thresholds(alpha=self.alpha, max_error_increase=self.max_error_increase,
                                max_latency_ratio=self.max_latency_ratio, min_samples=self.min_samples,
                                min_latency_increase_s=self.min_latency_increase_s)
        return CanaryPolicy(tuple(s / 100 for s in self.steps), self.interval_s, thresholds,
                            self.max_extensions, self.replicas, warmup_s=self.warmup_s)


class ActionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field("", max_length=500)


def rollouts_router(registry: VersionRegistry, canary: CanaryController, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1", tags=["rollouts"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    def audited(who: Principal, action: str, target: str, params: dict[str, Any], run: Any) -> Any:
        try:
            result = run()
        except ControlPlaneError as exc:
            auditor.record(who, action, target, params, "error", str(exc))
            raise
        auditor.record(who, action, target, params, "ok")
        return result

    @router.get("/versions")
    async def versions(_: Principal = Depends(viewer)) -> dict[str, Any]:
        return {"current": registry.current(), "versions": [v.to_json() for v in registry.all()]}

    @router.post("/versions", status_code=201)
    async def add_version(body: VersionRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        version = audited(who, "versions.add", body.name, body.model_dump(),
                          lambda: registry.add(body.name, body.model, body.notes))
        if registry.current() is None and body.model == canary.fleet.model:
            registry.set_current(body.name)  # the version the fleet serves now
        return dict(version.to_json())

    @router.get("/rollouts")
    async def rollouts(limit: int = Query(20, ge=1, le=500),
                       _: Principal = Depends(viewer)) -> dict[str, Any]:
        return {**canary.status(), "history": [r.to_json() for r in registry.releases(limit)]}

    @router.post("/rollouts/canary", status_code=201)
    async def start(body: CanaryRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        release = audited(who, "rollouts.canary", body.version, body.model_dump(),
                          lambda: canary.start(body.version, body.policy()))
        return dict(release.to_json())

    @router.post("/rollouts/{release_id}/{action}")
    async def act(release_id: int, action: str, body: ActionRequest | None = None,
                  who: Principal = Depends(operator)) -> dict[str, Any]:
        reason = body.reason if body else ""
        release = audited(who, f"rollouts.{action}", str(release_id), {"reason": reason},
                          lambda: canary.command(release_id, action, reason))
        return dict(release.to_json())

    return router
