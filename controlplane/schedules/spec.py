"""What a scheduled drill is: the spec a user sets, the schedule as stored, and one firing's record.

Where it sits: values of :mod:`controlplane.schedules.scheduler`, which keeps schedules as APScheduler jobs
(:mod:`controlplane.schedules.jobstore`) and records each firing as a :class:`ScheduleRun` in the store's
``drill_schedule_runs`` collection. A spec is checked when it is built (name, overlap, waits, the cron
expression in its time zone, the overrides; see :mod:`controlplane.schedules.triggers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, get_args

from controlplane.schedules.triggers import InvalidSchedule, check_overrides, parse_cron

MAX_NAME_CHARS = 64
DEFAULT_MAX_WAIT_S = 1800.0
DEFAULT_MISFIRE_GRACE_S = 300.0

Overlap = Literal["skip", "wait"]
OVERLAPS: tuple[str, ...] = get_args(Overlap)
RunOutcome = Literal["started", "skipped", "error"]


@dataclass(slots=True, frozen=True)
class ScheduleSpec:
    """Everything a user sets on a schedule; validated on construction."""

    name: str
    scenario_id: str
    cron: str
    timezone: str = "UTC"
    overrides: Mapping[str, Any] = field(default_factory=dict)  # numbers, replicas, zones, load
    overlap: Overlap = "skip"
    max_wait_s: float = DEFAULT_MAX_WAIT_S  # overlap "wait": give up (and record a skip) after this long
    misfire_grace_s: float = DEFAULT_MISFIRE_GRACE_S  # a late firing still runs within this many seconds
    coalesce: bool = True  # several missed firings run once

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_CHARS:
            raise InvalidSchedule(f"name: must be 1 to {MAX_NAME_CHARS} characters")
        if not self.scenario_id:
            raise InvalidSchedule("scenario_id: must not be empty")
        if self.overlap not in OVERLAPS:
            raise InvalidSchedule(f"overlap: must be one of {', '.join(OVERLAPS)}, got {self.overlap!r}")
        if self.max_wait_s < 0:
            raise InvalidSchedule(f"max_wait_s: must be >= 0, got {self.max_wait_s}")
        if self.misfire_grace_s < 1 or self.misfire_grace_s != int(self.misfire_grace_s):
            raise InvalidSchedule(f"misfire_grace_s: must be a whole number >= 1, got {self.misfire_grace_s}")
        object.__setattr__(self, "cron", " ".join(self.cron.split()))
        object.__setattr__(self, "overrides", check_overrides(self.overrides))
        parse_cron(self.cron, self.timezone)

    def as_kwargs(self) -> dict[str, Any]:
        """Plain JSON values for the job's kwargs (pickled by the job store; no classes of ours)."""
        return {"name": self.name, "scenario_id": self.scenario_id, "cron": self.cron,
                "timezone": self.timezone, "overrides": dict(self.overrides), "overlap": self.overlap,
                "max_wait_s": self.max_wait_s}

    @classmethod
    def from_job(cls, kwargs: Mapping[str, Any], *, misfire_grace_s: float, coalesce: bool) -> ScheduleSpec:
        return cls(name=kwargs["name"], scenario_id=kwargs["scenario_id"], cron=kwargs["cron"],
                   timezone=kwargs["timezone"], overrides=kwargs.get("overrides") or {},
                   overlap=kwargs["overlap"], max_wait_s=float(kwargs["max_wait_s"]),
                   misfire_grace_s=misfire_grace_s, coalesce=coalesce)


@dataclass(slots=True, frozen=True)
class Schedule:
    """A schedule as stored: its spec, id, who created it, and when it fires next (None: paused)."""

    id: str
    spec: ScheduleSpec
    next_run_time: datetime | None
    created_at: float
    created_by: str

    @property
    def paused(self) -> bool:
        return self.next_run_time is None

    def as_json(self) -> dict[str, Any]:
        spec = self.spec
        return {"id": self.id, "name": spec.name, "scenario_id": spec.scenario_id, "cron": spec.cron,
                "timezone": spec.timezone, "overrides": dict(spec.overrides), "overlap": spec.overlap,
                "max_wait_s": spec.max_wait_s, "misfire_grace_s": spec.misfire_grace_s,
                "coalesce": spec.coalesce, "paused": self.paused,
                "next_run_time": None if self.next_run_time is None else self.next_run_time.isoformat(),
                "created_at": self.created_at, "created_by": self.created_by}


@dataclass(slots=True, frozen=True)
class ScheduleRun:
    """One firing of a schedule, as recorded in ``drill_schedule_runs``."""

    schedule_id: str
    outcome: RunOutcome
    fired_at: float  # wall clock
    scenario_id: str = ""
    drill_id: str | None = None
    reason: str = ""
    waited_s: float = 0.0
    record_id: int | None = None

    def body(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body.pop("record_id")
        return body
