"""The drill schedule endpoints of the REST API (``/api/v1/drills/schedules``).

Reads need a viewer token; create, edit, pause, resume, run-now and delete need an operator token and
each writes an audit record, also when it is refused. A bad cron expression, time zone, scenario or
override is a 400 in the OpenAI error shape (``param``: the field its message starts with), an unknown id a
404, a duplicate name a 409. A schedule is aimed and loaded as a drill run is (``replicas``, ``zones``,
``load``: the drills API's own :class:`~controlplane.api.drills.LoadRequest`); they are kept in its
``overrides``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from controlplane.api.drills import LoadRequest
from controlplane.api.errors import field_of, status_of
from controlplane.api.guards import require
from controlplane.auth import Auditor, Principal, Role
from controlplane.errors import Refused
from controlplane.schedules.scheduler import DrillScheduler, Schedule, ScheduleError

PREFIX = "/api/v1/drills/schedules"
OVERRIDES_HELP = ("scenario fields replaced for this schedule's drills: rate, duration_s, fault_at_s, "
                  "max_tokens, input_len, capacity_deadline_s, targets.<name>")
REPLICAS_HELP = "the replica a single-replica fault hits (checked when it fires; default: the busiest at t0)"
ZONES_HELP = "the zone a zone fault takes, or whose busiest replica a single-replica fault hits"
LOAD_HELP = "the load profile: rate or trace, as a drill run takes it (default: the scenario's Poisson rate)"
T = TypeVar("T")


class CreateSchedule(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    scenario_id: str = Field(min_length=1, description="a drill scenario, such as replica-crash")
    cron: str = Field(min_length=1, description="5 fields: minute hour day month weekday")
    timezone: str | None = Field(default=None, description="IANA name; default: drills.schedule_timezone")
    overrides: dict[str, float] = Field(default_factory=dict, description=OVERRIDES_HELP)
    replicas: list[str] | None = Field(default=None, description=REPLICAS_HELP)
    zones: list[str] | None = Field(default=None, description=ZONES_HELP)
    load: LoadRequest | None = Field(default=None, description=LOAD_HELP)
    overlap: str | None = Field(default=None, description="skip or wait when a drill is already running")
    max_wait_s: float | None = Field(default=None, ge=0, description="overlap wait: give up after this")
    misfire_grace_s: float | None = Field(default=None, ge=1, description="late firings run within this")
    coalesce: bool = True
    paused: bool = False


class EditSchedule(BaseModel):
    name: str | None = Field(default=None, min_length=1, max_length=64)
    scenario_id: str | None = Field(default=None, min_length=1)
    cron: str | None = Field(default=None, min_length=1)
    timezone: str | None = None
    overrides: dict[str, float] | None = Field(default=None, description=OVERRIDES_HELP)
    replicas: list[str] | None = Field(default=None, description=REPLICAS_HELP + "; [] removes the aim")
    zones: list[str] | None = Field(default=None, description=ZONES_HELP + "; [] removes it")
    load: LoadRequest | None = Field(default=None, description=LOAD_HELP + "; {'kind': 'rate'} resets it")
    overlap: str | None = None
    max_wait_s: float | None = Field(default=None, ge=0)
    misfire_grace_s: float | None = Field(default=None, ge=1)
    coalesce: bool | None = None


def _name_field(exc: ScheduleError) -> None:
    """Give a refusal its ``param``: the field its message starts with ("cron: ...")."""
    if isinstance(exc, Refused) and exc.param is None:
        exc.param = field_of(exc.message)


def schedules_router(scheduler: DrillScheduler, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix=PREFIX, tags=["drills"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    async def audited(who: Principal, action: str, target: str, params: dict[str, Any],
                      run: Callable[[], T]) -> T:
        try:
            result = await asyncio.to_thread(run)  # the job store is SQLite: off the event loop
        except ScheduleError as exc:
            status, _ = status_of(exc)
            auditor.record(who, action, target, params, "denied" if status < 500 else "error", exc.message)
            _name_field(exc)
            raise
        auditor.record(who, action, target, params, "ok")
        return result

    async def read(run: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(run)
        except ScheduleError as exc:
            _name_field(exc)
            raise

    @router.get("")
    async def list_schedules(_: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return [s.as_json() for s in await read(scheduler.schedules)]

    @router.post("", status_code=201)
    async def create(body: CreateSchedule, who: Principal = Depends(operator)) -> dict[str, Any]:
        params = body.model_dump()

        def run() -> Schedule:
            spec = scheduler.spec(name=body.name, scenario_id=body.scenario_id, cron=body.cron,
                                  timezone=body.timezone, overrides=body.overrides, replicas=body.replicas,
                                  zones=body.zones, load=None if body.load is None else body.load.override(),
                                  overlap=body.overlap, max_wait_s=body.max_wait_s,
                                  misfire_grace_s=body.misfire_grace_s, coalesce=body.coalesce)
            schedule = scheduler.add(spec, created_by=who.name)
            return scheduler.pause(schedule.id) if body.paused else schedule

        return (await audited(who, "drill.schedule.create", body.name, params, run)).as_json()

    @router.get("/{schedule_id}")
    async def show(schedule_id: str, _: Principal = Depends(viewer)) -> dict[str, Any]:
        return (await read(lambda: scheduler.get(schedule_id))).as_json()

    @router.patch("/{schedule_id}")
    async def edit(schedule_id: str, body: EditSchedule,
                   who: Principal = Depends(operator)) -> dict[str, Any]:
        changes = body.model_dump(exclude_unset=True)
        if body.load is not None:
            changes["load"] = body.load.override()
        schedule = await audited(who, "drill.schedule.edit", schedule_id, body.model_dump(exclude_unset=True),
                                 lambda: scheduler.edit(schedule_id, **changes))
        return schedule.as_json()

    @router.post("/{schedule_id}/pause")
    async def pause(schedule_id: str, who: Principal = Depends(operator)) -> dict[str, Any]:
        return (await audited(who, "drill.schedule.pause", schedule_id, {},
                              lambda: scheduler.pause(schedule_id))).as_json()

    @router.post("/{schedule_id}/resume")
    async def resume(schedule_id: str, who: Principal = Depends(operator)) -> dict[str, Any]:
        return (await audited(who, "drill.schedule.resume", schedule_id, {},
                              lambda: scheduler.resume(schedule_id))).as_json()

    @router.post("/{schedule_id}/run")
    async def run_now(schedule_id: str, who: Principal = Depends(operator)) -> dict[str, Any]:
        return (await audited(who, "drill.schedule.run", schedule_id, {},
                              lambda: scheduler.run_now(schedule_id))).as_json()

    @router.delete("/{schedule_id}")
    async def delete(schedule_id: str, who: Principal = Depends(operator)) -> dict[str, Any]:
        await audited(who, "drill.schedule.delete", schedule_id, {}, lambda: scheduler.delete(schedule_id))
        return {"deleted": schedule_id}

    @router.get("/{schedule_id}/runs")
    async def runs(schedule_id: str, limit: int = Query(100, ge=1, le=5000),
                   _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        found = await read(lambda: scheduler.runs(schedule_id, limit=limit))
        return [{"id": r.record_id, **r.body()} for r in found]

    return router

