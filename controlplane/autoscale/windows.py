"""Cron windows for the autoscaler: while a window is active, it sets the fleet's replica bounds.

A window starts at every fire time of its cron expression (APScheduler 3.x ``CronTrigger``, in the
window's time zone, daylight saving included) and lasts ``duration_s`` or until the next fire time of its
``end_cron``. The autoscaler asks :func:`active_window` at each tick; the configuration loader asks
:func:`window_problems`, which rejects bad expressions and windows that overlap (naming both).

Cron expressions use the standard numbering (weekday 0 or 7 is Sunday, 1 Monday); APScheduler's own
numbering starts the week on Monday, so numbers are translated to names before it sees them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from apscheduler.triggers.cron import CronTrigger  # type: ignore[import-untyped]

from controlplane.autoscale.config import AutoscalerConfig, ScheduleWindowConfig

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_CRON_DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat", "sun")  # standard cron: 0 and 7 Sunday
OVERLAP_HORIZON = timedelta(days=366)  # overlaps are looked for over a year of starts ...
OVERLAP_MAX_STARTS = 5000  # ... or this many starts per window, whichever comes first
_ONE_US = timedelta(microseconds=1)


@dataclass(slots=True, frozen=True)
class Window:
    """A parsed window; ``start`` and ``end`` are its triggers."""

    name: str
    start: CronTrigger
    end: CronTrigger | None
    duration: timedelta | None
    min_replicas: int | None
    max_replicas: int | None
    describe: str  # for decision records: "cron '0 8 * * 1-5' Europe/Berlin for 36000s"

    def is_active(self, at: datetime) -> bool:
        """Whether ``at`` (timezone-aware) falls inside one of this window's spans."""
        if self.duration is not None:
            # Active iff a start fired in (at - duration, at].
            first = self.start.get_next_fire_time(None, at - self.duration + _ONE_US)
            return first is not None and first <= at
        assert self.end is not None
        # Active iff the next event after ``at`` is an end rather than a start.
        next_end = self.end.get_next_fire_time(None, at + _ONE_US)
        next_start = self.start.get_next_fire_time(None, at + _ONE_US)
        if next_end is None:
            return False
        return next_start is None or next_end < next_start

    def bounds(self, low: int, high: int) -> tuple[int, int]:
        """The replica bounds while active: the window's own, else the autoscaler's."""
        return (low if self.min_replicas is None else self.min_replicas,
                high if self.max_replicas is None else self.max_replicas)


def parse_window(cfg: ScheduleWindowConfig) -> Window:
    """A :class:`Window`, or ``ValueError`` naming the field and the reason."""
    if not cfg.name:
        raise ValueError("name: required")
    if (cfg.duration_s > 0) == bool(cfg.end_cron):
        raise ValueError(f"window {cfg.name!r}: give either duration_s > 0 or end_cron")
    for day in cfg.weekdays:
        if day.lower() not in WEEKDAYS:
            raise ValueError(f"window {cfg.name!r}: weekdays: {day!r} is not one of {', '.join(WEEKDAYS)}")
    for key in ("min_replicas", "max_replicas"):
        value = getattr(cfg, key)
        if value is not None and value < 0:
            raise ValueError(f"window {cfg.name!r}: {key}: must be >= 0, got {value}")
    if cfg.min_replicas is not None and cfg.max_replicas is not None and cfg.min_replicas > cfg.max_replicas:
        raise ValueError(f"window {cfg.name!r}: min_replicas {cfg.min_replicas} > max_replicas "
                         f"{cfg.max_replicas}")
    start = _trigger(cfg.cron, cfg.timezone, cfg.weekdays, f"window {cfg.name!r}: cron")
    end = _trigger(cfg.end_cron, cfg.timezone, cfg.weekdays, f"window {cfg.name!r}: end_cron") \
        if cfg.end_cron else None
    days = f" on {','.join(cfg.weekdays)}" if cfg.weekdays else ""
    span = f"until '{cfg.end_cron}'" if cfg.end_cron else f"for {cfg.duration_s:g}s"
    return Window(cfg.name, start, end, timedelta(seconds=cfg.duration_s) if cfg.duration_s > 0 else None,
                  cfg.min_replicas, cfg.max_replicas, f"cron '{cfg.cron}'{days} {cfg.timezone} {span}")


def _trigger(expr: str, tz: str, weekdays: Sequence[str], what: str) -> CronTrigger:
    fields = expr.split()
    if len(fields) != 5:
        raise ValueError(f"{what}: {expr!r} must have 5 fields (minute hour day month weekday)")
    minute, hour, day, month, dow = fields
    if weekdays:
        if dow != "*":
            raise ValueError(f"{what}: give the weekdays either in the cron expression or in weekdays")
        dow = ",".join(d.lower() for d in weekdays)
    try:
        return CronTrigger(minute=minute, hour=hour, day=day, month=month, day_of_week=_named_days(dow),
                           timezone=tz)
    except (ValueError, LookupError) as exc:  # a bad field, or an unknown time zone
        raise ValueError(f"{what}: {expr!r} in {tz!r}: {exc}") from exc


def _named_days(field: str) -> str:
    """Standard cron weekday numbers (0/7 Sunday) as names, which APScheduler reads unambiguously."""
    def name(match: re.Match[str]) -> str:
        number = int(match.group(0))
        if number > 7:
            raise ValueError(f"weekday {number} is not in 0-7")
        return _CRON_DAY_NAMES[number]

    parts = []
    for part in field.split(","):
        base, slash, step = part.partition("/")
        if base.startswith("0-"):  # Sunday first: "0-2" is sun plus mon-tue
            tail = re.sub(r"\d+", name, base[2:])
            parts.append("sun" if tail == "sun" else f"sun,mon-{tail}")
            continue
        parts.append(re.sub(r"\d+", name, base) + (f"{slash}{step}" if slash else ""))
    return ",".join(parts)


def parse_windows(cfgs: Sequence[ScheduleWindowConfig], *,
                  now: datetime | None = None) -> list[Window]:
    """Every window parsed, or ``ValueError`` for the first bad one or the first overlapping pair."""
    windows = [parse_window(c) for c in cfgs]
    names = [w.name for w in windows]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"window {name!r}: defined twice")
    start = now or datetime.now(UTC)
    for i, a in enumerate(windows):
        for b in windows[i + 1:]:
            when = _overlap(a, b, start) or _overlap(b, a, start)
            if when is not None:
                raise ValueError(f"windows {a.name!r} and {b.name!r} overlap (both active at "
                                 f"{when.isoformat()})")
    return windows


def _overlap(a: Window, b: Window, since: datetime) -> datetime | None:
    """The first start of ``a`` within the horizon at which ``b`` is active (two spans overlap iff one
    starts inside the other)."""
    at: datetime | None = since
    for _ in range(OVERLAP_MAX_STARTS):
        fired: datetime | None = a.start.get_next_fire_time(None, at)
        at = fired
        if at is None or at > since + OVERLAP_HORIZON:
            return None
        if b.is_active(at):
            return at
        at = at + _ONE_US
    return None


def active_window(windows: Sequence[Window], at: datetime) -> Window | None:
    """The window active at ``at``; windows never overlap, so there is at most one."""
    return next((w for w in windows if w.is_active(at)), None)


def window_problems(cfg: AutoscalerConfig) -> list[tuple[str, str]]:
    """(key, reason) for the configuration loader: bad windows, overlaps, bounds outside the fleet's."""
    try:
        windows = parse_windows(cfg.windows)
    except ValueError as exc:
        return [("windows", str(exc))]
    problems = []
    for w in windows:
        low, high = w.bounds(cfg.min_replicas, cfg.max_replicas)
        if low > high:
            problems.append(("windows", f"window {w.name!r}: bounds {low}..{high} are empty (min > max once "
                                        "combined with autoscaler.min_replicas/max_replicas)"))
    return problems
