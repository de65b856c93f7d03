"""The autoscaler endpoints of the REST API: status, decision records, run-time config, pause and resume,
and the schedule (cron windows: list them with their next start and end, replace them all).

Reads need a viewer token; changing the config or the windows, pausing and resuming need an operator token
and are audited (refusals too). Windows set here are checked as the configuration loader checks
``[[autoscaler.windows]]``, kept in the store across restarts and replace the config's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.guards import require
from controlplane.auth import Auditor, Principal, Role
from controlplane.autoscale.config import ScheduleWindowConfig
from controlplane.autoscale.loop import COLLECTION, Autoscaler
from controlplane.autoscale.windows import Window
from controlplane.errors import Refused
from controlplane.vocabulary import AUTOSCALER_TARGETS


class Targets(BaseModel):
    """Per-metric targets of target tracking; omitted ones stay as they are."""

    model_config = ConfigDict(extra="forbid")
    waiting_per_replica: float | None = Field(default=None, gt=0)
    kv_cache_usage: float | None = Field(default=None, gt=0)
    ttft_p95_s: float | None = Field(default=None, gt=0)
    tokens_per_s_per_replica: float | None = Field(default=None, gt=0)
    engine_load_per_replica: float | None = Field(default=None, gt=0, description="engine seconds per second")


class ConfigUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    observe_only: bool | None = None
    min_replicas: int | None = Field(default=None, ge=0, le=1000)
    max_replicas: int | None = Field(default=None, ge=0, le=1000)
    tolerance: float | None = Field(default=None, ge=0, lt=1)
    scale_down_stabilization_s: float | None = Field(default=None, ge=0)
    scale_down_period_s: float | None = Field(default=None, ge=0)
    targets: Targets | None = None

    def changes(self) -> dict[str, Any]:
        out = {k: v for k, v in self.model_dump(exclude={"targets"}).items() if v is not None}
        if self.targets is not None:
            targets = self.targets.model_dump().items()
            out.update({AUTOSCALER_TARGETS[k]: v for k, v in targets if v is not None})
        return out


class WindowBody(BaseModel):
    """One cron window, as ``[[autoscaler.windows]]`` in the config."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    cron: str = Field(max_length=200, description="5 fields, standard cron numbering (0 or 7: Sunday)")
    duration_s: float = Field(default=0.0, ge=0, description="how long each span lasts; or end_cron")
    end_cron: str = Field(default="", max_length=200)
    timezone: str = Field(default="UTC", max_length=100)
    weekdays: list[str] = Field(default_factory=list, max_length=7)
    min_replicas: int | None = Field(default=None, ge=0, le=1000)
    max_replicas: int | None = Field(default=None, ge=0, le=1000)


class WindowsUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    windows: list[WindowBody] = Field(max_length=50)


_FIELD = re.compile(r"^window '(?P<name>.*?)': (?P<field>[a-z_]+):")


def window_param(message: str, names: list[str]) -> str:
    """``windows.<index>.<field>`` (as the request validator names fields) for a window problem."""
    named = re.match(r"^windows? '(?P<name>.*?)'", message)
    if named is None:  # "name: required"
        return "windows"
    name = named.group("name")
    if name not in names:
        return "windows"
    # a name defined twice: the second one is the bad one
    index = len(names) - 1 - names[::-1].index(name) if "defined twice" in message else names.index(name)
    if "No time zone found" in message:  # APScheduler's words for an unknown zone, on the cron field
        return f"windows.{index}.timezone"
    field = _FIELD.match(message)
    if field is not None and field.group("field") in WindowBody.model_fields:
        return f"windows.{index}.{field.group('field')}"
    if "give either duration_s" in message:
        return f"windows.{index}.duration_s"
    if "bounds" in message:
        return f"windows.{index}.min_replicas"
    return f"windows.{index}"


def span(window: Window, now: datetime) -> tuple[datetime | None, datetime | None, bool]:
    """(next start, next end, active now): while active, the end of the current span; else the start and
    end of the next one."""
    active = window.is_active(now)
    if window.duration is not None:
        if active:
            begun = window.start.get_next_fire_time(None, now - window.duration + timedelta(microseconds=1))
            start = window.start.get_next_fire_time(None, now + timedelta(microseconds=1))
            return start, begun + window.duration if begun is not None else None, True
        start = window.start.get_next_fire_time(None, now)
        return start, None if start is None else start + window.duration, False
    assert window.end is not None
    if active:
        return (window.start.get_next_fire_time(None, now + timedelta(microseconds=1)),
                window.end.get_next_fire_time(None, now + timedelta(microseconds=1)), True)
    start = window.start.get_next_fire_time(None, now)
    end = None if start is None else window.end.get_next_fire_time(None, start + timedelta(microseconds=1))
    return start, end, False


def windows_view(autoscaler: Autoscaler) -> dict[str, Any]:
    wall = autoscaler.wall()
    now = datetime.fromtimestamp(wall, UTC)
    out = []
    for cfg, window in zip(autoscaler.window_configs, autoscaler.windows, strict=True):
        start, end, active = span(window, now)
        out.append(dict(dataclasses.asdict(cfg), schedule=window.describe, active=active,
                        next_start=None if start is None else start.timestamp(),
                        next_end=None if end is None else end.timestamp()))
    return {"now": wall, "source": autoscaler.windows_source, "windows": out,
            "active": next((w["name"] for w in out if w["active"]), None)}


def autoscaler_router(autoscaler: Autoscaler, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1/autoscaler", tags=["autoscaler"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    @router.get("/status")
    async def status(_: Principal = Depends(viewer)) -> dict[str, Any]:
        return autoscaler.status()

    @router.get("/decisions")
    async def decisions(since: float | None = Query(None, description="POSIX seconds"),
                        limit: int = Query(100, ge=1, le=5000),
                        _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        records = autoscaler.store.records(COLLECTION, since=since, limit=limit)
        return [dict(r.body, id=r.id, ts=r.ts) for r in records]

    @router.put("/config")
    async def update(body: ConfigUpdate, who: Principal = Depends(operator)) -> dict[str, Any]:
        changes = body.changes()
        if not changes:
            auditor.record(who, "autoscaler.config", "autoscaler", changes, "error", "nothing to change")
            raise Refused("nothing to change: give at least one field")
        try:
            autoscaler.update(changes)
        except ValueError as exc:
            auditor.record(who, "autoscaler.config", "autoscaler", changes, "error", str(exc))
            raise Refused(str(exc), param=str(exc).split(":")[0]) from exc
        auditor.record(who, "autoscaler.config", "autoscaler", changes, "ok")
        return autoscaler.status()

    @router.get("/windows")
    async def windows(_: Principal = Depends(viewer)) -> dict[str, Any]:
        return await asyncio.to_thread(windows_view, autoscaler)

    @router.put("/windows")
    async def set_windows(body: WindowsUpdate, who: Principal = Depends(operator)) -> dict[str, Any]:
        cfgs = [ScheduleWindowConfig(**w.model_dump()) for w in body.windows]
        params = {"windows": [w.model_dump() for w in body.windows]}
        try:  # a year of cron starts per pair of windows: off the event loop
            await asyncio.to_thread(autoscaler.set_windows, cfgs)
        except ValueError as exc:
            auditor.record(who, "autoscaler.windows", "autoscaler", params, "error", str(exc))
            raise Refused(str(exc), param=window_param(str(exc), [c.name for c in cfgs])) from exc
        auditor.record(who, "autoscaler.windows", "autoscaler", params, "ok")
        return await asyncio.to_thread(windows_view, autoscaler)

    @router.post("/pause")
    async def pause(who: Principal = Depends(operator)) -> dict[str, Any]:
        autoscaler.pause()
        auditor.record(who, "autoscaler.pause", "autoscaler", {}, "ok")
        return {"mode": autoscaler.mode}

    @router.post("/resume")
    async def resume(who: Principal = Depends(operator)) -> dict[str, Any]:
        autoscaler.resume()
        auditor.record(who, "autoscaler.resume", "autoscaler", {}, "ok")
        return {"mode": autoscaler.mode}

    return router
