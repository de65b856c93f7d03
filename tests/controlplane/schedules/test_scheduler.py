"""Scheduled drills: cron and time zone validation, next fire times across DST, the overlap policies, the
run history, schedules that survive a restart (and a firing missed while down), the store's file shared
with APScheduler's job table, the REST API with roles and audit, and schedules aimed at a replica or zone
under a trace load, as a manual drill run is (scheduler, API and CLI).

The drill runner is a fake here (``FakeStarter``): these tests are about when and whether a schedule starts
a drill, and a real drill takes a fleet under load for tens of seconds. Everything else is real:
APScheduler's background thread fires the jobs from the SQLAlchemy job store in the store's SQLite file,
the scenario check is the shipped catalogue, the API is the control plane's own app. A firing aimed at a
replica that is not in the fleet goes to the real drill service over a real (empty) fleet.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from fastapi.testclient import TestClient

from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.client import ControlPlaneClient
from controlplane.config import ConfigError, load_config
from controlplane.fleet.backends.local import LocalProcessBackend
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.schedules import triggers
from controlplane.schedules.scheduler import (
    JOB_TABLE,
    RUNS_COLLECTION,
    DrillScheduler,
    InvalidSchedule,
    ScheduleConflict,
    UnknownSchedule,
    next_fire_times,
    parse_cron,
    running,
)
from controlplane.store.database import SCHEMA_VERSION, Store
from inference.launcher import free_port
from tests.polling import wait_until

BERLIN = ZoneInfo("Europe/Berlin")
TOKEN = "admin-token-for-schedule-tests"


class FakeStarter:
    """Stands in for the drill runner: records starts, and is "running" while ``busy`` is set."""

    def __init__(self) -> None:
        self.started: list[tuple[str, dict[str, Any]]] = []
        self.busy = threading.Event()
        self._lock = threading.Lock()

    def start(self, scenario_id: str, overrides: Any) -> str:
        with self._lock:
            self.started.append((scenario_id, dict(overrides)))
            return f"drill-{len(self.started)}"

    def is_running(self) -> bool:
        return self.busy.is_set()


@pytest.fixture
def starter() -> FakeStarter:
    return FakeStarter()


@pytest.fixture
def scheduler(store: Store, starter: FakeStarter) -> Iterator[DrillScheduler]:
    with running(DrillScheduler(store, starter, poll_s=0.05)) as live:
        yield live


def _runs(scheduler: DrillScheduler, schedule_id: str, count: int = 1) -> list[Any]:
    return wait_until(lambda: (lambda r: r if len(r) >= count else None)(scheduler.runs(schedule_id)),
                      timeout=15, what=f"{count} recorded runs of {schedule_id}")


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(("cron", "message"), [
    ("* * * *", "expected 5 fields"),
    ("0 3 * * * *", "expected 5 fields"),
    ("61 3 * * *", "higher than the maximum value (59)"),
    ("0 3 * * funday", "cron:"),
])
def test_bad_cron_is_refused_with_the_reason(cron: str, message: str) -> None:
    with pytest.raises(InvalidSchedule, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cron(cron, "UTC")


@pytest.mark.parametrize("tz", ["Mars/Olympus_Mons", "../etc/passwd", "", "CEST"])
def test_unknown_time_zone_is_refused(tz: str) -> None:
    with pytest.raises(InvalidSchedule, match="timezone: unknown time zone"):
        parse_cron("0 3 * * *", tz)


def test_unknown_scenario_and_bad_overrides_are_refused(scheduler: DrillScheduler) -> None:
    with pytest.raises(InvalidSchedule, match=r"unknown scenario 'db-meltdown'.*replica-crash"):
        scheduler.add(scheduler.spec(name="x", scenario_id="db-meltdown", cron="0 3 * * *"))
    with pytest.raises(InvalidSchedule, match="colour: unknown override"):
        scheduler.add(scheduler.spec(name="x", scenario_id="replica-crash", cron="0 3 * * *",
                                     overrides={"colour": 1}))
    with pytest.raises(InvalidSchedule, match="overlap"):
        scheduler.spec(name="x", scenario_id="replica-crash", cron="0 3 * * *", overlap="queue")
    assert scheduler.schedules() == []


def test_schedule_names_are_unique(scheduler: DrillScheduler) -> None:
    scheduler.add(scheduler.spec(name="nightly", scenario_id="replica-crash", cron="0 3 * * *"))
    with pytest.raises(ScheduleConflict, match="nightly"):
        scheduler.add(scheduler.spec(name="nightly", scenario_id="zone-outage", cron="0 4 * * *"))


# ---- next fire times -------------------------------------------------------------------------
def test_daily_drill_keeps_its_local_hour_across_the_spring_dst_change() -> None:
    times = next_fire_times("0 9 * * *", "Europe/Berlin", after=datetime(2026, 3, 27, 12, tzinfo=BERLIN),
                            count=3)
    assert [t.astimezone(BERLIN).hour for t in times] == [9, 9, 9]
    assert [t.astimezone(UTC).strftime("%m-%d %H:%M") for t in times] == ["03-28 08:00", "03-29 07:00",
                                                                            "03-30 07:00"]


def test_drill_in_the_skipped_hour_runs_once_an_hour_later() -> None:
    # 2026-03-29: Berlin's clocks jump from 02:00 to 03:00; 02:30 does not exist that day.
    times = next_fire_times("30 2 * * *", "Europe/Berlin", after=datetime(2026, 3, 28, 12, tzinfo=BERLIN),
                            count=2)
    assert [t.astimezone(UTC).isoformat() for t in times] == ["2026-03-29T01:30:00+00:00",
                                                              "2026-03-30T00:30:00+00:00"]
    assert times[0].astimezone(UTC).astimezone(BERLIN).strftime("%H:%M %Z") == "03:30 CEST"


def test_drill_in_the_repeated_hour_runs_once_when_clocks_go_back() -> None:
    # 2026-10-25: Berlin's clocks go from 03:00 CEST back to 02:00 CET; 02:30 happens twice.
    times = next_fire_times("30 2 * * *", "Europe/Berlin", after=datetime(2026, 10, 24, 12, tzinfo=BERLIN),
                            count=3)
    assert [t.astimezone(UTC).isoformat() for t in times] == ["2026-10-25T00:30:00+00:00",
                                                              "2026-10-26T01:30:00+00:00",
                                                              "2026-10-27T01:30:00+00:00"]


def test_listed_schedule_shows_its_next_run_in_its_own_time_zone(scheduler: DrillScheduler) -> None:
    made = scheduler.add(scheduler.spec(name="weekly", scenario_id="zone-outage", cron="0 3 * * mon",
                                        timezone="Europe/Berlin"))
    (listed,) = scheduler.schedules()
    assert listed.id == made.id
    assert listed.next_run_time is not None
    local = listed.next_run_time.astimezone(BERLIN)
    assert (local.weekday(), local.hour, local.minute) == (0, 3, 0)
    assert timedelta(0) < listed.next_run_time - datetime.now(UTC) <= timedelta(days=7, hours=1)
    assert listed.as_json()["next_run_time"].endswith(("+01:00", "+02:00"))


# ---- firing and overlap ----------------------------------------------------------------------
def test_fired_schedule_starts_its_scenario_with_the_overrides(scheduler: DrillScheduler,
                                                               starter: FakeStarter) -> None:
    made = scheduler.add(scheduler.spec(name="crash", scenario_id="replica-crash", cron="0 3 * * *",
                                        overrides={"rate": 2, "targets.rto_service_s": 0.5}))
    scheduler.run_now(made.id)
    (run,) = _runs(scheduler, made.id)
    assert (run.outcome, run.drill_id, run.scenario_id) == ("started", "drill-1", "replica-crash")
    assert starter.started == [("replica-crash", {"rate": 2.0, "targets.rto_service_s": 0.5})]
    after = scheduler.get(made.id)
    assert after.next_run_time is not None and after.next_run_time > datetime.now(UTC)  # the cron goes on


def test_skip_policy_records_a_skipped_run_while_a_drill_runs(scheduler: DrillScheduler,
                                                              starter: FakeStarter) -> None:
    made = scheduler.add(scheduler.spec(name="crash", scenario_id="replica-crash", cron="0 3 * * *",
                                        overlap="skip"))
    starter.busy.set()
    scheduler.run_now(made.id)
    (run,) = _runs(scheduler, made.id)
    assert run.outcome == "skipped"
    assert "another drill is running" in run.reason and "skip" in run.reason
    assert starter.started == []


def test_wait_policy_starts_when_the_running_drill_ends(scheduler: DrillScheduler,
                                                        starter: FakeStarter) -> None:
    made = scheduler.add(scheduler.spec(name="crash", scenario_id="replica-crash", cron="0 3 * * *",
                                        overlap="wait", max_wait_s=30))
    starter.busy.set()
    scheduler.run_now(made.id)
    wait_until(lambda: scheduler._in_flight, timeout=10, what="the firing to begin")
    time.sleep(0.5)  # ten polls of the runner: the firing waits, it neither starts nor gives up
    assert starter.started == [] and scheduler.runs(made.id) == []
    starter.busy.clear()
    (run,) = _runs(scheduler, made.id)
    assert (run.outcome, run.drill_id) == ("started", "drill-1")
    assert 0.5 <= run.waited_s < 10
    assert starter.started == [("replica-crash", {})]


def test_wait_policy_gives_up_after_max_wait(scheduler: DrillScheduler, starter: FakeStarter) -> None:
    made = scheduler.add(scheduler.spec(name="crash", scenario_id="replica-crash", cron="0 3 * * *",
                                        overlap="wait", max_wait_s=0.4))
    starter.busy.set()
    scheduler.run_now(made.id)
    (run,) = _runs(scheduler, made.id)
    assert run.outcome == "skipped" and "after waiting" in run.reason
    assert run.waited_s >= 0.4
    assert starter.started == []


def test_firing_while_the_previous_one_still_waits_is_recorded_skipped(scheduler: DrillScheduler,
                                                                       starter: FakeStarter) -> None:
    made = scheduler.add(scheduler.spec(name="crash", scenario_id="replica-crash", cron="0 3 * * *",
                                        overlap="wait", max_wait_s=30))
    starter.busy.set()
    scheduler.run_now(made.id)
    wait_until(lambda: scheduler._in_flight, timeout=10, what="the first firing to wait")
    scheduler.run_now(made.id)
    (skipped,) = _runs(scheduler, made.id)
    assert skipped.outcome == "skipped"
    assert "previous firing of this schedule is still in progress" in skipped.reason
    starter.busy.clear()
    started = _runs(scheduler, made.id, count=2)[0]
    assert (started.outcome, len(starter.started)) == ("started", 1)


def test_two_schedules_firing_together_start_one_drill(store: Store) -> None:
    class SlowStarter(FakeStarter):
        def start(self, scenario_id: str, overrides: Any) -> str:
            drill_id = super().start(scenario_id, overrides)
            self.busy.set()  # the drill runs from now on
            return drill_id

    starter = SlowStarter()
    with running(DrillScheduler(store, starter, poll_s=0.05)) as scheduler:
        ids = [scheduler.add(scheduler.spec(name=f"s{n}", scenario_id="replica-crash", cron="0 3 * * *")).id
               for n in range(2)]
        for schedule_id in ids:
            scheduler.run_now(schedule_id)
        outcomes = sorted(_runs(scheduler, i)[0].outcome for i in ids)
    assert outcomes == ["skipped", "started"]
    assert len(starter.started) == 1


def test_failing_drill_start_is_an_error_in_the_history(store: Store) -> None:
    class BrokenStarter(FakeStarter):
        def start(self, scenario_id: str, overrides: Any) -> str:
            raise RuntimeError("fleet has no ready replica")

    with running(DrillScheduler(store, BrokenStarter(), poll_s=0.05)) as scheduler:
        made = scheduler.add(scheduler.spec(name="crash", scenario_id="replica-crash", cron="0 3 * * *"))
        scheduler.run_now(made.id)
        (run,) = _runs(scheduler, made.id)
        assert run.outcome == "error" and "fleet has no ready replica" in run.reason
        scheduler.run_now(made.id)  # the schedule keeps firing after an error
        assert len(_runs(scheduler, made.id, count=2)) == 2


def test_async_drill_runner_is_awaited_on_the_event_loop(store: Store) -> None:
    class AsyncStarter:
        def __init__(self) -> None:
            self.loop_thread: str | None = None

        async def start(self, scenario_id: str, overrides: Any) -> str:
            self.loop_thread = threading.current_thread().name
            return "drill-async"

        def is_running(self) -> bool:
            return False

    loop = __import__("asyncio").new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="event-loop", daemon=True)
    thread.start()
    starter = AsyncStarter()
    try:
        with running(DrillScheduler(store, starter, loop=loop)) as scheduler:
            made = scheduler.add(scheduler.spec(name="a", scenario_id="kv-pressure", cron="0 3 * * *"))
            scheduler.run_now(made.id)
            (run,) = _runs(scheduler, made.id)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert (run.outcome, run.drill_id, starter.loop_thread) == ("started", "drill-async", "event-loop")


def test_paused_schedule_does_not_fire_and_edit_keeps_it_paused(scheduler: DrillScheduler) -> None:
    made = scheduler.add(scheduler.spec(name="crash", scenario_id="replica-crash", cron="0 3 * * *"))
    assert scheduler.pause(made.id).paused
    with pytest.raises(ScheduleConflict, match="paused"):
        scheduler.run_now(made.id)
    edited = scheduler.edit(made.id, cron="15 4 * * *", timezone="America/New_York")
    assert edited.paused and edited.spec.cron == "15 4 * * *"
    resumed = scheduler.resume(made.id)
    assert resumed.next_run_time is not None
    local = resumed.next_run_time.astimezone(ZoneInfo("America/New_York"))
    assert (local.hour, local.minute) == (4, 15)


def test_unknown_schedule_ids_are_refused(scheduler: DrillScheduler) -> None:
    for call in (scheduler.pause, scheduler.resume, scheduler.delete, scheduler.get, scheduler.runs):
        with pytest.raises(UnknownSchedule, match="sch-nope"):
            call("sch-nope")


# ---- restarts and the shared file ------------------------------------------------------------
def test_schedules_survive_a_restart_and_fire_in_the_new_scheduler(tmp_path: Path) -> None:
    path = tmp_path / "controlplane.db"
    with Store(path) as store, running(DrillScheduler(store, FakeStarter())) as first:
        kept = first.add(first.spec(name="nightly", scenario_id="zone-outage", cron="0 3 * * *",
                                    timezone="Europe/Berlin", overrides={"rate": 3}, overlap="wait"),
                         created_by="ops")
        paused = first.pause(first.add(first.spec(name="paused", scenario_id="kv-pressure",
                                                  cron="*/5 * * * *")).id)
    starter = FakeStarter()
    with Store(path) as store, running(DrillScheduler(store, starter)) as second:
        listed = {s.id: s for s in second.schedules()}
        assert set(listed) == {kept.id, paused.id}
        assert listed[kept.id].as_json() == kept.as_json()
        assert listed[paused.id].paused
        second.run_now(kept.id)
        (run,) = _runs(second, kept.id)
    assert (run.outcome, starter.started) == ("started", [("zone-outage", {"rate": 3.0})])


def test_a_job_table_written_before_the_code_moved_still_loads(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Earlier releases pickled the trigger as ``controlplane.schedule_triggers.WallClockCronTrigger`` and
    named the job function ``controlplane.schedules:fire``; both modules have moved since."""
    path = tmp_path / "controlplane.db"
    with Store(path) as store, running(DrillScheduler(store, FakeStarter())) as first:
        kept = first.add(first.spec(name="nightly", scenario_id="zone-outage", cron="0 3 * * *"))
    with sqlite3.connect(path) as db:
        (blob,) = db.execute(f"SELECT job_state FROM {JOB_TABLE} WHERE id = ?", (kept.id,)).fetchone()
        state = pickle.loads(blob)
        state["func"] = "controlplane.schedules:fire"
        with monkeypatch.context() as old_names:
            old_names.setitem(sys.modules, "controlplane.schedule_triggers", triggers)
            old_names.setattr(triggers.WallClockCronTrigger, "__module__", "controlplane.schedule_triggers")
            old_blob = pickle.dumps(state)
        assert b"controlplane.schedule_triggers" in old_blob
        db.execute(f"UPDATE {JOB_TABLE} SET job_state = ? WHERE id = ?", (old_blob, kept.id))
    starter = FakeStarter()
    with Store(path) as store, running(DrillScheduler(store, starter)) as second:
        (listed,) = second.schedules()
        assert listed.as_json() == kept.as_json()
        second.run_now(kept.id)
        (run,) = _runs(second, kept.id)
    assert (run.outcome, starter.started) == ("started", [("zone-outage", {})])


def test_firing_missed_while_down_runs_late_within_grace_and_is_recorded_skipped_beyond(
        tmp_path: Path) -> None:
    path = tmp_path / "controlplane.db"
    past = datetime.now(UTC) - timedelta(seconds=30)
    with Store(path) as store, running(DrillScheduler(store, FakeStarter())) as first:
        late = first.add(first.spec(name="late", scenario_id="replica-crash", cron="0 3 * * *",
                                    misfire_grace_s=300))
        lost = first.add(first.spec(name="lost", scenario_id="zone-outage", cron="0 4 * * *",
                                    misfire_grace_s=5))
    # As if the control plane had been down when these fire times came: move them into the past through
    # an APScheduler that is started paused, so it never fires anything itself.
    with Store(path) as store:
        offline = DrillScheduler(store, None)
        offline._aps.start(paused=True)
        for schedule_id in (late.id, lost.id):
            offline._aps.modify_job(schedule_id, next_run_time=past)
        offline.shutdown()
    starter = FakeStarter()
    with Store(path) as store, running(DrillScheduler(store, starter)) as second:
        (late_run,) = _runs(second, late.id)
        (lost_run,) = _runs(second, lost.id)
    assert late_run.outcome == "started" and starter.started == [("replica-crash", {})]
    assert lost_run.outcome == "skipped" and "misfire_grace_s" in lost_run.reason


def test_store_keeps_wal_and_its_schema_next_to_the_job_table(tmp_path: Path) -> None:
    path = tmp_path / "controlplane.db"
    with Store(path) as store, running(DrillScheduler(store, FakeStarter())) as scheduler:
        made = scheduler.add(scheduler.spec(name="n", scenario_id="replica-crash", cron="0 3 * * *"))
        store.add_record("other", {"still": "works"}, key="k")
        assert store.pragmas().journal_mode == "wal"
    with Store(path) as reopened:
        pragmas = reopened.pragmas()
        assert (pragmas.journal_mode, pragmas.user_version) == ("wal", SCHEMA_VERSION)
        assert reopened.records("other")[0].body == {"still": "works"}
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        ids = [r[0] for r in conn.execute(f"SELECT id FROM {JOB_TABLE}")]
        assert ids == [made.id]
        default_table = "SELECT count(*) FROM sqlite_master WHERE name = 'apscheduler_jobs'"
        assert conn.execute(default_table).fetchone()[0] == 0  # another APScheduler user's table stays free
    finally:
        conn.close()


def test_shutdown_ends_a_waiting_firing_within_its_bound(store: Store, starter: FakeStarter) -> None:
    scheduler = DrillScheduler(store, starter, poll_s=0.05)
    scheduler.start()
    made = scheduler.add(scheduler.spec(name="w", scenario_id="replica-crash", cron="0 3 * * *",
                                        overlap="wait", max_wait_s=600))
    starter.busy.set()
    scheduler.run_now(made.id)
    wait_until(lambda: scheduler._in_flight, timeout=10, what="the firing to wait")
    began = time.monotonic()
    assert scheduler.shutdown(timeout_s=5) is True
    assert time.monotonic() - began < 2
    (run,) = store.records(RUNS_COLLECTION, key=made.id)
    assert run.body["outcome"] == "skipped" and "stopping" in run.body["reason"]


@pytest.mark.parametrize(("line", "message"), [
    ('schedule_timezone = "Nowhere/City"', "drills.schedule_timezone: unknown time zone 'Nowhere/City'"),
    ('schedule_overlap = "queue"', "drills.schedule_overlap: must be skip or wait"),
    ("schedule_misfire_grace_s = 0.5", "drills.schedule_misfire_grace_s: must be a whole number"),
])
def test_bad_schedule_defaults_in_the_config_fail_at_start(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[drills]\n{line}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
        load_config(path)


# ---- REST ------------------------------------------------------------------------------------
@pytest.fixture
def api(tmp_path: Path, store: Store,
        scheduler: DrillScheduler) -> Iterator[tuple[TestClient, dict[str, str]]]:
    tokens = TokenAuthority(store)
    backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    fleet = Fleet(FleetConfig(replicas=0), backend, store, secret=b"k" * 32)  # never started: no process
    app = create_api(Services(fleet, store, tokens, Auditor(store), schedules=scheduler))
    secrets = {role.value: tokens.issue(f"{role.value}-1", role) for role in Role}
    with TestClient(app) as client:
        yield client, secrets


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


BODY = {"name": "nightly", "scenario_id": "replica-crash", "cron": "0 3 * * *", "timezone": "Europe/Berlin",
        "overrides": {"rate": 2}}


def test_viewer_may_list_but_not_create_and_the_refusal_is_audited(api: tuple[TestClient, dict[str, str]],
                                                                    store: Store) -> None:
    client, secrets = api
    refused = client.post("/api/v1/drills/schedules", json=BODY, headers=_auth(secrets["viewer"]))
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"
    (audit,) = store.audit(action_prefix="POST /api/v1/drills/schedules")
    assert (audit.actor, audit.outcome) == ("viewer-1", "denied")
    listed = client.get("/api/v1/drills/schedules", headers=_auth(secrets["viewer"]))
    assert listed.status_code == 200 and listed.json() == []
    assert client.get("/api/v1/drills/schedules").status_code == 401


def test_operator_creates_edits_pauses_resumes_runs_and_deletes_audited(
        api: tuple[TestClient, dict[str, str]], store: Store, starter: FakeStarter) -> None:
    client, secrets = api
    op = _auth(secrets["operator"])
    created = client.post("/api/v1/drills/schedules", json=BODY, headers=op)
    assert created.status_code == 201, created.text
    made = created.json()
    assert made["next_run_time"].startswith(tuple(
        (datetime.now(BERLIN) + timedelta(days=d)).strftime("%Y-%m-%dT03:00:00") for d in (0, 1)))
    sid = made["id"]
    edited = client.patch(f"/api/v1/drills/schedules/{sid}", json={"cron": "30 4 * * *", "overlap": "wait"},
                          headers=op).json()
    assert (edited["cron"], edited["overlap"], edited["overrides"]) == ("30 4 * * *", "wait", {"rate": 2.0})
    assert "T04:30:00" in edited["next_run_time"]
    paused = client.post(f"/api/v1/drills/schedules/{sid}/pause", headers=op).json()
    assert (paused["paused"], paused["next_run_time"]) == (True, None)
    assert client.post(f"/api/v1/drills/schedules/{sid}/resume", headers=op).json()["paused"] is False
    assert client.post(f"/api/v1/drills/schedules/{sid}/run", headers=op).status_code == 200
    wait_until(lambda: starter.started, timeout=15, what="the drill to start")
    runs = wait_until(lambda: client.get(f"/api/v1/drills/schedules/{sid}/runs", headers=op).json(),
                      timeout=15, what="the run in the history")
    assert (runs[0]["outcome"], runs[0]["drill_id"], runs[0]["scenario_id"]) == ("started", "drill-1",
                                                                                 "replica-crash")
    assert client.delete(f"/api/v1/drills/schedules/{sid}", headers=op).json() == {"deleted": sid}
    assert client.get("/api/v1/drills/schedules", headers=op).json() == []
    assert len(client.get(f"/api/v1/drills/schedules/{sid}/runs", headers=op).json()) == 1  # history stays
    actions = [(a.action, a.outcome, a.actor) for a in store.audit(action_prefix="drill.schedule.")]
    assert actions == [(f"drill.schedule.{verb}", "ok", "operator-1")
                       for verb in ("delete", "run", "resume", "pause", "edit", "create")]


@pytest.mark.parametrize(("change", "field"), [
    ({"cron": "0 25 * * *"}, "cron"),
    ({"cron": "0 3 * *"}, "cron"),
    ({"timezone": "Europe/Atlantis"}, "timezone"),
    ({"scenario_id": "db-meltdown"}, "scenario_id"),
    ({"overlap": "queue"}, "overlap"),
])
def test_bad_input_is_a_400_in_the_openai_shape_and_audited(api: tuple[TestClient, dict[str, str]],
                                                            store: Store, change: dict[str, str],
                                                            field: str) -> None:
    client, secrets = api
    answer = client.post("/api/v1/drills/schedules", json={**BODY, **change},
                         headers=_auth(secrets["operator"]))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"].startswith(field)
    (audit,) = store.audit(action_prefix="drill.schedule.create")
    assert audit.outcome == "denied" and audit.detail == error["message"]


def test_unknown_id_is_a_404_and_a_duplicate_name_a_409(api: tuple[TestClient, dict[str, str]]) -> None:
    client, secrets = api
    op = _auth(secrets["operator"])
    for method, path in (("POST", "/sch-nope/pause"), ("POST", "/sch-nope/resume"), ("DELETE", "/sch-nope"),
                         ("PATCH", "/sch-nope"), ("GET", "/sch-nope/runs"), ("GET", "/sch-nope")):
        answer = client.request(method, f"/api/v1/drills/schedules{path}", headers=op,
                                json={} if method == "PATCH" else None)
        assert answer.status_code == 404, (method, path, answer.text)
        assert "sch-nope" in answer.json()["error"]["message"]
    assert client.post("/api/v1/drills/schedules", json=BODY, headers=op).status_code == 201
    duplicate = client.post("/api/v1/drills/schedules", json=BODY, headers=op)
    assert duplicate.status_code == 409 and "nightly" in duplicate.json()["error"]["message"]


# ---- a real control plane --------------------------------------------------------------------
def _config(tmp: Path) -> tuple[Path, str]:
    port = free_port()
    config = tmp / "controlplane.toml"
    config.write_text(f"""
state_dir = "{tmp / 'state'}"
[api]
port = {port}
[gateway]
port = {free_port()}
[fleet]
replicas = 0
[prometheus]
enabled = "off"
[autoscaler]
enabled = false
[alerts]
enabled = false
[console]
enabled = false
[drills]
schedule_timezone = "Europe/Berlin"
""")
    return config, f"http://127.0.0.1:{port}"


def _up(config: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CONTROLPLANE_ADMIN_TOKEN": TOKEN}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``controlplane drill schedule ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "controlplane", "--url", url, "drill", "schedule", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CONTROLPLANE_TOKEN": TOKEN})  # not in argv: ps shows it


@pytest.mark.slow
def test_control_plane_restart_keeps_schedules_made_from_the_cli(tmp_path: Path) -> None:
    config, url = _config(tmp_path)
    log = tmp_path / "up.log"

    def ready() -> bool:
        try:
            with ControlPlaneClient(url, TOKEN, timeout=2) as client:
                client.drill_schedules()
            return True
        except Exception:
            return False

    process = _up(config, log)
    try:
        wait_until(ready, timeout=90, what=f"the control plane API ({log})")
        added = _cli(url, "add", "nightly", "--scenario", "zone-outage", "--cron", "0 3 * * *", "--rate", "2")
        assert added.returncode == 0, added.stderr
        assert "nightly next run" in added.stdout and "T03:00:00+01:00" in added.stdout
        bad = _cli(url, "add", "bad", "--scenario", "zone-outage", "--cron", "0 3 * *")
        assert bad.returncode == 1  # refused by the API
        assert bad.stderr.strip() == ("controlplane: HTTP 400: cron: expected 5 fields "
                                      "(minute hour day month weekday), got 4 in '0 3 * *'")
    finally:
        _stop(process)
    assert process.returncode == 0, log.read_text()[-3000:]
    process = _up(config, log)
    try:
        wait_until(ready, timeout=90, what=f"the restarted control plane API ({log})")
        listed = _cli(url, "list")
        assert listed.returncode == 0, listed.stderr
        assert all(word in listed.stdout for word in ("nightly", "zone-outage", "Europe/Berlin", "0 3 * * *"))
        with ControlPlaneClient(url, TOKEN) as client:
            (schedule,) = client.drill_schedules()
            assert schedule.overrides == {"rate": 2.0}
            client.run_drill_schedule(schedule.id)
            runs = wait_until(lambda: client.drill_schedule_runs(schedule.id), timeout=30,
                              what="the firing in the history")
            assert (runs[0].outcome, runs[0].scenario_id) == ("started", "zone-outage"), runs
            assert runs[0].drill_id is not None
            drill = client.drill(int(runs[0].drill_id))  # the firing made a real drill report
            assert drill.scenario == "zone-outage" and drill.document["overrides"] == {"rate": 2.0}
        shown = _cli(url, "runs", schedule.id)
        assert shown.returncode == 0 and "started" in shown.stdout and runs[0].drill_id in shown.stdout
    finally:
        _stop(process)
    assert process.returncode == 0, log.read_text()[-3000:]


# ---- CLI: aim and load -------------------------------------------------------------------------
