"""When a drill schedule fires, and which values a schedule may hold: cron in a time zone, and validation.

Pure values, no scheduler and no store: :mod:`controlplane.schedules.scheduler` (the scheduler, its job store
and the firing) builds on them, and re-exports every name here for the modules and tests that import them from
it.

- :func:`parse_cron`: a 5-field crontab expression (minute hour day month weekday) in an IANA time zone
  (:func:`parse_timezone`), as a :class:`WallClockCronTrigger`: APScheduler's cron trigger, except that
  when clocks go back the repeated hour does not fire the same schedule twice.
- :func:`next_fire_times`: the next firings of an expression strictly after a moment, by the same
  trigger the scheduler uses (pure; DST changes included).
- :func:`check_overrides` and :func:`shipped_scenario_check`: a schedule's scenario overrides (finite
  numbers, the aim ``replicas`` / ``zones`` as lists of names, the ``load`` profile as a drill run takes
  it), and the default check that the scenario is one shipped in ``chaos.scenarios`` and takes them (the
  same ``Scenario.with_overrides`` a drill run goes through: a load's values are checked there, once).

Bad input raises :class:`InvalidSchedule` (a ``ValueError``; HTTP 400), whose message starts with the field
it is about (``cron: ...``, ``timezone: ...``, ``overrides.<name>: ...``, ``load.<name>: ...``,
``scenario_id: ...``).

The trigger is pickled into the APScheduler job store by class reference; the scheduler's job store
maps the names that job tables written by earlier releases use (``controlplane.schedules.scheduler``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger  # type: ignore[import-untyped]

from chaos.scenarios import SCENARIOS, scenario
from controlplane.errors import ControlPlaneError, Refused

CRON_FIELDS = 5
AIM_OVERRIDES = ("replicas", "zones")  # lists of names; a fault hits these (checked when the drill starts)
LOAD_OVERRIDE = "load"  # the load profile: {"kind": "rate", "rate": R} or {"kind": "trace", "trace": ...}
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")  # "load.trace: no trace file ..." names load.trace


# ---- errors ----------------------------------------------------------------------------------
class ScheduleError(ControlPlaneError):
    """A schedule operation was refused or failed."""


class InvalidSchedule(ScheduleError, Refused, ValueError):
    """Bad input: a cron expression, a time zone, a scenario, an override (HTTP 400)."""


# ---- values ----------------------------------------------------------------------------------
def parse_timezone(name: str) -> ZoneInfo:
    """An IANA time zone, or :class:`InvalidSchedule` naming the bad value."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidSchedule(f"timezone: unknown time zone {name!r} (use an IANA name such as "
                              "'Europe/Berlin' or 'UTC')") from exc


def parse_cron(expr: str, timezone: str) -> CronTrigger:
    """A 5-field crontab expression (minute hour day month weekday) in ``timezone``."""
    tz = parse_timezone(timezone)
    fields = expr.split()
    if len(fields) != CRON_FIELDS:
        raise InvalidSchedule(f"cron: expected 5 fields (minute hour day month weekday), got "
                              f"{len(fields)} in {expr!r}")
    try:
        base = CronTrigger.from_crontab(" ".join(fields), timezone=tz)
    except ValueError as exc:
        raise InvalidSchedule(f"cron: {exc}") from exc
    trigger = WallClockCronTrigger.__new__(WallClockCronTrigger)
    trigger.__setstate__(base.__getstate__())
    return trigger


class WallClockCronTrigger(CronTrigger):  # type: ignore[misc]
    """A cron trigger that fires once per wall-clock time: when clocks go back (Europe/Berlin's last
    Sunday of October), the repeated hour does not run the same drill twice."""

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
        nxt: datetime | None = super().get_next_fire_time(previous_fire_time, now)
        if nxt is None or previous_fire_time is None:
            return nxt
        if _wall(nxt, self.timezone) == _wall(previous_fire_time, self.timezone):
            nxt = super().get_next_fire_time(nxt, _just_after(nxt))
        return nxt


def _wall(moment: datetime, tz: Any) -> datetime:
    """The local wall-clock reading (naive, so both readings of a repeated hour compare equal)."""
    return moment.astimezone(UTC).astimezone(tz).replace(tzinfo=None)


def _just_after(moment: datetime) -> datetime:
    """One microsecond later in absolute time (aware arithmetic in a zone is wall-clock arithmetic and
    would land in the first reading of a repeated hour again)."""
    return moment.astimezone(UTC) + timedelta(microseconds=1)


def next_fire_times(cron: str, timezone: str, *, after: datetime, count: int = 5) -> list[datetime]:
    """The next ``count`` firings of ``cron`` in ``timezone`` strictly after ``after`` (pure)."""
    trigger = parse_cron(cron, timezone)
    times: list[datetime] = []
    previous: datetime | None = None
    now = _just_after(after)
    while len(times) < count:
        nxt = trigger.get_next_fire_time(previous, now)
        if nxt is None:
            break
        times.append(nxt)
        previous, now = nxt, _just_after(nxt)
    return times


def check_overrides(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """Overrides as the drill runner takes them: scenario field names (``rate``, ``duration_s``,
    ``targets.rto_service_s``, ...) to finite numbers, ``replicas`` / ``zones`` to lists of names
    (deduplicated; an empty list is no aim) and ``load`` to a profile object (``None`` values left out; a
    bare ``{"kind": "rate"}`` is the scenario's own Poisson load, so it is left out too). Which names a
    scenario accepts, and a load's values, are the scenario's own check (:func:`shipped_scenario_check`)."""
    out: dict[str, Any] = {}
    for name, value in (raw or {}).items():
        if not isinstance(name, str) or not name:
            raise InvalidSchedule("overrides: empty field name")
        if name in AIM_OVERRIDES:
            names = _names(name, value)
            if names:
                out[name] = names
        elif name == LOAD_OVERRIDE:
            load = _load(value)
            if load:
                out[name] = load
        elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidSchedule(f"overrides.{name}: must be a number, got {value!r}")
        else:
            out[name] = float(value)
    return out


def _names(name: str, value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence) or \
            not all(isinstance(v, str) and v.strip() for v in value):
        raise InvalidSchedule(f"overrides.{name}: expected a list of non-empty names, got {value!r}")
    return list(dict.fromkeys(v.strip() for v in value))


def _load(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidSchedule(f"load: expected an object with a kind ('rate' or 'trace'), got {value!r}")
    load = {k: v for k, v in value.items() if v is not None}
    for key, item in load.items():
        if not isinstance(item, str | int | float):
            raise InvalidSchedule(f"load.{key}: expected a name or a number, got {item!r}")
    return {} if load in ({}, {"kind": "rate"}) else load


def shipped_scenario_check(scenario_id: str, overrides: Mapping[str, Any]) -> None:
    """The default scenario check: a scenario shipped in ``chaos.scenarios`` that takes these overrides
    (a trace load's file is read here, as a drill run reads it)."""
    try:
        scenario(scenario_id).with_overrides(overrides)
    except KeyError as exc:
        raise InvalidSchedule(f"scenario_id: unknown scenario {scenario_id!r} (known: "
                              f"{', '.join(SCENARIOS)})") from exc
    except ValueError as exc:
        raise InvalidSchedule(override_message(str(exc))) from exc


def override_message(message: str) -> str:
    """A scenario's refusal as a schedule's: ``load.<name>: ...`` stays, ``<name>: ...`` becomes
    ``overrides.<name>: ...``."""
    named = _FIELD.match(message)
    if named is None:
        return f"overrides: {message}"
    return message if named.group(1).split(".")[0] == LOAD_OVERRIDE else f"overrides.{message}"
