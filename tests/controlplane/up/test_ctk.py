"""Chaos Toolkit against a live ``controlplane up``: Chaos Toolkit's own ``chaos run`` executes an
experiment whose actions and probes are ``chaos.ctk`` (steady state: three ready replicas -> kill one ->
probe -> rollback), then ``controlplane chaos run`` runs the same file with our native runner, and once more
with a stop condition (ready replicas below 3) that aborts it. Before that, a dry run and a malformed
experiment change nothing. (One test: each live control plane costs a minute of start-up here.)

A crashed control plane's active pause being reverted at the next start is covered by test_chaos.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from controlplane.client import ApiError

from .conftest import Running, poll, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHAOS = Path(sys.executable).parent / "chaos"
VICTIM = "az-b-1"


def ctk(func: str, activity_type: str = "action", **arguments: Any) -> dict[str, Any]:
    return {"type": activity_type, "name": func.replace("_", "-"),
            "provider": {"type": "python", "module": "chaos.ctk", "func": func, "secrets": ["controlplane"],
                         "arguments": arguments}}


def experiment(api: str) -> dict[str, Any]:
    ready = ctk("wait_for_ready_replicas", "probe", at_least=3, timeout_s=180)
    ready["tolerance"] = 3
    probe = ctk("active_faults", "probe")
    probe["pauses"] = {"after": 1}
    return {
        "title": "a killed replica comes back",
        "description": "kill one replica through the control plane; the fleet restarts it",
        "configuration": {"controlplane_url": api},
        "secrets": {"controlplane": {"controlplane_token": {"type": "env", "key": "CONTROLPLANE_TOKEN"}}},
        "steady-state-hypothesis": {"title": "three replicas ready", "probes": [ready]},
        # The rollback reverts the fault long before its duration ends, even on a loaded machine where
        # the restart waited for CPU (CI once took over 30 s from the kill to the rollback).
        "method": [ctk("inject_fault", kind="kill", duration_s=180, replicas=[VICTIM]), probe],
        "rollbacks": [ctk("revert_active_faults")],
    }


def victim_pid(running: Running) -> int | None:
    with running.client() as client:
        return next(r.pid for r in client.fleet().replicas if r.replica_id == VICTIM)


def check_dry_run_and_malformed_change_nothing(running: Running, path: Path, tmp_path: Path,
                                               env: dict[str, str]) -> None:
    pid = victim_pid(running)
    dry = subprocess.run([sys.executable, "-m", "controlplane", "--url", running.api, "chaos", "run",
                          str(path), "--dry-run", "--min-ready", "2"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "(dry run)" in dry.stdout and "chaos.ctk.inject_fault" in dry.stdout
    assert "ready_replicas < 2" in dry.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**experiment(running.api), "method": [ctk("inject_fault", nope=1)]}))
    refused = subprocess.run([sys.executable, "-m", "controlplane", "--url", running.api, "chaos", "run",
                              str(bad)], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1  # refused before anything ran
    assert refused.stderr.strip().startswith("controlplane: method[0].provider.arguments")
    assert len(refused.stderr.strip().splitlines()) == 1
    assert victim_pid(running) == pid
    with running.client() as client:
        assert client.chaos_faults() == []


def test_chaos_toolkit_and_native_runner_drive_a_live_control_plane(running: Running,
                                                                    tmp_path: Path) -> None:
    wait_ready(running, 3)
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment(running.api), indent=2))
    env = {**os.environ, "CONTROLPLANE_TOKEN": running.token}
    check_dry_run_and_malformed_change_nothing(running, path, tmp_path, env)

    # 1. Chaos Toolkit's own runner.
    before = victim_pid(running)
    started = time.monotonic()
    command = [str(CHAOS), "--no-version-check", "--no-log-file", "--settings",
               str(tmp_path / "settings.yaml"), "run", "--journal-path", str(tmp_path / "ctk.json"),
               str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    ctk_s = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    journal = json.loads((tmp_path / "ctk.json").read_text())
    assert journal["status"] == "completed" and journal["deviated"] is False
    inject, probe = journal["run"]
    assert inject["status"] == "succeeded" and [f["target"] for f in inject["output"]["faults"]] == [VICTIM]
    fault_id = inject["output"]["faults"][0]["id"]
    assert [f["id"] for f in probe["output"]] == [fault_id]
    assert journal["steady_states"]["after"]["probes"][0]["output"] == 3
    [rollback] = journal["rollbacks"]
    assert rollback["status"] == "succeeded" and rollback["output"] == [fault_id]
    assert running.token not in (tmp_path / "ctk.json").read_text()
    with running.client() as client:
        assert client.fleet().ready_replicas == 3 and client.chaos_faults() == []
        assert "chaos.inject" in {a.action for a in client.audit(limit=100)}
    assert victim_pid(running) not in (None, before)  # the fleet restarted it

    # 2. The same file with our native runner, through the CLI.
    before = victim_pid(running)
    native = subprocess.run([sys.executable, "-m", "controlplane", "--url", running.api, "chaos", "run",
                             str(path), "--journal", str(tmp_path / "native.json")], env=env,
                            capture_output=True, text=True, timeout=400)
    assert native.returncode == 0, native.stdout[-3000:] + native.stderr[-3000:]
    assert "status: completed" in native.stdout
    journal = json.loads((tmp_path / "native.json").read_text())
    assert journal["status"] == "completed" and not journal["deviated"] and journal["fault_ids"] == [
        journal["run"][0]["output"]["faults"][0]["id"]]
    assert journal["steady_states"]["after"]["steady_state_met"]
    assert victim_pid(running) not in (None, before)
    wait_ready(running, 3)

    # 3. With a stop condition: one replica down trips "ready replicas < 3" and aborts the run.
    aborted = subprocess.run([sys.executable, "-m", "controlplane", "--url", running.api, "chaos", "run",
                              str(path), "--min-ready", "3", "--check-interval", "0.2", "--json"], env=env,
                             capture_output=True, text=True, timeout=400)
    assert aborted.returncode == 1, aborted.stdout[-3000:] + aborted.stderr[-3000:]
    journal = json.loads(aborted.stdout)
    assert journal["status"] == "aborted" and journal["stop_condition"]["name"] == "ready_replicas"
    assert journal["stop_condition"]["value"] < 3 and journal["steady_states"]["after"] is None
    assert [r["fault_id"] for r in journal["abort_reverts"]] == journal["fault_ids"] != []
    wait_ready(running, 3)
    with running.client() as client:
        assert client.chaos_faults() == []

    # 4. Through the REST API: the control plane runs it, its activities call back with the caller's token.
    check_rest_experiment(running)
    print(f"chaos run (Chaos Toolkit) against a live fleet: {ctk_s:.1f}s including the replica restart")


def check_rest_experiment(running: Running) -> None:
    body = experiment(running.api)
    with running.client() as client:
        with pytest.raises(ApiError) as refused:
            client.chaos_run_experiment(body)  # its secrets would read the server's environment
        assert refused.value.status == 400
        assert "environment lookups are not allowed here" in str(refused.value)
        del body["secrets"]
        foreign = {**body, "method": [{**ctk("inject_fault"), "provider": {"type": "python", "module": "os",
                                                                            "func": "getcwd"}}]}
        with pytest.raises(ApiError, match=r"only chaos\.ctk may run here"):
            client.chaos_run_experiment(foreign)
        before = victim_pid(running)
        started = client.chaos_run_experiment(body, min_ready=1)
        assert started.status == "running"
        done = poll(lambda: client.chaos_experiment(started.id), lambda e: e.status != "running", timeout=300)
        journal = done.journal
        assert done.status == "completed", journal
        assert journal["run"][0]["output"]["faults"][0]["target"] == VICTIM
        assert journal["stop_conditions"] == ["ready_replicas < 1"]
        listed = client.chaos_experiments()
        assert listed[0].id == started.id and listed[0].status == "completed"
        assert "chaos.experiment" in {a.action for a in client.audit(limit=100)}
        assert client.chaos_faults() == []
    assert victim_pid(running) not in (None, before)
    assert running.token not in json.dumps(journal)
