"""APScheduler's job store in the control plane's SQLite file, and jobs written by earlier releases.

Where it sits: under :mod:`controlplane.schedules.scheduler`, whose schedules are APScheduler jobs in their
own table (``JOB_TABLE``) of the store's file. Every stored job names its function by the textual
reference ``FIRE_REF``; the job store maps the names of what has moved since older releases wrote their
jobs, and the background scheduler here leaves due jobs alone once it is shut down.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import sqlalchemy
from apscheduler.job import Job  # type: ignore[import-untyped]
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore  # type: ignore[import-untyped]
from apscheduler.schedulers.background import BackgroundScheduler  # type: ignore[import-untyped]
from apscheduler.schedulers.base import STATE_STOPPED  # type: ignore[import-untyped]

from controlplane.store.database import Store

FIRE_REF = "controlplane.schedules.scheduler:fire"  # the job function of every schedule


# Where job tables written by earlier releases name what has moved since: the job function by its textual
# reference, the trigger class by its module (pickled). A job is written back with today's names the next
# time it changes (each firing moves its next run time on).
MOVED_REFS = {"controlplane.schedules:fire": FIRE_REF}
MOVED_MODULES = {"controlplane.schedules": "controlplane.schedules.triggers",
                 "controlplane.schedule_triggers": "controlplane.schedules.triggers"}


class MovedModulesUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_MODULES.get(module, module), name)


class JobStore(SQLAlchemyJobStore):  # type: ignore[misc]
    """APScheduler's SQLAlchemy job store that also reads jobs written before their code moved."""

    def _reconstitute_job(self, job_state: bytes) -> Any:
        state = MovedModulesUnpickler(io.BytesIO(job_state)).load()
        state["func"] = MOVED_REFS.get(state["func"], state["func"])
        state["jobstore"] = self
        job = Job.__new__(Job)
        job.__setstate__(state)
        job._scheduler = self._scheduler
        job._jobstore_alias = self._alias
        return job


class StoppableBackgroundScheduler(BackgroundScheduler):  # type: ignore[misc]
    """APScheduler's background scheduler without its last pass over due jobs after ``shutdown``: that
    pass submits them to the executor that was just shut down (they fail to start) and still moves their
    next run time on, so a firing due at shutdown would be lost instead of running late at the next start."""

    def _process_jobs(self) -> float | None:
        if self.state == STATE_STOPPED:
            return None
        wait_s: float | None = super()._process_jobs()
        return wait_s


def job_store_engine(store: Store) -> sqlalchemy.Engine:
    """The job store's connections to the store's file, as durable as the store's own: WAL is a property
    of the file (set by the store), ``synchronous=FULL`` and the busy timeout are per connection."""
    engine = sqlalchemy.create_engine(f"sqlite:///{store.path}", connect_args={"timeout": 5.0})

    @sqlalchemy.event.listens_for(engine, "connect")
    def _pragmas(conn: Any, _: Any) -> None:
        cursor = conn.cursor()
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.close()

    return engine
