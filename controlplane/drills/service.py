"""The drill service: one drill at a time, run in the background, its report kept in the store.

``DrillService.start(scenario_id, overrides) -> drill_id`` and ``DrillService.is_running()`` are the public
surface for schedules (call them on the control plane's event loop). Reports are JSON records of the store's
``drills`` collection (key: the scenario id); a report still ``running`` when the control plane starts was
cut short by a crash and is marked ``interrupted``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chaos.drills import DrillError, DrillRunner
from chaos.scenarios import scenario
from controlplane.drills.report import summary
from controlplane.store.database import Store

logger = logging.getLogger(__name__)

COLLECTION = "drills"
KEEP_REPORTS = 500


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


