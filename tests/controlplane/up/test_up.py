"""``controlplane up`` as a user runs it: start, serve, CLI, crash and restart, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import Running, prometheus_pids, replica_pids, start, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_up_serves_three_ready_replicas_in_three_zones_and_sigterm_leaves_no_child(running: Running) -> None:
    seconds = wait_ready(running, 3)
    print(f"3 replicas ready {seconds:.1f}s after start")
    with running.client() as client:
        fleet = client.fleet()
    assert sorted(r.zone for r in fleet.replicas) == ["az-a", "az-b", "az-c"]
    response = httpx.post(f"{running.gateway}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                          timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    children = replica_pids(running.state_dir)
    assert len(children) == 3
    assert len(prometheus_pids(running.state_dir)) == 1

    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(90) == 0
    assert replica_pids(running.state_dir) == set()
    assert prometheus_pids(running.state_dir) == set()
    assert "stopped" in running.log.read_text()


def test_cli_talks_to_the_api_and_refuses_a_bad_token(running: Running) -> None:
    wait_ready(running, 3)
    env = {**os.environ, "CONTROLPLANE_URL": running.api, "CONTROLPLANE_TOKEN": running.token}
    status = subprocess.run([sys.executable, "-m", "controlplane", "status"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert "3/3 replicas ready" in status.stdout
    bad_env = {**env, "CONTROLPLANE_TOKEN": "wrong"}
    bad = subprocess.run([sys.executable, "-m", "controlplane", "scale", "2"], env=bad_env,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "HTTP 401" in bad.stderr
    assert bad.stderr.count("\n") == 1  # one line, no traceback


def test_kill_9_of_the_control_plane_then_restart_adopts_every_replica(model_state: Path,
                                                                        running: Running) -> None:
    wait_ready(running, 3)
    before = replica_pids(running.state_dir)
    running.process.send_signal(signal.SIGKILL)
    running.process.wait(10)
    assert replica_pids(running.state_dir) == before  # replicas outlive a crashed control plane

    config = next(model_state.glob("controlplane.toml"))
    again = start(config, model_state, running.token)
    try:
        wait_ready(again, 3)
        with again.client() as client:
            pids = {r.pid for r in client.fleet().replicas}
            adopted = client.events(kind="replica.adopted")
        assert pids == before and len(adopted) == 3
    finally:
        again.process.send_signal(signal.SIGTERM)
        assert again.process.wait(90) == 0
    assert replica_pids(running.state_dir) == set()
