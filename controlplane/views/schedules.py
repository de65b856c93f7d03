"""Drill schedules as the API shows them: each schedule with its overrides, and each firing
(``/api/v1/drills/schedules/*``). Part of :mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class DrillSchedule:
    """A cron schedule of a drill; ``overrides`` are the scenario fields it replaces (numbers, and its
    aim and load: ``replicas``, ``zones``, ``load``)."""

    id: str
    name: str
    scenario_id: str
    cron: str
    timezone: str
    paused: bool
    next_run_time: str | None  # ISO 8601; None while paused
    overrides: Mapping[str, Any] = field(default_factory=dict)
    overlap: str = "skip"
    max_wait_s: float | None = None
    misfire_grace_s: float | None = None
    coalesce: bool = True
    created_at: float | None = None
    created_by: str = ""

    @property
    def aim_and_load(self) -> str:
        return schedule_aim_and_load(self.overrides)


@dataclass(slots=True, frozen=True)
class ScheduleRun:
    """One firing of a schedule."""

    id: int
    schedule_id: str
    outcome: str  # started | skipped | error
    fired_at: float
    scenario_id: str = ""
    drill_id: str | None = None
    reason: str = ""
    waited_s: float = 0.0


def schedule_aim_and_load(overrides: Mapping[str, Any]) -> str:
    """A drill schedule's aim and load (from its ``overrides``) in a few words, for the CLI and the console:
    ``az-b-1; trace azure x2``, ``busiest; rate 2/s``."""
    aim = ", ".join([*overrides.get("replicas", []), *overrides.get("zones", [])]) or "busiest at t0"
    load = overrides.get("load") or {}
    if load.get("kind") == "trace":
        text = f"trace {load.get('trace')} x{load.get('compress', 1):g}"
    else:
        rate = load.get("rate", overrides.get("rate"))
        text = "scenario's rate" if rate is None else f"rate {rate:g}/s"
    return f"{aim}; {text}"
