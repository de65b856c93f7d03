"""The drills that crash the platform's own processes, run from the CLI against a real ``controlplane up``.

control-plane-crash: the drill kills the control plane that started it, keeps it down, starts it again and
must pass every target of the scenario (no failed request, no token lost or repeated, no acknowledged
write lost, no fault past its expiry, no orphaned process, the API back within its RTO).

gateway-crash: with two gateway processes sharing the address, one is killed; the report says what the
clients lost and what a retry would have recovered, the service is back within the target, and the killed
gateway runs again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from chaos.scenarios import scenario

from .conftest import Running, gateway_pids, replica_pids, shutdown, start, wait_ready, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "admin-token-for-crash-drills"


def cli(running: Running, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTROLPLANE_TOKEN": running.token}
    return subprocess.run([sys.executable, "-m", "controlplane", *args, "--url", running.api], env=env,
                          capture_output=True, text=True, timeout=timeout)


def report_of(running: Running, drill_id: int) -> dict[str, object]:
    shown = cli(running, "drill", "show", str(drill_id), timeout=30)  # the whole report, as JSON
    assert shown.returncode == 0, shown.stderr
    return dict(json.loads(shown.stdout))


def _drill_id(stdout: str) -> int:
    first = stdout.splitlines()[0]  # "drill 3: control-plane-crash started; ..."
    return int(first.split(":")[0].split()[1])


def test_control_plane_crash_drill_passes_its_targets_from_the_cli(model_state: Path) -> None:
    config = write_config(model_state)
    running = start(config, model_state, TOKEN)
    restarted: int | None = None
    try:
        wait_ready(running, 3)
        done = cli(running, "drill", "run", "control-plane-crash", "--wait")
        print(done.stdout[-3000:])  # the report as the CLI shows it (pytest -s)
        drill_id = _drill_id(done.stdout)
        report = report_of(running, drill_id)
        restarted = report.get("controlplane_pid")  # type: ignore[assignment]
        assert running.process.wait(5) == -signal.SIGKILL  # the drill killed the control plane it ran in
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert report["status"] == "passed", report.get("error") or report.get("checks")
        figures = report["figures"]
        assert isinstance(figures, dict)
        targets = scenario("control-plane-crash").targets
        assert figures["requests_failed"] == 0 and figures["tokens_lost"] == 0
        assert figures["tokens_duplicated"] == 0
        assert figures["writes_lost"] == 0 and figures["faults_past_expiry"] == 0 and figures["orphans"] == 0
        assert targets.rto_api_s is not None and 0 < figures["rto_api_s"] <= targets.rto_api_s
        writes = report["writes"]
        assert isinstance(writes, dict) and writes["acknowledged"] >= 3 and writes["lost"] == []
        assert isinstance(restarted, int) and psutil.pid_exists(restarted)
    finally:
        _stop(restarted)
        shutdown(running, leftovers=lambda: gateway_pids(running.state_dir))
    assert replica_pids(running.state_dir) == set() and gateway_pids(running.state_dir) == set()


def test_gateway_crash_drill_reports_what_clients_lose_and_the_gateway_returns(model_state: Path) -> None:
    config = write_config(model_state, gateways=2)
    running = start(config, model_state, TOKEN)
    try:
        wait_ready(running, 3)
        before = gateway_pids(running.state_dir)
        assert len(before) == 2
        done = cli(running, "drill", "run", "gateway-crash", "--wait")
        print(done.stdout[-3000:])  # the report as the CLI shows it (pytest -s)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        report = report_of(running, _drill_id(done.stdout))
        assert report["status"] == "passed"
        loss = report["client_loss"]
        assert isinstance(loss, dict)
        assert loss["failed"] == loss["failed_before_first_token"] + loss["failed_mid_stream"]
        target = scenario("gateway-crash").targets.rto_service_s
        assert target is not None and report["figures"]["rto_service_s"] <= target  # type: ignore[index]
        deadline = time.monotonic() + 30
        while len(after := gateway_pids(running.state_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(after) == 2 and len(after & before) == 1  # one killed, restarted under a new pid
    finally:
        shutdown(running, leftovers=lambda: gateway_pids(running.state_dir))


def _stop(pid: int | None) -> None:
    """The control plane the drill started again is no child of the test: stop it as Ctrl-C would."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).wait(90)
