"""What-if runs of autoscaling policies in the fleet simulator, over REST.

``POST /api/v1/simulate`` answers with the result when the run is done. ``POST /api/v1/simulations`` starts
the same run as a background job (202 with its id) whose progress (the fraction of all policies' runs done,
and the policy simulated now) ``GET /api/v1/simulations/{id}`` reports, with the result once it is done;
the console follows it with a progress bar. Jobs are JSON records of the store's ``simulations`` collection
(the newest ``KEEP_JOBS`` kept, results included); a job still ``running`` when the API starts was cut short
by the process stopping and is shown as ``interrupted``.

A run changes nothing in the fleet, but it is CPU work on the control plane's host: starting one needs an
operator token, is audited (``simulate.run`` for its outcome, ``simulate.start`` for a job's start), runs
in a worker process at batch CPU priority (:mod:`controlplane.sim.what_if`, ``[simulator] cpu_priority``:
nothing serving waits for it, and it shares no interpreter lock with the API), one run at a time across
both endpoints (a second one gets 409), on a bounded trace (at most ``MAX_REQUESTS`` requests and
``MAX_DURATION_S`` simulated seconds). The trace is the seeded synthetic bursty one, the Azure trace
(``azure``: the one shipped with the load client, or ``$CONTROLPLANE_AZURE_TRACE`` on the server), or
requests sent inline.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from fastapi import APIRouter, Depends, Query

from controlplane.api.guards import require
from controlplane.auth import Auditor, Principal, Role
from controlplane.errors import Conflict, NotFound, Refused
from controlplane.sim.what_if import SimulateRequest, run_what_if_process
from controlplane.store.database import Store, StoreError

logger = logging.getLogger(__name__)

COLLECTION = "simulations"
KEEP_JOBS = 50  # job records kept, results included (4 policies on a 4-hour trace: about 0.5 MB each)
LIST_LIMIT = 20
INTERRUPTED = "the control plane stopped during the simulation"

BUSY = "a simulation is already running{running}; try again when it has finished"


class SimulationJobs:
    """What-if runs as background jobs, one run at a time, each followed by a daemon thread that waits on
    its worker process (a control plane that stops mid-run leaves its record ``running``, which the next
    start shows as ``interrupted``, and its worker exits with it).

    ``lock`` is held for the whole of any run; ``POST /simulate`` takes it too.
    """

    def __init__(self, store: Store, auditor: Auditor, profile_path: str = "",
                 cpu_priority: str = "idle") -> None:
        self.store, self.auditor, self.profile_path = store, auditor, profile_path
        self.cpu_priority = cpu_priority
        self.lock = threading.Lock()
        self._running_id: int | None = None
        self._progress: dict[str, Any] = {}  # of the running job; written by its thread

    def mark_interrupted(self) -> int:
        """Jobs left ``running`` by a process that stopped during the run become ``interrupted``."""
        records = self.store.records(COLLECTION, limit=KEEP_JOBS)
        stale = [r for r in records if r.body.get("status") == "running"]
        for r in stale:
            self.store.update_record(r.id, {**r.body, "status": "interrupted", "error": INTERRUPTED})
        return len(stale)

    def start(self, body: SimulateRequest, who: Principal) -> dict[str, Any]:
        """Record the job, audit its start and run it in the background; returns the job as ``get`` does.

        ValueError: a bad policy (checked before anything runs); Conflict: a run is going on.
        """
        from controlplane.sim.settings import PolicySpec

        labels = [PolicySpec.parse(p).label for p in body.policies]
        if not self.lock.acquire(blocking=False):
            running = "" if self._running_id is None else f" (simulation {self._running_id})"
            raise Conflict(BUSY.format(running=running))
        try:
            progress = {"fraction": 0.0, "policy": labels[0]}
            record = self.store.add_record(
                COLLECTION,
                {"status": "running", "trace": body.trace, "policies": labels, "params": _params(body),
                 "actor": who.name, "started_at": time.time(), "progress": progress},
                key=body.trace,
            )
            self.store.trim_records(COLLECTION, KEEP_JOBS)
            self._running_id, self._progress = record.id, progress
            self.auditor.record(who, "simulate.start", body.trace, _params(body), "ok",
                                f"simulation {record.id}")
            threading.Thread(target=self._run, args=(record.id, body, who), name=f"simulation-{record.id}",
                             daemon=True).start()
        except BaseException:
            self._running_id = None
            self.lock.release()
            raise
        logger.info("simulation %d: %s on the %s trace started by %s", record.id, ",".join(labels),
                    body.trace, who.name)
        return {**record.body, "id": record.id}

    def _run(self, job_id: int, body: SimulateRequest, who: Principal) -> None:
        try:
            result = run_what_if_process(body, progress=self._advance, profile_path=self.profile_path,
                                         cpu_priority=self.cpu_priority)
        except ValueError as exc:
            self._finish(job_id, body, who, error=str(exc))
        except Exception as exc:  # a failure becomes the job's error, not a dead thread with a running record
            logger.exception("simulation %d crashed", job_id)
            self._finish(job_id, body, who, error=f"{type(exc).__name__}: {exc}")
        else:
            self._finish(job_id, body, who, result=result)
        finally:
            self._running_id = None
            self.lock.release()

    def _advance(self, fraction: float, policy: str) -> None:
        done = max(float(self._progress.get("fraction", 0.0)), round(min(fraction, 1.0), 3))
        self._progress = {"fraction": done, "policy": policy}

    def _finish(self, job_id: int, body: SimulateRequest, who: Principal, *,
                result: dict[str, Any] | None = None, error: str | None = None) -> None:
        if result is not None:
            ending: dict[str, Any] = {"status": "done", "result": result,
                                      "progress": {**self._progress, "fraction": 1.0}}
        else:
            ending = {"status": "error", "error": error, "progress": dict(self._progress)}
        try:  # audited first: whoever sees the job finished finds its audit record too
            if result is not None:
                self.auditor.record(who, "simulate.run", body.trace, _params(body), "ok", _summary(result))
            else:
                self.auditor.record(who, "simulate.run", body.trace, _params(body), "error", str(error))
            current = self.store.record(job_id, COLLECTION)
            if current is None:
                logger.warning("simulation %d: its record was trimmed meanwhile; outcome dropped", job_id)
            else:
                self.store.update_record(job_id, {**current.body, **ending, "finished_at": time.time()})
        except StoreError:
            logger.exception("simulation %d: its outcome could not be stored", job_id)
        logger.info("simulation %d: %s", job_id, ending["status"])

    def get(self, job_id: int) -> dict[str, Any] | None:
        record = self.store.record(job_id, COLLECTION)
        return None if record is None else self._view(record.id, record.body)

    def list(self, limit: int = LIST_LIMIT) -> list[dict[str, Any]]:
        """The newest jobs first, without their results."""
        records = self.store.records(COLLECTION, limit=limit)
        return [{k: v for k, v in self._view(r.id, r.body).items() if k != "result"} for r in records]

    def _view(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        view = {**body, "id": job_id}
        if self._running_id == job_id and body.get("status") == "running":
            view["progress"] = dict(self._progress)
        return view


def simulator_router(auditor: Auditor, store: Store, profile_path: str = "",
                     cpu_priority: str = "idle") -> APIRouter:
    """``profile_path``: the replica profile the control plane runs on ("": the shipped one);
    ``cpu_priority``: ``[simulator] cpu_priority``, the what-if workers' (idle or low)."""
    router = APIRouter(prefix="/api/v1", tags=["simulator"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)
    jobs = SimulationJobs(store, auditor, profile_path, cpu_priority)
    if interrupted := jobs.mark_interrupted():
        logger.warning("%d simulation(s) running when the control plane stopped: interrupted", interrupted)

    @router.post("/simulate")
    async def simulate(body: SimulateRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        params = _params(body)
        if not jobs.lock.acquire(blocking=False):
            auditor.record(who, "simulate.run", body.trace, params, "denied", "a simulation is running")
            raise Conflict(BUSY.format(running=""))
        try:
            result = await asyncio.to_thread(run_what_if_process, body, profile_path=profile_path,
                                             cpu_priority=cpu_priority)
        except ValueError as exc:
            auditor.record(who, "simulate.run", body.trace, params, "error", str(exc))
            raise Refused(str(exc)) from exc
        finally:
            jobs.lock.release()
        auditor.record(who, "simulate.run", body.trace, params, "ok", _summary(result))
        return result

    @router.post("/simulations", status_code=202)
    async def start(body: SimulateRequest, who: Principal = Depends(operator)) -> dict[str, Any]:
        try:
            return jobs.start(body, who)
        except ValueError as exc:
            auditor.record(who, "simulate.start", body.trace, _params(body), "error", str(exc))
            raise Refused(str(exc), param="policies") from exc
        except Conflict as exc:
            auditor.record(who, "simulate.start", body.trace, _params(body), "denied", str(exc))
            raise

    @router.get("/simulations")
    async def listing(limit: int = Query(LIST_LIMIT, ge=1, le=KEEP_JOBS),
                      _: Principal = Depends(viewer)) -> list[dict[str, Any]]:
        return jobs.list(limit)

    @router.get("/simulations/{job_id}")
    async def show(job_id: int, _: Principal = Depends(viewer)) -> dict[str, Any]:
        job = jobs.get(job_id)
        if job is None:
            raise NotFound(f"no simulation {job_id}", param="id", subject=str(job_id))
        return job

    return router


def _params(body: SimulateRequest) -> dict[str, Any]:
    """What the audit records and the job keep of a request (not the inline requests themselves)."""
    return body.model_dump(exclude={"requests"}) | {"num_inline_requests": len(body.requests)}


def _summary(result: dict[str, Any]) -> str:
    return "; ".join(
        f"{p['policy']}: {p['slo_attainment']:.3f} SLO, {p['replica_seconds']:.0f} replica-s"
        for p in result["policies"]
    )
