"""The control plane's REST API (FastAPI; OpenAPI spec at ``/openapi.json``).

Reads need a viewer token, mutations an operator token, token management an admin token. Every route
declares who may call it with one guard (``controlplane.auth.guard``), published as ``x-access`` in the
spec; the gate (``controlplane.api.gate``) checks it before reading the body, then caps the body. Every
mutation writes an audit record (who, what, when, outcome), also when it is refused or fails. The console,
the CLI and the Chaos Toolkit extension all go through this API (see ``controlplane.client``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Query
from pydantic import BaseModel, Field

from chaos.safety import FaultManager
from controlplane.alerts.engine import AlertEngine
from controlplane.api.alerts import alerts_router
from controlplane.api.auth import auth_router
from controlplane.api.autoscaler import autoscaler_router
from controlplane.api.chaos import chaos_router
from controlplane.api.drills import drills_router
from controlplane.api.errors import install_error_handlers
from controlplane.api.experts import experts_router
from controlplane.api.gate import Gate
from controlplane.api.gateways import Gateways, gateways_router
from controlplane.api.guards import install, public, require
from controlplane.api.process_metrics import process_metrics_router
from controlplane.api.rollouts import rollouts_router
from controlplane.api.schedules import schedules_router
from controlplane.api.simulations import simulator_router
from controlplane.api.slice_experiments import slice_experiments_router
from controlplane.api.spec import document
from controlplane.api.state_metrics import ControlPlaneState, StateSources
from controlplane.api.throttle import LoginThrottle
from controlplane.auth import Auditor, Principal, Role, TokenAuthority
from controlplane.autoscale.loop import Autoscaler
from controlplane.config import ApiConfig
from controlplane.drills.service import DrillService
from controlplane.errors import ControlPlaneError, Refused, Unavailable
from controlplane.fleet.feed import EndpointsFeed
from controlplane.fleet.reconcile import Fleet
from controlplane.rollouts.canary import CanaryController
from controlplane.rollouts.experiment import SliceExperiments
from controlplane.rollouts.versions import VersionRegistry
from controlplane.schedules.scheduler import DrillScheduler
from controlplane.store.database import Store
from controlplane.store.sqlite import MAX_ROW_ID
from controlplane.telemetry.base import GENERATION_TOKENS, REQUEST_SUCCESS, Scope, Telemetry
from controlplane.traces import TraceRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ScaleRequest(BaseModel):
    replicas: int = Field(ge=0, le=64, description="desired number of replicas across all zones")


class RolloutRequest(BaseModel):
    model: str = Field(min_length=1, description="a bundled model ('default', 'default-moe') or a Hugging "
                                                 "Face model folder")


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
    alerts: AlertEngine | None = None
    autoscaler: Autoscaler | None = None
    schedules: DrillScheduler | None = None
    drills: DrillService | None = None
    feed: EndpointsFeed | None = None  # with gateways: the routes the gateway processes call
    gateways: Gateways | None = None
    experiment_hosts: tuple[str, ...] = ()  # chaos.experiment_hosts: more hosts experiments may request
    # the faults the ledger holds active, counted as the fault manager writes it (state_metrics'
    # ActiveFaultCount, the ledger ``chaos`` writes through): /metrics/state never reads the store
    active_faults: Callable[[], int] | None = None
    api: ApiConfig = field(default_factory=ApiConfig)  # the body cap and the login backoff
    experiments: SliceExperiments | None = None  # slice experiments (/api/v1/experiments/slices)
    versions: VersionRegistry | None = None  # model versions and releases (rollouts/versions.py)
    canary: CanaryController | None = None
    what_if_priority: str = "idle"  # [simulator] cpu_priority: the what-if workers' CPU priority


def create_api(services: Services) -> FastAPI:
    app = FastAPI(title="LLM SRE control plane", version="0.1.0")
    app.add_middleware(Gate, max_body_bytes=services.api.max_body_bytes)
    install(app, services.tokens, services.auditor)
    install_error_handlers(app)
    viewer, operator, admin = require(Role.VIEWER), require(Role.OPERATOR), require(Role.ADMIN)

    async def audited(principal: Principal, action: str, target: str, params: dict[str, Any],
                      run: Callable[[], Awaitable[T] | T]) -> T:
        try:
            result = run()
            if isinstance(result, Awaitable):
                result = await result
        except ControlPlaneError as exc:  # a fleet refusal, a duplicate token name...: audited, then answered
            services.auditor.record(principal, action, target, params, "error", str(exc))
            raise
        services.auditor.record(principal, action, target, params, "ok")
        return result

    if services.chaos is not None:
        app.include_router(chaos_router(services.chaos, services.fleet, services.auditor,
                                        experiment_hosts=services.experiment_hosts))
    if services.alerts is not None:
        app.include_router(alerts_router(services.alerts, services.auditor))
    if services.autoscaler is not None:
        app.include_router(autoscaler_router(services.autoscaler, services.auditor))
    if services.schedules is not None:  # before any /api/v1/drills/{drill_id} route, which would shadow it
        app.include_router(schedules_router(services.schedules, services.auditor))
    if services.drills is not None:  # after the schedules: /api/v1/drills/{drill_id} would shadow them
        app.include_router(drills_router(services.drills, services.auditor))
    if services.versions is not None and services.canary is not None:
        app.include_router(rollouts_router(services.versions, services.canary, services.auditor))
    if services.experiments is not None:
        app.include_router(slice_experiments_router(services.experiments, services.auditor))
    if services.feed is not None and services.gateways is not None:
        app.include_router(gateways_router(services.feed, services.gateways, services.store,
                                           services.auditor))

    state = StateSources(services.fleet, services.autoscaler, services.drills, services.active_faults)
    # GET /metrics (public: runtime gauges) and GET /metrics/state (viewer: the state beside them)
    app.include_router(process_metrics_router(ControlPlaneState(state)))

    @app.get("/health", tags=["meta"], dependencies=[Depends(public)])
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
            # the cluster's nodes (none for local processes); a lost one stays listed until it is back
            "nodes": [asdict(n) for n in fleet.nodes()], "zones_down": sorted(fleet.zones_down),
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
    async def events(since_id: int = Query(0, ge=0, le=MAX_ROW_ID), kind: str | None = None,
                     subject: str | None = None,
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
        return asdict(_telemetry().summary(_scope(scope)))

    @app.get("/api/v1/audit", tags=["security"])
    async def audit(limit: int = Query(200, ge=1, le=5000), actor: str | None = None,
                    _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [asdict(a) for a in services.store.audit(limit=limit, actor=actor)]

    @app.post("/api/v1/tokens", tags=["security"], status_code=201)
    async def issue_token(body: TokenRequest, who: Principal = Depends(admin)) -> dict[str, Any]:
        secret = await audited(who, "token.issue", body.name, {"role": body.role, "ttl_s": body.ttl_s},
                               lambda: services.tokens.issue(body.name, Role(body.role), body.ttl_s))
        return {"name": body.name, "role": body.role, "token": secret}

    app.include_router(auth_router(services.store, services.tokens, services.auditor,
                                   LoginThrottle(services.api.login)))
    profile_path = services.autoscaler.config.replica_profile if services.autoscaler is not None else ""
    app.include_router(simulator_router(services.auditor, services.store, profile_path,
                                        services.what_if_priority))

    @app.get("/api/v1/latency/breakdown", tags=["observability"])
    def latency_breakdown(window_s: float = Query(300.0, gt=0, le=7 * 86400), scope: str = "fleet",
                          quantile: float = Query(0.99, ge=0.5, lt=1.0),
                          slowest: int = Query(20, ge=0, le=200),
                          _: Principal = Depends(viewer)) -> dict[str, Any]:
        parsed = _scope(scope)
        since = time.time() - window_s
        stored = services.store.traces(since=since, limit=MAX_BREAKDOWN_TRACES)
        traces = [t for t in stored if _in_scope(t, parsed)]
        return {"scope": str(parsed), "window_s": window_s, **tail_attribution(traces, quantile),
                "truncated": len(stored) == MAX_BREAKDOWN_TRACES,
                "slowest": [asdict(t) for t in sorted(traces, key=lambda t: -t.e2e_s)[:slowest]]}

    @app.get("/api/v1/metrics/range", tags=["observability"])
    def metrics_range(metric: str = Query(pattern=r"^[A-Za-z_:][A-Za-z0-9_:]*$"),
                      kind: str = Query("quantile", pattern="^(gauge|rate|quantile)$"),
                      q: float | None = Query(None, ge=0, le=1), scope: str = "fleet",
                      by: str = Query("", pattern="^(|replica|zone)$"),
                      minutes: float = Query(10.0, gt=0, le=24 * 60),
                      step_s: float = Query(5.0, ge=1, le=3600),
                      _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        telemetry, parsed = _telemetry(), _scope(scope)
        try:
            end = time.time()
            series = telemetry.range(kind, metric, start=end - minutes * 60, end=end,  # type: ignore[arg-type]
                                     step=step_s, q=q, by=(by,) if by else (), match=parsed.matchers)
        except ValueError as exc:
            raise Refused(str(exc)) from exc
        return [{"labels": s.labels, "points": [list(p) for p in s.points]} for s in series]

    @app.get("/api/v1/metrics/replicas", tags=["observability"])
    def replica_activity(_: Principal = Depends(viewer)) -> dict[str, dict[str, float | None]]:
        telemetry = _telemetry()
        loads = telemetry.replica_loads()  # a TelemetryError is a 503: the source may answer later
        qps = telemetry.rate(REQUEST_SUCCESS)
        tokens = telemetry.rate(GENERATION_TOKENS)
        return {rid: {"waiting": load.num_waiting, "running": load.num_running,
                      "kv_usage": load.kv_cache_usage,
                      "qps": qps.get((rid,)), "tokens_per_s": tokens.get((rid,))}
                for rid, load in loads.items()}

    def _telemetry() -> Telemetry:
        if services.telemetry is None:
            raise Unavailable("telemetry is not running")
        return services.telemetry

    app.include_router(experts_router(_telemetry))  # GET /api/v1/metrics/experts (viewer)
    document(app)
    return app


def _scope(text: str) -> Scope:
    try:
        return Scope.parse(text)
    except ValueError as exc:
        raise Refused(f"scope: {exc}", param="scope") from exc


def _endpoint_json(e: Any) -> dict[str, Any]:
    return {"replica_id": e.replica_id, "zone": e.zone, "url": e.base_url, "state": e.state.value,
            "model": e.model, "pid": e.pid, "generation": e.generation,
            "node": dict(e.labels).get("node")}  # the node's address on a cluster; None for local processes


# ---- tail attribution ------------------------------------------------------------------------------
MAX_BREAKDOWN_TRACES = 20_000  # at most this many (the window's oldest) per breakdown; "truncated" says so
STAGES = ("gateway", "queue", "prefill", "decode", "serialization")
MEDIAN_BAND = (0.4, 0.6)  # "typical" requests: end-to-end latency between these quantiles


def _in_scope(trace: TraceRecord, scope: Scope) -> bool:
    if scope.kind == "zone":
        return trace.zone == scope.name
    return scope.kind == "fleet" or trace.replica_id == scope.name


def stage_times(trace: TraceRecord) -> dict[str, float]:
    """Where one request's end-to-end time went; the stages add up to ``e2e_s`` (the gateway's share is
    what the replica's timings leave)."""
    return {"gateway": trace.gateway_s, "queue": trace.queue_s or 0.0, "prefill": trace.prefill_s or 0.0,
            "decode": trace.decode_s or 0.0,
            "serialization": (trace.detokenize_s or 0.0) + (trace.serialize_s or 0.0)}


def _nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _mean_stages(traces: list[TraceRecord]) -> dict[str, Any] | None:
    if not traces:
        return None
    sums = dict.fromkeys(STAGES, 0.0)
    for trace in traces:
        for stage, seconds in stage_times(trace).items():
            sums[stage] += seconds
    means = {s: v / len(traces) for s, v in sums.items()}
    total = sum(means.values())
    return {"count": len(traces), "e2e_s": sum(t.e2e_s for t in traces) / len(traces), "stages_s": means,
            "shares": {s: (v / total if total > 0 else 0.0) for s, v in means.items()}}


def tail_attribution(traces: list[TraceRecord], quantile: float) -> dict[str, Any]:
    """Mean stage times of the successful requests at and above the ``quantile`` of end-to-end latency
    ("tail"), next to those of typical requests around the median, and per replica. Per-stage quantiles
    do not add up to the end-to-end quantile; means over the same requests do."""
    ok = [t for t in traces if t.error is None and t.status < 400]
    if not ok:
        return {"quantile": quantile, "num_traces": 0, "threshold_s": None, "tail": None, "median": None,
                "by_replica": {}}
    ordered = sorted(t.e2e_s for t in ok)
    threshold = _nearest_rank(ordered, quantile)
    low, high = (_nearest_rank(ordered, q) for q in MEDIAN_BAND)
    by_replica: dict[str, Any] = {}
    for rid in sorted({t.replica_id for t in ok if t.replica_id}):
        mine = [t for t in ok if t.replica_id == rid]
        cut = _nearest_rank(sorted(t.e2e_s for t in mine), quantile)
        by_replica[rid] = {"threshold_s": cut, "tail": _mean_stages([t for t in mine if t.e2e_s >= cut])}
    return {"quantile": quantile, "num_traces": len(ok), "threshold_s": threshold,
            "tail": _mean_stages([t for t in ok if t.e2e_s >= threshold]),
            "median": _mean_stages([t for t in ok if low <= t.e2e_s <= high]), "by_replica": by_replica}
