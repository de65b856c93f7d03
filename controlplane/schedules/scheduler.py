"""Scheduled drills: cron expressions with a time zone that start drills, one drill at a time.

Where it sits: the control plane's loops (next to reconcile, autoscaler and alerts). A schedule fires on
its cron expression, asks the drill runner (``DrillStarter``: ``start(scenario_id, overrides)`` and
``is_running()``) to start its scenario, and writes one record per firing to the store's
``drill_schedule_runs`` collection: the drill id it started, or why it was skipped, or the error.

A schedule takes what a manual drill run takes: numeric overrides, an aim (``replicas``, ``zones``) and a
load profile (``load``: Poisson at a rate, or an Azure LLM trace replayed), all in its ``overrides`` and
passed to the runner as they are. They are checked against the scenario when the schedule is added or
edited; the aim is checked against the fleet when it fires (a replica gone by then makes that firing an
``error`` run whose reason names it, and the schedule goes on).

Persistence: APScheduler 3 with a SQLAlchemy job store in the control plane's own SQLite file (its own
table, so another APScheduler user of the file never runs our jobs). The job store is the one home of a
schedule: the job's id is the schedule id, its trigger the cron expression, its kwargs the rest of the
spec as plain JSON values, and a paused schedule is a job without a next run time. A restarted control
plane opens the same table and finds every schedule with its next run time; a firing missed while it was
down runs late when it is within ``misfire_grace_s`` (coalesced into one run) and is recorded as skipped
otherwise.

Persistent jobs must name their function by a textual reference, so every job calls the module-level
:func:`fire`, which finds the live :class:`DrillScheduler` by the schedule id in a process-wide registry.
A scheduler registers its schedules before it processes any job (it starts paused, registers, then
resumes) and unregisters them at shutdown.

Overlap: one drill at a time. A schedule that fires while a drill runs either records a skipped run
(``skip``) or waits, polling the runner, up to ``max_wait_s`` and starts when the running drill ends
(``wait``). Checking and starting happen under one lock, so two schedules never start two drills.

The values (the cron expression in its time zone, next fire times, overrides and the scenario check) are
in :mod:`controlplane.schedules.triggers`, the spec, the stored schedule and the run record in
:mod:`controlplane.schedules.spec`; their names are re-exported here. Job tables written before the
trigger and this module moved still load: the job store (:mod:`controlplane.schedules.jobstore`) maps the
old names.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol
from zoneinfo import ZoneInfo

from apscheduler.events import (  # type: ignore[import-untyped]
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    JobExecutionEvent,
    JobSubmissionEvent,
)
from apscheduler.executors.pool import ThreadPoolExecutor  # type: ignore[import-untyped]
from apscheduler.jobstores.base import JobLookupError  # type: ignore[import-untyped]

from controlplane.drills.config import DrillsConfig
from controlplane.errors import Conflict, NotFound
from controlplane.schedules.jobstore import FIRE_REF, JobStore, StoppableBackgroundScheduler, job_store_engine
from controlplane.schedules.spec import (
    DEFAULT_MAX_WAIT_S,
    DEFAULT_MISFIRE_GRACE_S,
    MAX_NAME_CHARS,
    OVERLAPS,
    Overlap,
    RunOutcome,
    Schedule,
    ScheduleRun,
    ScheduleSpec,
)
from controlplane.schedules.triggers import (
    AIM_OVERRIDES,
    CRON_FIELDS,
    LOAD_OVERRIDE,
    InvalidSchedule,
    ScheduleError,
    WallClockCronTrigger,
    check_overrides,
    next_fire_times,
    parse_cron,
    parse_timezone,
    shipped_scenario_check,
)
from controlplane.store.database import Store

log = logging.getLogger(__name__)

RUNS_COLLECTION = "drill_schedule_runs"
JOB_TABLE = "apscheduler_drill_schedules"  # not APScheduler's default table: other users of the file
DEFAULT_POLL_S = 1.0
DEFAULT_START_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 4  # firings that may wait for a running drill at the same time
KEEP_RUNS = 10_000  # newest run records kept across all schedules (a firing a minute: about a week)



# ---- errors ----------------------------------------------------------------------------------
class UnknownSchedule(ScheduleError, NotFound, KeyError):
    """No schedule has this id (HTTP 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown schedule"


class ScheduleConflict(ScheduleError, Conflict):
    """The request contradicts the schedule's state, such as a duplicate name (HTTP 409)."""


# ---- the drill runner, as the scheduler needs it ---------------------------------------------
class DrillStarter(Protocol):
    """What starts drills (``DrillService`` of ``controlplane.drills.service``); ``start`` may be async."""

    def start(self, scenario_id: str, overrides: Mapping[str, Any]) -> str | Awaitable[str]: ...

    def is_running(self) -> bool: ...


# ---- the live registry that fire() uses -----------------------------------------------------
_LIVE: dict[str, DrillScheduler] = {}
_LIVE_LOCK = threading.Lock()


def _register(schedule_id: str, scheduler: DrillScheduler) -> None:
    with _LIVE_LOCK:
        _LIVE[schedule_id] = scheduler


def _unregister(schedule_id: str, scheduler: DrillScheduler) -> None:
    with _LIVE_LOCK:
        if _LIVE.get(schedule_id) is scheduler:
            del _LIVE[schedule_id]


def fire(schedule_id: str, **spec: Any) -> None:
    """The job function of every schedule (APScheduler keeps it as
    ``controlplane.schedules.scheduler:fire``)."""
    with _LIVE_LOCK:
        scheduler = _LIVE.get(schedule_id)
    if scheduler is None:
        log.error("schedule=%s fired but no live drill scheduler holds it; nothing started", schedule_id)
        return
    scheduler.run_once(schedule_id, spec)


# ---- the scheduler ---------------------------------------------------------------------------
class DrillScheduler:
    """Cron schedules of drills, kept in the store's SQLite file, fired on a background thread."""

    def __init__(self, store: Store, starter: DrillStarter | None, *,
                 check_scenario: Callable[[str, Mapping[str, Any]], None] = shipped_scenario_check,
                 loop: asyncio.AbstractEventLoop | None = None,
                 default_timezone: str = "UTC", default_overlap: Overlap = "skip",
                 default_max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 default_misfire_grace_s: float = DEFAULT_MISFIRE_GRACE_S,
                 poll_s: float = DEFAULT_POLL_S, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 workers: int = DEFAULT_WORKERS, clock: Callable[[], float] = time.time) -> None:
        parse_timezone(default_timezone)
        if default_overlap not in OVERLAPS:
            raise InvalidSchedule(f"default overlap must be one of {', '.join(OVERLAPS)}")
        self.store = store
        self.starter = starter
        self.check_scenario = check_scenario
        self.loop = loop
        self.default_timezone, self.default_overlap = default_timezone, default_overlap
        self.default_max_wait_s, self.default_misfire_grace_s = default_max_wait_s, default_misfire_grace_s
        self.poll_s = poll_s
        self.start_timeout_s = start_timeout_s
        self._clock = clock
        self._start_lock = threading.Lock()  # "is a drill running?" and "start one" happen as one step
        self._edit_lock = threading.Lock()
        self._stopping = threading.Event()
        self._in_flight = 0
        self._in_flight_cv = threading.Condition()
        self._ids: set[str] = set()
        self._aps = StoppableBackgroundScheduler(
            jobstores={"default": JobStore(engine=job_store_engine(store), tablename=JOB_TABLE)},
            executors={"default": ThreadPoolExecutor(max_workers=workers)},
            job_defaults={"max_instances": 1}, timezone=UTC)
        self._aps.add_listener(self._on_missed, EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Open the job table, register every stored schedule, then start firing (late ones first)."""
        self._aps.start(paused=True)
        for job in self._aps.get_jobs():
            self._track(job.id)
        self._aps.resume()
        log.info("drill scheduler started with %d schedules", len(self._ids))

    def shutdown(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
        """Stop firing; firings that wait for a running drill give up. Waits at most ``timeout_s`` for
        firings in progress; True when none was left."""
        self._stopping.set()
        if self._aps.running:
            self._aps.shutdown(wait=False)
        for schedule_id in list(self._ids):
            _unregister(schedule_id, self)
        self._ids.clear()
        deadline = time.monotonic() + timeout_s
        with self._in_flight_cv:
            while self._in_flight and time.monotonic() < deadline:
                self._in_flight_cv.wait(max(deadline - time.monotonic(), 0.0))
            idle = self._in_flight == 0
        if not idle:
            log.warning("drill scheduler stopped with %d firings still in progress", self._in_flight)
        return idle

    # -- schedules -----------------------------------------------------------------------------
    def spec(self, *, name: str, scenario_id: str, cron: str, timezone: str | None = None,
             overrides: Mapping[str, Any] | None = None, overlap: str | None = None,
             max_wait_s: float | None = None, misfire_grace_s: float | None = None,
             coalesce: bool = True, replicas: list[str] | None = None, zones: list[str] | None = None,
             load: Mapping[str, Any] | None = None) -> ScheduleSpec:
        """A validated spec, with this control plane's defaults where a value is not given. ``replicas``,
        ``zones`` and ``load`` (as a drill run takes them) join ``overrides``."""
        aim = {k: v for k, v in ((AIM_OVERRIDES[0], replicas), (AIM_OVERRIDES[1], zones),
                                 (LOAD_OVERRIDE, load)) if v is not None}
        return ScheduleSpec(
            name=name, scenario_id=scenario_id, cron=cron, timezone=timezone or self.default_timezone,
            overrides={**(overrides or {}), **aim},
            overlap=overlap or self.default_overlap,  # type: ignore[arg-type]  # ScheduleSpec validates it
            max_wait_s=float(self.default_max_wait_s if max_wait_s is None else max_wait_s),
            misfire_grace_s=float(self.default_misfire_grace_s if misfire_grace_s is None
                                  else misfire_grace_s),
            coalesce=coalesce)

    def add(self, spec: ScheduleSpec, *, created_by: str = "") -> Schedule:
        self._check_scenario(spec)
        schedule_id = f"sch-{uuid.uuid4().hex[:12]}"
        with self._edit_lock:
            self._check_name(spec.name, schedule_id)
            kwargs = {**spec.as_kwargs(), "created_at": self._clock(), "created_by": created_by}
            trigger = parse_cron(spec.cron, spec.timezone)
            job = self._aps.add_job(FIRE_REF, trigger=trigger, args=[schedule_id], kwargs=kwargs,
                                    id=schedule_id, name=spec.name,
                                    misfire_grace_time=int(spec.misfire_grace_s), coalesce=spec.coalesce)
            self._track(schedule_id)
        log.info("schedule=%s added: %s %r (%s) scenario=%s", schedule_id, spec.name, spec.cron,
                 spec.timezone, spec.scenario_id)
        return _schedule(job)

    def edit(self, schedule_id: str, **changes: Any) -> Schedule:
        """Change fields of a schedule (those of :meth:`spec`); a paused schedule stays paused. New
        ``overrides`` replace the numbers and keep the aim and load; ``replicas``, ``zones`` and ``load``
        replace those (``[]`` and ``{"kind": "rate"}`` go back to the scenario's own)."""
        with self._edit_lock:
            current = self.get(schedule_id)
            merged = dataclasses.asdict(current.spec)
            merged.update({k: v for k, v in changes.items() if v is not None})
            merged["overrides"] = _edited_overrides(current.spec.overrides, changes.get("overrides"))
            spec = self.spec(**merged)
            self._check_scenario(spec)
            self._check_name(spec.name, schedule_id)
            kwargs = {**spec.as_kwargs(), "created_at": current.created_at, "created_by": current.created_by}
            trigger = parse_cron(spec.cron, spec.timezone)
            moved: dict[str, Any] = {"trigger": trigger}
            if not current.paused:
                moved["next_run_time"] = trigger.get_next_fire_time(None, datetime.now(UTC))
            job = self._aps.modify_job(schedule_id, kwargs=kwargs, name=spec.name,
                                       misfire_grace_time=int(spec.misfire_grace_s), coalesce=spec.coalesce,
                                       **moved)
        log.info("schedule=%s edited: %s", schedule_id, ", ".join(sorted(changes)))
        return _schedule(job)

    def pause(self, schedule_id: str) -> Schedule:
        return _schedule(self._job_op(schedule_id, self._aps.pause_job))

    def resume(self, schedule_id: str) -> Schedule:
        return _schedule(self._job_op(schedule_id, self._aps.resume_job))

    def delete(self, schedule_id: str) -> None:
        """Forget a schedule; its run history stays."""
        with self._edit_lock:
            self._job_op(schedule_id, self._aps.remove_job)
            _unregister(schedule_id, self)
            self._ids.discard(schedule_id)
        log.info("schedule=%s deleted", schedule_id)

    def run_now(self, schedule_id: str) -> Schedule:
        """Fire a schedule at once (its cron continues afterwards); a paused schedule is refused."""
        if self.get(schedule_id).paused:
            raise ScheduleConflict(f"schedule {schedule_id} is paused; resume it first")
        return _schedule(self._job_op(schedule_id, lambda i: self._aps.modify_job(
            i, next_run_time=datetime.now(UTC))))

    def get(self, schedule_id: str) -> Schedule:
        job = self._aps.get_job(schedule_id)
        if job is None:
            raise UnknownSchedule(f"no schedule with id {schedule_id!r}")
        return _schedule(job)

    def schedules(self) -> list[Schedule]:
        """Every schedule, the next to fire first (paused ones last)."""
        return [_schedule(job) for job in self._aps.get_jobs()]

    def runs(self, schedule_id: str, *, limit: int = 100) -> list[ScheduleRun]:
        """A schedule's firings, newest first (also after the schedule was deleted)."""
        records = self.store.records(RUNS_COLLECTION, key=schedule_id, limit=limit)
        if not records and self._aps.get_job(schedule_id) is None:
            raise UnknownSchedule(f"no schedule with id {schedule_id!r}")
        return [_run(r.id, r.body) for r in records]

    # -- firing --------------------------------------------------------------------------------
    def run_once(self, schedule_id: str, spec: Mapping[str, Any]) -> ScheduleRun:
        """One firing: start the scenario, or skip or wait by the overlap policy; always recorded."""
        with self._in_flight_cv:
            self._in_flight += 1
        try:
            run = self._attempt(schedule_id, spec)
        except Exception as exc:  # a firing's failure is a value in its history, never a lost thread
            log.exception("schedule=%s firing failed", schedule_id)
            run = ScheduleRun(schedule_id, "error", self._clock(), str(spec.get("scenario_id", "")),
                              reason=f"{type(exc).__name__}: {exc}")
        finally:
            with self._in_flight_cv:
                self._in_flight -= 1
                self._in_flight_cv.notify_all()
        return self._record(run)

    def _attempt(self, schedule_id: str, spec: Mapping[str, Any]) -> ScheduleRun:
        fired_at, began = self._clock(), time.monotonic()
        scenario = str(spec["scenario_id"])
        overlap, max_wait_s = spec.get("overlap", "skip"), float(spec.get("max_wait_s", 0.0))
        starter = self.starter
        if starter is None:
            return ScheduleRun(schedule_id, "error", fired_at, scenario,
                               reason="no drill runner in this control plane")
        while True:
            with self._start_lock:
                if not starter.is_running():
                    try:
                        drill_id = self._start(starter, scenario, dict(spec.get("overrides") or {}))
                    except (KeyError, ValueError) as exc:  # such as an aim no longer in the fleet
                        reason = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
                        log.warning("schedule=%s: the drill runner refused it: %s", schedule_id, reason)
                        return ScheduleRun(schedule_id, "error", fired_at, scenario,
                                           reason=f"the drill runner refused it: {reason}")
                    log.info("schedule=%s started drill=%s scenario=%s", schedule_id, drill_id, scenario)
                    return ScheduleRun(schedule_id, "started", fired_at, scenario, drill_id=drill_id,
                                       waited_s=round(time.monotonic() - began, 3))
            waited = time.monotonic() - began
            if overlap != "wait":
                return ScheduleRun(schedule_id, "skipped", fired_at, scenario,
                                   reason="another drill is running (overlap policy: skip)")
            if waited >= max_wait_s:
                return ScheduleRun(schedule_id, "skipped", fired_at, scenario, waited_s=round(waited, 3),
                                   reason=f"another drill still running after waiting {waited:.0f}s "
                                          f"(overlap policy: wait, max_wait_s={max_wait_s:g})")
            if self._stopping.wait(min(self.poll_s, max_wait_s - waited)):
                return ScheduleRun(schedule_id, "skipped", fired_at, scenario, waited_s=round(waited, 3),
                                   reason="control plane stopping while waiting for the running drill")

    def _start(self, starter: DrillStarter, scenario_id: str, overrides: dict[str, Any]) -> str:
        result = starter.start(scenario_id, overrides)
        if inspect.isawaitable(result):
            if self.loop is None:
                raise ScheduleError("the drill runner is async but the scheduler has no event loop")
            future = asyncio.run_coroutine_threadsafe(_awaited(result), self.loop)
            result = future.result(timeout=self.start_timeout_s)
        return str(result)

    def _record(self, run: ScheduleRun) -> ScheduleRun:
        record = self.store.add_record(RUNS_COLLECTION, run.body(), key=run.schedule_id)
        self.store.trim_records(RUNS_COLLECTION, KEEP_RUNS)
        return dataclasses.replace(run, record_id=record.id)

    def _on_missed(self, event: JobExecutionEvent | JobSubmissionEvent) -> None:
        """APScheduler's listener: firings it did not run become skipped runs in the history."""
        if event.code == EVENT_JOB_MISSED:
            when = event.scheduled_run_time
            reason = (f"missed the firing at {when.isoformat()}: more than misfire_grace_s late "
                      "(control plane down or busy)")
        else:
            reason = "the previous firing of this schedule is still in progress (waiting or starting a drill)"
        job = self._aps.get_job(event.job_id) if self._aps.running else None
        scenario = str(job.kwargs.get("scenario_id", "")) if job is not None else ""
        log.warning("schedule=%s skipped: %s", event.job_id, reason)
        with contextlib.suppress(Exception):  # a listener must not break the scheduler thread
            self._record(ScheduleRun(event.job_id, "skipped", self._clock(), scenario, reason=reason))

    # -- helpers -------------------------------------------------------------------------------
    def _track(self, schedule_id: str) -> None:
        self._ids.add(schedule_id)
        _register(schedule_id, self)

    def _check_scenario(self, spec: ScheduleSpec) -> None:
        try:
            self.check_scenario(spec.scenario_id, spec.overrides)
        except InvalidSchedule:
            raise
        except (KeyError, ValueError) as exc:
            raise InvalidSchedule(f"scenario_id: {exc.args[0] if exc.args else exc}") from exc

    def _check_name(self, name: str, schedule_id: str) -> None:
        for other in self._aps.get_jobs():
            if other.name == name and other.id != schedule_id:
                raise ScheduleConflict(f"a schedule named {name!r} exists already ({other.id})")

    def _job_op(self, schedule_id: str, op: Callable[[str], Any]) -> Any:
        try:
            return op(schedule_id)
        except JobLookupError as exc:
            raise UnknownSchedule(f"no schedule with id {schedule_id!r}") from exc


async def _awaited(result: Awaitable[Any]) -> Any:
    return await result


def _edited_overrides(current: Mapping[str, Any], new: Mapping[str, Any] | None) -> dict[str, Any]:
    """An edit's ``overrides``: new numbers replace the old ones; the aim and load stay unless named."""
    if new is None:
        return dict(current)
    kept = {k: v for k, v in current.items() if k in (*AIM_OVERRIDES, LOAD_OVERRIDE)}
    return {**kept, **new}


def _schedule(job: Any) -> Schedule:
    spec = ScheduleSpec.from_job(job.kwargs, misfire_grace_s=float(job.misfire_grace_time or 1),
                                 coalesce=bool(job.coalesce))
    next_run = job.next_run_time
    if next_run is not None:
        next_run = next_run.astimezone(UTC).astimezone(ZoneInfo(spec.timezone))  # via UTC: a real wall time
    return Schedule(job.id, spec, next_run, float(job.kwargs.get("created_at", 0.0)),
                    str(job.kwargs.get("created_by", "")))


def _run(record_id: int, body: Mapping[str, Any]) -> ScheduleRun:
    return ScheduleRun(schedule_id=body["schedule_id"], outcome=body["outcome"], fired_at=body["fired_at"],
                       scenario_id=body.get("scenario_id", ""), drill_id=body.get("drill_id"),
                       reason=body.get("reason", ""), waited_s=body.get("waited_s", 0.0), record_id=record_id)


@contextlib.contextmanager
def running(scheduler: DrillScheduler,
            timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> Iterator[DrillScheduler]:
    """Start ``scheduler`` for the block and shut it down after (tests, scripts)."""
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.shutdown(timeout_s)


def drill_scheduler(cfg: DrillsConfig, store: Store, starter: DrillStarter | None, *,
                    loop: asyncio.AbstractEventLoop | None = None) -> DrillScheduler:
    """The control plane's scheduler, with the defaults of the ``[drills]`` config section."""
    return DrillScheduler(store, starter, loop=loop, default_timezone=cfg.schedule_timezone,
                          default_overlap=cfg.schedule_overlap,  # type: ignore[arg-type]  # config validated
                          default_max_wait_s=cfg.schedule_max_wait_s,
                          default_misfire_grace_s=cfg.schedule_misfire_grace_s)


__all__ = ["AIM_OVERRIDES", "CRON_FIELDS", "DEFAULT_MAX_WAIT_S", "DEFAULT_MISFIRE_GRACE_S",
           "DEFAULT_POLL_S", "DEFAULT_SHUTDOWN_TIMEOUT_S", "DEFAULT_START_TIMEOUT_S", "DEFAULT_WORKERS",
           "FIRE_REF", "JOB_TABLE", "KEEP_RUNS", "LOAD_OVERRIDE", "MAX_NAME_CHARS", "OVERLAPS",
           "RUNS_COLLECTION", "DrillScheduler", "DrillStarter", "InvalidSchedule", "Overlap", "RunOutcome",
           "Schedule", "ScheduleConflict", "ScheduleError", "ScheduleRun", "ScheduleSpec",
           "UnknownSchedule", "WallClockCronTrigger", "check_overrides", "drill_scheduler", "fire",
           "next_fire_times", "parse_cron", "parse_timezone", "running", "shipped_scenario_check"]
