"""The drills' section of the configuration (``[drills]``): defaults of scheduled drills."""

from __future__ import annotations

import zoneinfo
from dataclasses import dataclass


@dataclass(slots=True)
class DrillsConfig:
    """Failover drills (``chaos.drills``) and their schedules."""

    schedule_timezone: str = "UTC"
    # Scheduled drills (controlplane.schedules.scheduler): a schedule's defaults when it does not set its own.
    schedule_overlap: str = "skip"  # a drill is already running: skip (record it) or wait for it to end
    schedule_max_wait_s: float = 1800.0  # overlap wait: give up and record a skip after this long
    schedule_misfire_grace_s: float = 300.0  # a firing missed while down still runs within this (whole s)
    schedule_shutdown_timeout_s: float = 5.0  # at stop, wait this long at most for firings in progress


def drills_problems(cfg: DrillsConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[drills]``."""
    problems: list[tuple[str, str]] = []
    try:
        zoneinfo.ZoneInfo(cfg.schedule_timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        problems.append(("drills.schedule_timezone", f"unknown time zone {cfg.schedule_timezone!r}"))
    if cfg.schedule_overlap not in ("skip", "wait"):
        problems.append(("drills.schedule_overlap", f"must be skip or wait, got {cfg.schedule_overlap!r}"))
    if cfg.schedule_max_wait_s < 0:
        problems.append(("drills.schedule_max_wait_s", "must be >= 0"))
    if cfg.schedule_misfire_grace_s < 1 or cfg.schedule_misfire_grace_s != int(cfg.schedule_misfire_grace_s):
        problems.append(("drills.schedule_misfire_grace_s", "must be a whole number of seconds >= 1"))
    if cfg.schedule_shutdown_timeout_s < 0:
        problems.append(("drills.schedule_shutdown_timeout_s", "must be >= 0"))
    return problems
