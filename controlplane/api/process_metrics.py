"""``GET /metrics``: the control plane process's own runtime gauges, in Prometheus' text format.

Today that is ``process_asyncio_tasks`` (:mod:`inference.runtime_metrics`, which the gateway and the replicas
export too): the soak benchmark (``python -m controlplane.bench soak``) samples it to find tasks that leak.
It is public, like a replica's and a gateway's ``/metrics``: Prometheus scrapes it (job ``controlplane``)
without a token, and it carries runtime gauges only (no names, no ids, nothing a token guards).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from controlplane.auth import public
from inference.runtime_metrics import register_runtime_metrics

REGISTRY = CollectorRegistry()
register_runtime_metrics(REGISTRY)


def process_metrics_router() -> APIRouter:
    router = APIRouter(tags=["observability"])

    @router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(public)])
    async def process_metrics() -> Response:
        """This process's runtime gauges (asyncio tasks), collected on the event loop that serves the API."""
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return router
