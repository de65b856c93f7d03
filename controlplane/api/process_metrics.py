"""``GET /metrics`` and ``GET /metrics/state``: the control plane process's own series, in Prometheus' text
format.

``/metrics`` is public, like a replica's and a gateway's: runtime gauges only, today
``llmsre_asyncio_tasks`` (:mod:`inference.runtime_metrics`, which the gateway and the replicas export too),
which the soak benchmark (``python -m controlplane.bench soak``) samples to find tasks that leak. It says
nothing a token guards.

``/metrics/state`` needs a viewer token, as the REST API's reads do: the same runtime gauges plus the
control plane's state (:mod:`controlplane.api.state_metrics`: fleet size, the autoscaler's mode and
recommendation, whether a drill runs, active faults). The Prometheus the control plane runs scrapes it as
job ``controlplane`` with a viewer token of its own (``controlplane.app``). Both pages are collected on the
event loop that serves the API, so nothing they read may block: the state is read from memory.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from controlplane.api.guards import public, require
from controlplane.auth import Role
from inference.runtime_metrics import register_runtime_metrics

STATE_PATH = "/metrics/state"


def process_metrics_router(state: Collector | None = None) -> APIRouter:
    """``/metrics``; with ``state``, also ``/metrics/state`` (the runtime gauges and ``state``)."""
    runtime = CollectorRegistry()
    register_runtime_metrics(runtime)
    router = APIRouter(tags=["observability"])

    @router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(public)])
    async def process_metrics() -> Response:
        """This process's runtime gauges (asyncio tasks)."""
        return Response(generate_latest(runtime), media_type=CONTENT_TYPE_LATEST)

    if state is None:
        return router
    guarded = CollectorRegistry()
    register_runtime_metrics(guarded)
    guarded.register(state)

    @router.get(STATE_PATH, response_class=PlainTextResponse, dependencies=[Depends(require(Role.VIEWER))])
    async def state_metrics() -> Response:
        """The runtime gauges and the control plane's state: fleet, autoscaler, drills, faults (viewer)."""
        return Response(generate_latest(guarded), media_type=CONTENT_TYPE_LATEST)

    return router
