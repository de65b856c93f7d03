"""Scheduled drills aimed and loaded as a manual run is: ``replicas``, ``zones`` and a trace ``load`` kept
with the schedule, checked when it is added or edited, passed to the drill runner when it fires, refused
with the field named (scheduler, REST API, CLI), and a firing aimed at a replica gone from the fleet
recorded as a failed run while the schedule goes on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from chaos.catalogue import default_catalogue
from chaos.drills import DrillRunner
from chaos.safety import FaultManager
from controlplane.cli import main as cli
from controlplane.client import ControlPlaneClient
from controlplane.config import Config
from controlplane.drills.port import FleetDrillPort
from controlplane.drills.service import COLLECTION as DRILLS
from controlplane.drills.service import DrillService
from controlplane.fleet.backends.local import LocalProcessBackend
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.schedules.scheduler import DrillScheduler, InvalidSchedule, running
from controlplane.store.database import Store
from tests.controlplane.drills.test_requests import _trace
from tests.controlplane.schedules import test_scheduler as test_schedules
from tests.controlplane.schedules.test_scheduler import (
    BODY,
    TOKEN,
    FakeStarter,
    _auth,
    _cli,
    _config,
    _runs,
    _stop,
    _up,
)
from tests.polling import wait_until

# The scheduler, its fake drill starter and the API over them, as test_schedules sets them up.
starter, scheduler, api = test_schedules.starter, test_schedules.scheduler, test_schedules.api


# ---- aim and load ----------------------------------------------------------------------------
@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """A small Azure LLM trace CSV: two requests a second for 200 s."""
    return _trace(tmp_path / "trace.csv", [0.5 * i for i in range(400)])


def test_schedule_is_aimed_and_loaded_as_a_drill_run_and_edits_keep_or_replace_it(
        scheduler: DrillScheduler, trace: Path) -> None:
    load = {"kind": "trace", "trace": str(trace), "compress": 2, "token_scale": 0.5}
    made = scheduler.add(scheduler.spec(name="crash-b1", scenario_id="replica-crash", cron="0 3 * * *",
                                        overrides={"duration_s": 20}, replicas=["az-b-1", " az-b-1"],
                                        load=load))
    assert made.as_json()["overrides"] == {"duration_s": 20.0, "replicas": ["az-b-1"], "load": load}
    assert scheduler.get(made.id).spec.overrides == made.spec.overrides  # as stored in the job table
    edited = scheduler.edit(made.id, overrides={"duration_s": 30})  # new numbers keep the aim and load
    assert edited.spec.overrides == {"duration_s": 30.0, "replicas": ["az-b-1"], "load": load}
    zone = scheduler.edit(made.id, replicas=[], zones=["az-c"], load={"kind": "rate", "rate": 3})
    assert zone.spec.overrides == {"duration_s": 30.0, "zones": ["az-c"], "load": {"kind": "rate", "rate": 3}}
    plain = scheduler.edit(made.id, zones=[], load={"kind": "rate"})  # back to the scenario's own
    assert plain.spec.overrides == {"duration_s": 30.0}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"replicas": [""]}, "overrides.replicas: expected a list of non-empty names, got ['']"),
    ({"replicas": "az-b-1"}, "overrides.replicas: expected a list of non-empty names, got 'az-b-1'"),
    ({"zones": [3]}, "overrides.zones: expected a list of non-empty names, got [3]"),
    ({"replicas": ["az-a-0", "az-b-1"]}, "overrides.replicas: replica-crash takes one replica"),
    ({"load": "azure"}, "load: expected an object with a kind ('rate' or 'trace'), got 'azure'"),
    ({"load": {"kind": "burst"}}, "load.kind: must be 'rate' or 'trace', got 'burst'"),
    ({"load": {"kind": "trace", "trace": "/nowhere/trace.csv"}}, "load.trace: no trace file at /nowhere"),
    ({"load": {"kind": "trace", "trace": "TRACE", "compress": 0}}, "load.compress: must be > 0"),
    ({"load": {"kind": "trace", "trace": "TRACE", "speed": 2}}, "load.speed: unknown for a trace load"),
    ({"rate": 2, "load": {"kind": "trace", "trace": "TRACE"}},
     "overrides.rate: a trace load takes its arrivals from the trace; leave rate out"),
])
def test_bad_aim_or_load_is_refused_naming_the_field(scheduler: DrillScheduler, trace: Path,
                                                     overrides: dict[str, Any], message: str) -> None:
    load = overrides.get("load")
    if isinstance(load, dict) and load.get("trace") == "TRACE":
        overrides = {**overrides, "load": {**load, "trace": str(trace)}}
    with pytest.raises(InvalidSchedule) as refused:
        scheduler.add(scheduler.spec(name="x", scenario_id="replica-crash", cron="0 3 * * *",
                                     overrides=overrides))
    assert str(refused.value).startswith(message), str(refused.value)
    made = scheduler.add(scheduler.spec(name="ok", scenario_id="replica-crash", cron="0 3 * * *"))
    with pytest.raises(InvalidSchedule, match=re.escape(message.split(",")[0].split(" got")[0])):
        scheduler.edit(made.id, overrides=overrides)
    assert scheduler.get(made.id).spec.overrides == {}  # a refused edit changes nothing


def test_fired_schedule_passes_its_aim_and_trace_load_to_the_drill_runner(scheduler: DrillScheduler,
                                                                          starter: FakeStarter,
                                                                          trace: Path) -> None:
    load = {"kind": "trace", "trace": str(trace), "compress": 2}
    made = scheduler.add(scheduler.spec(name="crash-b1", scenario_id="replica-crash", cron="0 3 * * *",
                                        overrides={"duration_s": 20}, replicas=["az-b-1"], zones=["az-b"],
                                        load=load))
    scheduler.run_now(made.id)
    (run,) = _runs(scheduler, made.id)
    assert (run.outcome, run.drill_id) == ("started", "drill-1")
    assert starter.started == [("replica-crash", {"duration_s": 20.0, "replicas": ["az-b-1"],
                                                  "zones": ["az-b"], "load": load})]


def test_firing_aimed_at_a_replica_not_in_the_fleet_is_a_failed_run_and_the_schedule_goes_on(
        tmp_path: Path, store: Store) -> None:
    """The real drill service over a real fleet without replicas: the aim is checked when it fires."""
    backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    fleet = Fleet(FleetConfig(replicas=0), backend, store, secret=b"k" * 32)  # never started: no process
    port = FleetDrillPort(fleet, store, gateway=Config().gateway, state_path=Config().state_path)
    service = DrillService(DrillRunner(port, FaultManager(default_catalogue(), store)), store, tmp_path)
    with running(DrillScheduler(store, service, poll_s=0.05)) as scheduler:
        made = scheduler.add(scheduler.spec(name="crash-b1", scenario_id="replica-crash", cron="0 3 * * *",
                                            replicas=["az-b-1"]))
        scheduler.run_now(made.id)
        (run,) = _runs(scheduler, made.id)
        assert (run.outcome, run.drill_id) == ("error", None)
        assert run.reason == ("the drill runner refused it: replicas: no replica 'az-b-1' in the fleet "
                              "(running: none)")
        assert store.records(DRILLS) == []  # no drill was started
        assert not scheduler.get(made.id).paused
        scheduler.run_now(made.id)  # it fires again (and fails again) at its next time
        assert [r.outcome for r in _runs(scheduler, made.id, count=2)] == ["error", "error"]


def test_operator_creates_and_edits_an_aimed_schedule_under_a_trace_load(
        api: tuple[TestClient, dict[str, str]], starter: FakeStarter, trace: Path) -> None:
    client, secrets = api
    op = _auth(secrets["operator"])
    load = {"kind": "trace", "trace": str(trace), "compress": 2}
    created = client.post("/api/v1/drills/schedules", headers=op, json={
        **BODY, "overrides": {}, "replicas": ["az-b-1"], "zones": ["az-b"], "load": load})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    assert created.json()["overrides"] == {"replicas": ["az-b-1"], "zones": ["az-b"], "load": load}
    edited = client.patch(f"/api/v1/drills/schedules/{sid}", headers=op,
                          json={"replicas": ["az-a-0"], "zones": [], "load": {"kind": "rate", "rate": 3}})
    assert edited.status_code == 200, edited.text
    assert edited.json()["overrides"] == {"replicas": ["az-a-0"], "load": {"kind": "rate", "rate": 3.0}}
    client.post(f"/api/v1/drills/schedules/{sid}/run", headers=op)
    wait_until(lambda: starter.started, timeout=15, what="the drill to start")
    assert starter.started == [("replica-crash", {"replicas": ["az-a-0"],
                                                  "load": {"kind": "rate", "rate": 3.0}})]


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"replicas": [""]}, "overrides.replicas", "expected a list of non-empty names"),
    ({"replicas": ["az-a-0", "az-b-1"]}, "overrides.replicas", "takes one replica"),
    ({"zones": "az-b"}, "zones", "valid list"),
    ({"load": {"kind": "burst"}}, "load.kind", "'rate' or 'trace'"),
    ({"load": {"kind": "trace", "trace": "azure", "compress": 0}}, "load.compress", "greater than 0"),
    ({"overrides": {}, "load": {"kind": "trace", "trace": "/nowhere/t.csv"}}, "load.trace",
     "no trace file at /nowhere"),
    ({"load": {"kind": "trace", "trace": "TRACE"}}, "overrides.rate", "arrivals from the trace"),
])
def test_bad_aim_or_load_is_a_400_in_the_openai_shape(api: tuple[TestClient, dict[str, str]], store: Store,
                                                      trace: Path, change: dict[str, Any], param: str,
                                                      words: str) -> None:
    client, secrets = api
    if change.get("load", {}).get("trace") == "TRACE":
        change = {"load": {**change["load"], "trace": str(trace)}}  # BODY's rate makes it a conflict
    answer = client.post("/api/v1/drills/schedules", json={**BODY, **change},
                         headers=_auth(secrets["operator"]))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and words in error["message"], error
    assert client.get("/api/v1/drills/schedules", headers=_auth(secrets["operator"])).json() == []


@pytest.mark.parametrize(("options", "message"), [
    (("--compress", "2"), "--compress: only with --trace"),
    (("--trace-start", "60"), "--trace-start: only with --trace"),
    (("--token-scale", "0.5"), "--token-scale: only with --trace"),
    (("--trace", "azure", "--rate", "2"), "--rate: a trace replay takes its arrivals from the trace; "
                                          "leave --rate out"),
])
def test_cli_trace_options_are_checked_as_for_a_drill_run_in_one_line(
        capsys: pytest.CaptureFixture[str], options: tuple[str, ...], message: str) -> None:
    commands = (("drill", "schedule", "add", "n", "--scenario", "replica-crash", "--cron", "0 3 * * *"),
                ("drill", "schedule", "edit", "sch-1"),
                ("drill", "run", "replica-crash"))  # a manual run says the same
    for command in commands:
        # refused before any request: nothing listens on the URL
        code = cli.main(["--url", "http://127.0.0.1:9", *command, *options])  # no token needed to refuse
        assert (code, capsys.readouterr().err) == (2, f"controlplane: {message}\n"), command


@pytest.mark.slow
def test_cli_schedule_aimed_at_a_missing_replica_under_a_trace_fails_its_firing_with_the_reason(
        tmp_path: Path, trace: Path) -> None:
    config, url = _config(tmp_path)
    log = tmp_path / "up.log"
    process = _up(config, log)
    try:
        wait_until(lambda: _cli(url, "list").returncode == 0, timeout=90, what=f"the control plane ({log})")
        added = _cli(url, "add", "crash-b1", "--scenario", "replica-crash", "--cron", "0 3 * * *",
                     "--replica", "az-b-1", "--trace", str(trace), "--compress", "2", "--token-scale", "0.5")
        assert added.returncode == 0, added.stderr
        bad = _cli(url, "add", "bad", "--scenario", "replica-crash", "--cron", "0 3 * * *",
                   "--replica", "az-a-0", "--replica", "az-b-1")
        assert (bad.returncode, bad.stderr.strip()) == (
            1, "controlplane: HTTP 400: overrides.replicas: replica-crash takes one replica, got 2"), \
            bad.stderr
        listed = _cli(url, "list")
        assert f"az-b-1; trace {trace} x2" in listed.stdout, listed.stdout
        with ControlPlaneClient(url, TOKEN) as client:
            (schedule,) = client.drill_schedules()
            assert schedule.overrides == {"replicas": ["az-b-1"], "load": {
                "kind": "trace", "trace": str(trace), "compress": 2.0, "token_scale": 0.5}}
            edited = _cli(url, "edit", schedule.id, "--zone", "az-c", "--replica", "az-c-2")
            assert edited.returncode == 0, edited.stderr
            assert client.drill_schedule(schedule.id).overrides["zones"] == ["az-c"]
            client.run_drill_schedule(schedule.id)
            runs = wait_until(lambda: client.drill_schedule_runs(schedule.id), timeout=30,
                              what="the firing in the history")
            assert client.drills() == []  # the fleet has no replica az-c-2: nothing started
        assert (runs[0].outcome, runs[0].drill_id) == ("error", None)
        assert "replicas: no replica 'az-c-2' in the fleet" in runs[0].reason, runs[0]
        shown = _cli(url, "runs", schedule.id)
        assert "error" in shown.stdout and "no replica 'az-c-2'" in shown.stdout
        both = _cli(url, "edit", schedule.id, "--any-replica", "--replica", "az-a-0")
        assert (both.returncode, both.stderr.strip()) == (
            2, "controlplane: --any-replica: leave --replica and --zone out")
        cleared = _cli(url, "edit", schedule.id, "--any-replica", "--poisson")
        assert cleared.returncode == 0, cleared.stderr
        with ControlPlaneClient(url, TOKEN) as client:
            assert client.drill_schedule(schedule.id).overrides == {}  # the busiest at t0, Poisson
    finally:
        _stop(process)
    assert process.returncode == 0, log.read_text()[-3000:]
