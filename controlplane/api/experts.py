"""``GET /api/v1/metrics/experts``: the expert load of a mixture-of-experts fleet, per replica and per
expert (tokens/s over a window, tokens since start, the imbalance), for the console's heatmap.

A viewer token suffices, as for every read of the metrics. A dense fleet answers no experts and no
replicas (200, not an error): the model has none. With no telemetry running, or a source that does not
answer, it is a 503, as the other metrics routes.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Query

from controlplane.api.guards import require
from controlplane.auth import Principal, Role
from controlplane.errors import Refused
from controlplane.telemetry.base import Scope, Telemetry
from controlplane.telemetry.experts import ExpertLoad, expert_load

MAX_WINDOW_S = 3600.0


def experts_router(telemetry: Callable[[], Telemetry]) -> APIRouter:
    """``telemetry`` answers the running source, or raises Unavailable (503) when none runs."""
    router = APIRouter(prefix="/api/v1/metrics", tags=["observability"])
    viewer = require(Role.VIEWER)

    @router.get("/experts")
    def experts(window_s: float | None = Query(None, gt=0, le=MAX_WINDOW_S,
                                               description="rate window; the telemetry's own by default"),
                scope: str = Query("fleet", description="fleet, zone:NAME or replica:ID"),
                _: Principal = Depends(viewer)) -> ExpertLoad:
        try:
            parsed = Scope.parse(scope)
        except ValueError as exc:
            raise Refused(f"scope: {exc}", param="scope") from exc
        return expert_load(telemetry(), parsed, window_s=window_s)  # a TelemetryError is a 503

    return router
