"""Failover drills in the control plane: the port the chaos layer's runner needs, the one-at-a-time
service that runs drills in the background and stores their reports, and the ``/api/v1/drills`` router.

``DrillService.start(scenario_id, overrides) -> drill_id`` and ``DrillService.is_running()`` are the public
surface for schedules (call them on the control plane's event loop). Reports are JSON records of the store's
``drills`` collection (key: the scenario id); a report still ``running`` when the control plane starts was
cut short by a crash and is marked ``interrupted``. Reads need a viewer token, run and abort an operator
token, and both are audited.

A run request may aim the drill (``replicas``, ``zones``: checked against the fleet when it starts) and pick
its load (``load``: Poisson at a rate, or an Azure LLM trace replayed; the bare ``rate`` still works). Bad
input is a 400 in the OpenAI error shape whose ``param`` names the field.
"""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from chaos.drills import DrillError, DrillRunner, FleetSample, Timings
from chaos.scenarios import SCENARIOS, scenario
from chaos.targets import Target
from controlplane.auth import Auditor, Principal, Role, require
from controlplane.chaos_api import ChaosRefused, fleet_targets
from controlplane.config import Config
from controlplane.drill_report import compare, summary, to_markdown
from controlplane.fleet import Fleet
from controlplane.store import Store
from inference.models.default import ensure_default_model

logger = logging.getLogger(__name__)

COLLECTION = "drills"
MARKS = "drill_marks"
KEEP_REPORTS = 500
START_TIME_EVENTS = 50  # the latest replica.ready events that give the measured start time
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")  # "load.trace: no trace file ..." names load.trace


class FleetDrillPort:
    """The fleet, gateway and store as :class:`chaos.drills.DrillPort`."""

    def __init__(self, config: Config, fleet: Fleet, store: Store, *,
                 inflight: Callable[[], Mapping[str, int]] = dict) -> None:
        self.config, self.fleet, self.store = config, fleet, store
        self._inflight = inflight  # the gateway's streams in flight per replica

    @property
    def gateway_url(self) -> str:
        return f"http://{self.config.gateway.host}:{self.config.gateway.port}"

    def fleet_sample(self) -> FleetSample:
        f = self.fleet
        return FleetSample(time.time(), f.num_ready(), f.desired_total, f.rollout is not None)

    def inflight(self) -> Mapping[str, int]:
        return self._inflight()

    def targets(self) -> Sequence[Target]:
        return fleet_targets(self.fleet)

    def timings(self) -> Timings:
        fc, gc = self.config.fleet, self.config.gateway
        return Timings(replica_start_s=self.replica_start_s(), health_interval_s=fc.health_interval_s,
                       reconcile_interval_s=fc.reconcile_interval_s, stall_timeout_s=gc.stall_timeout_s,
                       first_byte_timeout_s=gc.first_byte_timeout_s,
                       restart_backoff_s=fc.restart_backoff_s, rollout_observe_s=fc.rollout_observe_s,
                       replicas=self.fleet.desired_total)

    def replica_start_s(self) -> float | None:
        """Median spawn-to-ready seconds of the latest replica starts (fleet events)."""
        events = self._events("replica.ready")[-START_TIME_EVENTS:]
        seconds = [float(e.detail["seconds_to_ready"]) for e in events if "seconds_to_ready" in e.detail]
        return round(statistics.median(seconds), 3) if seconds else None

    def start_rollout(self) -> str:
        """Roll out the same weights under a new folder named ``default`` (so clients' model name and the
        greedy tokens stay the same); alternates between two such folders."""
        base = self.config.state_path / "drills" / "rollout"
        source = ensure_default_model(self.config.state_path)
        folders = []
        for name in ("a", "b"):
            link = base / name / "default"
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(source, target_is_directory=True)
            folders.append(str(link))
        model = folders[1] if self.fleet.model == folders[0] else folders[0]
        self.fleet.start_rollout(model)
        return model

    def resumes_between(self, start_wall: float, end_wall: float) -> int:
        return sum(1 for e in self._events("gateway.resumed") if start_wall <= e.ts <= end_wall)

    def write_marks(self, drill_id: str, n: int) -> list[int]:
        return [self.store.add_record(MARKS, {"drill": drill_id, "n": i}, key=drill_id).id for i in range(n)]

    def count_marks(self, ids: Sequence[int]) -> int:
        return sum(1 for i in ids if self.store.record(i, MARKS) is not None)

    def _events(self, kind: str) -> list[Any]:
        out: list[Any] = []
        since = 0
        while True:
            page = self.store.events(since_id=since, kind_prefix=kind, limit=5000)
            out += page
            if len(page) < 5000:
                return out
            since = page[-1].id


class DrillService:
    """One drill at a time, in the background; reports in the store."""

    def __init__(self, runner: DrillRunner, store: Store, state_dir: Path, *,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.runner, self.store, self.state_dir = runner, store, state_dir
        self._loop = loop  # where drills run; start() from another thread hops onto it
        self._task: asyncio.Task[None] | None = None
        self._running_id: int | None = None
        self._progress: dict[str, Any] = {}
        self._abort = asyncio.Event()

    def is_running(self) -> bool:
        """Whether a drill is running now (a second ``start`` would raise DrillError)."""
        return self._task is not None and not self._task.done()

    @property
    def running_id(self) -> int | None:
        return self._running_id if self.is_running() else None

    def mark_interrupted(self) -> int:
        """Reports left ``running`` by a control plane that died mid-drill become ``interrupted``."""
        stale = [r for r in self.store.records(COLLECTION, limit=KEEP_REPORTS)
                 if r.body.get("status") == "running"]
        for r in stale:
            self.store.update_record(r.id, {**r.body, "status": "interrupted",
                                            "error": "the control plane stopped during the drill"})
        return len(stale)

    def plan(self, scenario_id: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The dry run: KeyError for an unknown scenario, ValueError for a bad override, selector or aim
        (a replica or zone not in the fleet)."""
        return self.runner.plan(scenario(scenario_id).with_overrides(overrides or {}))

    def start(self, scenario_id: str, overrides: Mapping[str, Any] | None = None) -> str:
        """Start a drill in the background and return its id (the report's record id, as text) at once.

        Callable on the control plane's event loop or from any other thread (a scheduler's worker: the
        start then runs on the loop and this call waits for it). KeyError: unknown scenario; ValueError:
        bad override; DrillError: one is running already.
        """
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is not None or self._loop is None:
            return str(self.start_here(scenario_id, overrides))

        async def hop() -> int:
            return self.start_here(scenario_id, overrides)

        return str(asyncio.run_coroutine_threadsafe(hop(), self._loop).result(timeout=30))

    def start_here(self, scenario_id: str, overrides: Mapping[str, Any] | None = None) -> int:
        """``start`` on the running event loop; returns the drill id."""
        sc = scenario(scenario_id).with_overrides(overrides or {})
        self.runner.check(sc)  # a named replica or zone must be in the fleet now
        if self.is_running():
            raise DrillError(f"drill {self._running_id} is running; one drill at a time")
        record = self.store.add_record(COLLECTION, {"scenario": sc.id, "title": sc.title, "status": "running",
                                                    "started_at": time.time(), "config": sc.describe(),
                                                    "overrides": dict(overrides or {}),
                                                    "targets_requested": {"replicas": list(sc.replicas),
                                                                          "zones": list(sc.zones)}},
                                       key=sc.id)
        self._running_id = record.id
        self._progress = {"phase": "starting", "fraction": 0.0}
        self._abort = asyncio.Event()
        self._task = asyncio.create_task(self._run(record.id, sc), name=f"drill-{record.id}")
        self.store.trim_records(COLLECTION, KEEP_REPORTS)
        logger.info("drill %d: %s started", record.id, sc.id)
        return record.id

    async def _run(self, drill_id: int, sc: Any) -> None:
        def progress(phase: str, fraction: float) -> None:
            self._progress = {"phase": phase, "fraction": round(fraction, 3)}

        workdir = self.state_dir / "drills" / str(drill_id)
        try:
            report = await self.runner.run(str(drill_id), sc, workdir=workdir, progress=progress,
                                           abort=self._abort)
        except Exception as exc:  # the runner turns failures into reports; this is the last guard
            logger.exception("drill %d crashed", drill_id)
            report = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        current = self.store.record(drill_id, COLLECTION)
        body = {**(current.body if current else {}), **report, "id": drill_id}
        self.store.update_record(drill_id, body)
        logger.info("drill %d: %s %s", drill_id, sc.id, body.get("status"))

    def abort(self, drill_id: int) -> bool:
        if self.running_id != drill_id:
            return False
        self._abort.set()
        return True

    async def aclose(self) -> None:
        """Abort a running drill (its faults are reverted) and wait for its report."""
        if self._task is not None and not self._task.done():
            self._abort.set()
            await asyncio.gather(self._task, return_exceptions=True)

    def get(self, drill_id: int) -> dict[str, Any] | None:
        record = self.store.record(drill_id, COLLECTION)
        if record is None:
            return None
        body = {**record.body, "id": record.id}
        if self.running_id == drill_id:
            body["progress"] = dict(self._progress)
        return body

    def list(self, limit: int = 50) -> list[dict[str, Any]]:
        out = []
        for r in self.store.records(COLLECTION, limit=limit):
            body = {**r.body, "id": r.id}
            if self.running_id == r.id:
                body["progress"] = dict(self._progress)
            out.append(summary(body))
        return out


class LoadRequest(BaseModel):
    """``{"kind": "rate", "rate": R}`` (Poisson) or ``{"kind": "trace", "trace": "azure" | PATH, "compress":
    X, "token_scale": Y}`` (an Azure LLM trace replayed X times faster from ``trace_start_s``, token counts
    times Y, prompts capped at ``max_input_len`` and outputs at ``max_tokens``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["rate", "trace"]
    rate: float | None = Field(None, gt=0, le=100, description="requests per second (rate)")
    trace: str | None = Field(None, min_length=1, description="'azure' or the path of an Azure LLM trace CSV")
    compress: float | None = Field(None, gt=0, le=10_000, description="trace replay speed-up")
    token_scale: float | None = Field(None, gt=0, le=100, description="multiplies trace token counts")
    trace_start_s: float | None = Field(None, ge=0, description="seconds into the trace")
    max_input_len: int | None = Field(None, ge=1, le=8192, description="cap on trace prompts (tokens)")

    def override(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class RunRequest(BaseModel):
    scenario: str = Field(min_length=1)
    rate: float | None = Field(None, gt=0, le=100, description="requests per second (a rate load)")
    load: LoadRequest | None = Field(None, description="the load profile: rate or trace")
    replicas: list[str] | None = Field(None, description="the replica a single-replica fault hits")
    zones: list[str] | None = Field(None, description="the zone a zone fault takes, or whose busiest "
                                                      "replica a single-replica fault hits")
    duration_s: float | None = Field(None, gt=0, le=600, description="load duration")
    fault_at_s: float | None = Field(None, gt=0, description="t0, seconds into the load")
    max_tokens: int | None = Field(None, ge=1, le=1024)
    capacity_deadline_s: float | None = Field(None, gt=0, le=1800)
    targets: dict[str, float] = Field(default_factory=dict, description="target overrides by name")
    dry_run: bool = False

    def overrides(self) -> dict[str, Any]:
        fields = ("rate", "duration_s", "fault_at_s", "max_tokens", "capacity_deadline_s", "replicas",
                  "zones")
        out: dict[str, Any] = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        if self.load is not None:
            out["load"] = self.load.override()
        out.update({f"targets.{k}": v for k, v in self.targets.items()})
        return out


def drills_router(service: DrillService, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1/drills", tags=["drills"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    @router.get("/scenarios")
    async def scenarios(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [s.describe() for s in SCENARIOS.values()]

    @router.post("/run", response_model=None)
    async def run(body: RunRequest, who: Principal = Depends(operator)) -> dict[str, Any] | JSONResponse:
        params = body.model_dump()
        try:
            if body.dry_run:
                return {"dry_run": True, "plan": service.plan(body.scenario, body.overrides())}
            drill_id = service.start_here(body.scenario, body.overrides())
        except (KeyError, ValueError) as exc:
            message = str(exc).strip("'\"")
            auditor.record(who, "drill.run", body.scenario, params, "error", message)
            return _invalid(message)
        except DrillError as exc:
            auditor.record(who, "drill.run", body.scenario, params, "denied", str(exc))
            raise ChaosRefused(409, str(exc)) from exc
        auditor.record(who, "drill.run", body.scenario, params, "ok", f"drill {drill_id}")
        return {"id": drill_id, "scenario": body.scenario, "status": "running"}

    @router.get("")
    async def listing(limit: int = Query(50, ge=1, le=KEEP_REPORTS),
                      _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return service.list(limit)

    @router.get("/compare")
    async def compared(ids: str = Query(..., description="comma-separated drill ids"),
                       _: Principal = Depends(viewer)) -> dict[str, Any]:
        try:
            wanted = [int(i) for i in ids.split(",") if i.strip()]
        except ValueError as exc:
            raise ChaosRefused(400, f"ids: expected comma-separated integers, got {ids!r}") from exc
        if len(wanted) < 2:
            raise ChaosRefused(400, "ids: give at least two drill ids")
        return compare([_report(service, i) for i in wanted])

    @router.get("/{drill_id}")
    async def show(drill_id: int, _: Principal = Depends(viewer)) -> dict[str, Any]:
        return _report(service, drill_id)

    @router.get("/{drill_id}/report.md", response_class=PlainTextResponse)
    async def markdown(drill_id: int, _: Principal = Depends(viewer)) -> PlainTextResponse:
        return PlainTextResponse(to_markdown(_report(service, drill_id)), media_type="text/markdown")

    @router.post("/{drill_id}/abort")
    async def abort(drill_id: int, who: Principal = Depends(operator)) -> dict[str, Any]:
        report = _report(service, drill_id)
        if not service.abort(drill_id):
            auditor.record(who, "drill.abort", str(drill_id), {}, "denied", "not running")
            raise ChaosRefused(409, f"drill {drill_id} is not running (status {report.get('status')})")
        auditor.record(who, "drill.abort", str(drill_id), {}, "ok")
        return {"id": drill_id, "aborting": True}

    return router


def _invalid(message: str) -> JSONResponse:
    """A 400 in the OpenAI error shape; ``param`` is the field the message starts with."""
    named = _FIELD.match(message)
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": named.group(1) if named else None, "code": None}},
                        status_code=400)


def _report(service: DrillService, drill_id: int) -> dict[str, Any]:
    report = service.get(drill_id)
    if report is None:
        raise ChaosRefused(404, f"no drill {drill_id}")
    return report
