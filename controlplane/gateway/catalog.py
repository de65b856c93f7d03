"""``GET /v1/models`` at the gateway: the models its routable replicas serve, asked of each at once and
merged by id (a replica that does not answer adds nothing). Called by
:meth:`~controlplane.gateway.handler.Gateway.models`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from controlplane.replicas import ReplicaEndpoint

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 5.0


async def served_models(client: httpx.AsyncClient,
                        endpoints: Sequence[ReplicaEndpoint]) -> list[dict[str, Any]]:
    """Every model of ``endpoints``, once per id (the first replica's entry)."""
    pages = await asyncio.gather(*(_models_of(client, e) for e in endpoints))
    seen: dict[str, dict[str, Any]] = {}
    for models in pages:
        for model in models:
            seen.setdefault(str(model.get("id")), model)
    return list(seen.values())


async def _models_of(client: httpx.AsyncClient, endpoint: ReplicaEndpoint) -> list[dict[str, Any]]:
    try:
        response = await client.get(f"{endpoint.base_url}/v1/models", timeout=MODELS_TIMEOUT_S)
        data = response.json().get("data", []) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        logger.info("[%s] /v1/models failed: %s", endpoint.replica_id, exc)
        return []
    return [m for m in data if isinstance(m, dict)]
