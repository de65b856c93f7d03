"""``POST /api/v1/simulate``: a what-if run of autoscaling policies in the fleet simulator.

It changes nothing in the fleet, but it is CPU work on the control plane's host: it needs an operator
token, is audited, runs in a worker thread, one run at a time (a second one gets 409), on a bounded trace
(at most ``MAX_REQUESTS`` requests and ``MAX_DURATION_S`` simulated seconds). The trace is the seeded
synthetic bursty one, the Azure trace at ``$CONTROLPLANE_AZURE_TRACE`` (``azure``), or requests sent inline.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from controlplane.auth import Auditor, Principal, Role, require

MAX_REQUESTS = 50_000
MAX_DURATION_S = 4 * 3600.0
AZURE_TRACE_ENV = "CONTROLPLANE_AZURE_TRACE"


class InlineRequest(BaseModel):
    arrival: float = Field(ge=0, le=MAX_DURATION_S)
    prompt_len: int = Field(ge=1, le=1_000_000)
    output_len: int = Field(ge=1, le=1_000_000)


class SimulateRequest(BaseModel):
    trace: str = Field("synthetic-bursty", pattern="^(synthetic-bursty|azure|inline)$")
    requests: list[InlineRequest] = Field(
        default_factory=list,
        max_length=MAX_REQUESTS,
        description="the trace when 'inline'; compress and token_scale apply",
    )
    policies: list[str] = Field(
        default_factory=lambda: ["ours", "hpa"],
        min_length=1,
        max_length=4,
        description="ours, hpa or static:N",
    )
    compress: float = Field(4.0, gt=0, le=1000)
    token_scale: float = Field(0.25, gt=0, le=10)
    duration_s: float | None = Field(
        None, gt=0, le=MAX_DURATION_S, description="seconds of the trace kept, before compression"
    )
    seed: int = 0
    ttft_slo_s: float = Field(1.0, gt=0, le=600)
    tpot_slo_s: float = Field(0.1, gt=0, le=60)
    max_replicas: int = Field(12, ge=1, le=64)
    crashes: list[float] = Field(
        default_factory=list,
        max_length=100,
        description="simulated seconds at which the busiest replica crashes",
    )


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    type_ = "conflict" if status == 409 else "invalid_request_error"
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": None}}, status_code=status
    )


def simulator_router(auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1", tags=["simulator"])
    operator = require(Role.OPERATOR)
    busy = asyncio.Lock()

    @router.post("/simulate", response_model=None)
    async def simulate(
        body: SimulateRequest, who: Principal = Depends(operator)
    ) -> dict[str, Any] | JSONResponse:
        params = body.model_dump(exclude={"requests"}) | {"num_inline_requests": len(body.requests)}
        if busy.locked():
            auditor.record(who, "simulate.run", body.trace, params, "denied", "a simulation is running")
            return _error(409, "a simulation is already running; try again when it has finished")
        async with busy:
            try:
                result = await asyncio.to_thread(run_what_if, body)
            except ValueError as exc:
                auditor.record(who, "simulate.run", body.trace, params, "error", str(exc))
                return _error(400, str(exc))
        auditor.record(
            who,
            "simulate.run",
            body.trace,
            params,
            "ok",
            "; ".join(
                f"{p['policy']}: {p['slo_attainment']:.3f} SLO, {p['replica_seconds']:.0f} replica-s"
                for p in result["policies"]
            ),
        )
        return result

    return router


def run_what_if(body: SimulateRequest) -> dict[str, Any]:
    """The simulation behind the endpoint (also callable without HTTP); ValueError for bad input."""
    from controlplane.sim_profile import load_profile
    from controlplane.sim_trace import BurstyConfig, TraceShape, azure_trace, shaped, synthetic_bursty
    from controlplane.simulator import PolicySpec, SimSettings, Slo, compare

    specs = [PolicySpec.parse(p) for p in body.policies]
    profile = load_profile()
    shape = TraceShape(
        compress=body.compress,
        token_scale=body.token_scale,
        duration_s=body.duration_s,
        max_prompt_len=profile.max_model_len * 3 // 4,
        max_output_len=profile.max_model_len // 4,
    )
    if body.trace == "synthetic-bursty":
        requests = synthetic_bursty(BurstyConfig(seed=body.seed, duration_s=body.duration_s or 3600.0), shape)
    elif body.trace == "azure":
        path = os.environ.get(AZURE_TRACE_ENV)
        if not path:
            raise ValueError(f"trace: 'azure' needs ${AZURE_TRACE_ENV} on the server; send the trace inline")
        requests = azure_trace(path, shape)
    else:
        requests = shaped([(r.arrival, r.prompt_len, r.output_len) for r in body.requests], shape)
    if not requests:
        raise ValueError("trace: no request to simulate")
    if len(requests) > MAX_REQUESTS or max(r.arrival for r in requests) > MAX_DURATION_S:
        raise ValueError(f"trace: at most {MAX_REQUESTS} requests over {MAX_DURATION_S:g} simulated seconds")
    settings = SimSettings(
        slo=Slo(body.ttft_slo_s, body.tpot_slo_s),
        max_replicas=body.max_replicas,
        initial_replicas=min(2, body.max_replicas),
        crashes=tuple(body.crashes),
    )
    reports = compare(requests, specs, profile=profile, settings=settings)
    return {
        "trace": body.trace,
        "num_requests": len(requests),
        "profile": profile.source,
        "slo": {"ttft_s": settings.slo.ttft_s, "tpot_s": settings.slo.tpot_s},
        "policies": [r.to_json() for r in reports],
    }
