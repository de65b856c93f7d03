"""The drill service: one drill at a time, run in the background, its report kept in the store.

``DrillService.start(scenario_id, overrides) -> drill_id`` and ``DrillService.is_running()`` are the public
surface for schedules (call them on the control plane's event loop). Reports are JSON records of the store's
``drills`` collection (key: the scenario id); a report still ``running`` when the control plane starts was
cut short by a crash and is marked ``interrupted``, unless its runner lives outside the control plane and
still runs (the control-plane-crash drill: :mod:`controlplane.drills.crash`, which kills this process on
purpose, runs in a process of its own with a token issued for it, and sends its report through the API).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from chaos.drills import DrillBusy, DrillError, DrillRunner
from chaos.scenarios import Scenario, scenario
from controlplane.auth import Role, TokenAuthority
from controlplane.drills.crash import CrashOrder, spawn
from controlplane.drills.report import summary
from controlplane.errors import Conflict, NotFound
from controlplane.store.database import Store

logger = logging.getLogger(__name__)

COLLECTION = "drills"
KEEP_REPORTS = 500
EXTERNAL = "control-plane-crash"  # the scenario whose runner lives outside the control plane
EXTERNAL_TOKEN_SLACK_S = 600.0  # the runner's token outlives the drill's own deadlines by this much


class DrillService:
    """One drill at a time, in the background; reports in the store."""

    def __init__(self, runner: DrillRunner, store: Store, state_dir: Path, *,
                 loop: asyncio.AbstractEventLoop | None = None, api_url: str | None = None) -> None:
        self.runner, self.store, self.state_dir = runner, store, state_dir
        self.api_url = api_url  # where an external runner reaches this control plane (None: not possible)
        self._loop = loop  # where drills run; start() from another thread hops onto it
        self._task: asyncio.Task[None] | None = None
        self._running_id: int | None = None
        self._external: tuple[int, int] | None = None  # (drill id, runner pid) of an external run
        self._progress: dict[str, Any] = {}
        self._abort = asyncio.Event()

    def is_running(self) -> bool:
        """Whether a drill is running now (a second ``start`` would raise DrillBusy)."""
        return (self._task is not None and not self._task.done()) or self._external_running() is not None

    @property
    def running_id(self) -> int | None:
        external = self._external_running()
        return external if external is not None else self._running_here()

    def _running_here(self) -> int | None:
        """The drill this process runs now (not one handed to an external runner)."""
        return self._running_id if self._task is not None and not self._task.done() else None

    def _external_running(self) -> int | None:
        if self._external is None:
            return None
        drill_id, pid = self._external
        record = self.store.record(drill_id, COLLECTION)
        if record is not None and record.body.get("status") == "running" and _is_runner(pid):
            return drill_id
        self._external = None
        return None

    def mark_interrupted(self) -> int:
        """Reports left ``running`` by a control plane that died mid-drill become ``interrupted``; a run
        whose runner lives outside the control plane and still runs is adopted instead."""
        stale = [r for r in self.store.records(COLLECTION, limit=KEEP_REPORTS)
                 if r.body.get("status") == "running"]
        interrupted = 0
        for r in stale:
            pid = r.body.get("runner_pid")
            if r.body.get("runner") == "external" and isinstance(pid, int) and _is_runner(pid):
                self._external = (r.id, pid)
                logger.warning("drill %d: its runner (pid %d) still runs outside the control plane", r.id,
                               pid)
                continue
            self.store.update_record(r.id, {**r.body, "status": "interrupted",
                                            "error": "the control plane stopped during the drill"})
            interrupted += 1
        return interrupted

    def plan(self, scenario_id: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The dry run: KeyError for an unknown scenario, ValueError for a bad override, selector or aim
        (a replica or zone not in the fleet)."""
        return self.runner.plan(scenario(scenario_id).with_overrides(overrides or {}))

    def start(self, scenario_id: str, overrides: Mapping[str, Any] | None = None) -> str:
        """Start a drill in the background and return its id (the report's record id, as text) at once.

        Callable on the control plane's event loop or from any other thread (a scheduler's worker: the
        start then runs on the loop and this call waits for it). KeyError: unknown scenario; ValueError:
        bad override; DrillBusy: one is running already.
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
            raise DrillBusy(f"drill {self._running_id} is running; one drill at a time",
                            subject=str(self._running_id))
        record = self.store.add_record(COLLECTION, {"scenario": sc.id, "title": sc.title, "status": "running",
                                                    "started_at": time.time(), "config": sc.describe(),
                                                    "overrides": dict(overrides or {}),
                                                    "targets_requested": {"replicas": list(sc.replicas),
                                                                          "zones": list(sc.zones)}},
                                       key=sc.id)
        if sc.action == EXTERNAL:
            self._start_external(record.id, sc, dict(overrides or {}))
            self.store.trim_records(COLLECTION, KEEP_REPORTS)
            return record.id
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

    def _start_external(self, drill_id: int, sc: Scenario, overrides: dict[str, Any]) -> None:
        """Hand the drill to a runner in its own process, with an operator token of its own."""
        if self.api_url is None:
            self.store.update_record(drill_id, {**self._body(drill_id), "status": "error",
                                                "error": "this control plane cannot run external drills"})
            raise DrillError(f"{sc.id}: this control plane has no API address to give the runner")
        ttl = sc.duration_s + sc.outage_s + sc.capacity_deadline_s + EXTERNAL_TOKEN_SLACK_S
        token = TokenAuthority(self.store).issue(f"drill-{drill_id}", Role.OPERATOR, ttl_s=ttl)
        me = psutil.Process()
        workdir = self.state_dir / "drills" / str(drill_id)
        order = CrashOrder(drill_id=drill_id, api=self.api_url, gateway=self.runner.port.gateway_url,
                           token=token, overrides=overrides, controlplane_pid=os.getpid(),
                           command=me.cmdline(), cwd=os.getcwd(), state_dir=str(self.state_dir),
                           workdir=str(workdir))
        pid = spawn(order, log=workdir / "runner.log")
        self._external = (drill_id, pid)
        self.store.update_record(drill_id, {**self._body(drill_id), "runner": "external", "runner_pid": pid})
        logger.warning("drill %d: %s handed to its runner, pid %d (it will kill this process)", drill_id,
                       sc.id, pid)

    def external_report(self, drill_id: int, report: Mapping[str, Any]) -> dict[str, Any]:
        """The report (or progress) of a drill whose runner lives outside the control plane."""
        record = self.store.record(drill_id, COLLECTION)
        if record is None:
            raise NotFound(f"no drill {drill_id}", subject=str(drill_id))
        if record.body.get("runner") != "external" or record.body.get("status") != "running":
            raise Conflict(f"drill {drill_id} takes no report from outside (status "
                           f"{record.body.get('status')})", subject=str(drill_id))
        body = {**record.body, **report, "id": drill_id, "runner": "external",
                "runner_pid": record.body.get("runner_pid")}
        self.store.update_record(drill_id, body)
        if body.get("status") != "running":
            TokenAuthority(self.store).revoke(f"drill-{drill_id}")
            self._external = None
            logger.info("drill %d: %s %s", drill_id, body.get("scenario"), body.get("status"))
        return body

    def _body(self, drill_id: int) -> dict[str, Any]:
        record = self.store.record(drill_id, COLLECTION)
        return dict(record.body) if record is not None else {}

    def abort(self, drill_id: int) -> bool:
        if self._external_running() == drill_id:
            return False  # it is killing the control plane: nothing here can stop it half-way
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
        if self._running_here() == drill_id:  # an external runner keeps its progress in the record
            body["progress"] = dict(self._progress)
        return body

    def list(self, limit: int = 50) -> list[dict[str, Any]]:
        out = []
        for r in self.store.records(COLLECTION, limit=limit):
            body = {**r.body, "id": r.id}
            if self._running_here() == r.id:
                body["progress"] = dict(self._progress)
            out.append(summary(body))
        return out


def _is_runner(pid: int) -> bool:
    try:
        return "controlplane.drills.crash" in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
