"""``controlplane up`` as a user runs it: start, serve, CLI, crash and restart, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from controlplane.views import MetricSummary

from .conftest import Running, poll, prometheus_pids, replica_pids, start, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_up_serves_three_ready_replicas_in_three_zones_and_sigterm_leaves_no_child(running: Running) -> None:
    seconds = wait_ready(running, 3)
    print(f"3 replicas ready {seconds:.1f}s after start")
    with running.client() as client:
        fleet = client.fleet()
    assert sorted(r.zone for r in fleet.replicas) == ["az-a", "az-b", "az-c"]
    sent = 0

    def complete(count: int) -> None:
        nonlocal sent
        for _ in range(count):
            response = httpx.post(f"{running.gateway}/v1/completions",
                                  json={"prompt": f"hi {sent}", "max_tokens": 4}, timeout=30)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
            sent += 1

    def summary_under_traffic() -> MetricSummary:
        # a rate needs two scrapes of a counter that moved between them: traffic that all came before a
        # replica's first scrape (a busy machine) shows as no rate, so it goes on while the test waits
        complete(2)
        return client.summary("fleet")

    complete(25)
    with running.client() as client:
        # the gateway delivers traces in batches each second: the first 20 requests are all kept (the
        # sampler keeps everything until it knows the tail), the rest sampled
        traces = poll(lambda: client.slow_traces(limit=100), lambda t: len(t) >= 20)
        summary = poll(summary_under_traffic, lambda s: s.qps and s.ttft.p99)
        zone = client.summary("zone:az-a")
    assert len(traces) >= 20 and traces[0].e2e_s >= traces[-1].e2e_s  # slowest first
    assert {t.replica_id for t in traces} <= {r.replica_id for r in fleet.replicas}
    assert all(t.prefill_s is not None and t.gateway_s >= 0 for t in traces)
    assert summary.ttft.p50 is not None and summary.ttft.p99 is not None
    assert summary.ttft.p50 <= summary.ttft.p99 and len(summary.replicas) == 3
    assert zone.replicas == ("az-a-1",)
    children = replica_pids(running.state_dir)
    assert len(children) == 3
    assert len(prometheus_pids(running.state_dir)) == 1
    spec = httpx.get(f"{running.api}/openapi.json", timeout=10).json()  # the spec itself is public
    paths = set(spec["paths"])
    for path in ("/api/v1/fleet", "/api/v1/fleet/scale", "/api/v1/fleet/rollout", "/api/v1/events",
                 "/api/v1/metrics/summary", "/api/v1/traces/slow"):
        assert path in paths, sorted(paths)
    assert "/api/v1/fleet/replicas/{replica_id}/restart" in paths and "/api/v1/audit" in paths

    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(90) == 0
    assert replica_pids(running.state_dir) == set()
    assert prometheus_pids(running.state_dir) == set()
    log = running.log.read_text()
    assert "stopped" in log
    assert "Traceback" not in log, log[-3000:]  # a stop is an orderly one (gateways' long polls answered)


def test_bad_config_fails_at_start_with_file_key_and_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[fleet]\nreplicas = \"three\"\n")
    result = subprocess.run([sys.executable, "-m", "controlplane", "up", "--config", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1  # refused
    assert result.stderr.strip() == f"controlplane: {bad}: fleet.replicas: must be int, got str 'three'"


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
    assert bad.returncode == 1 and "HTTP 401" in bad.stderr
    assert bad.stderr.count("\n") == 1  # one line, no traceback


def test_kill_9_of_the_control_plane_then_restart_adopts_every_replica(model_state: Path,
                                                                        running: Running) -> None:
    wait_ready(running, 3)
    with running.client() as client:
        client.scale(4)  # acknowledged: must survive the crash below
    wait_ready(running, 4)
    before = replica_pids(running.state_dir)
    running.process.send_signal(signal.SIGKILL)
    running.process.wait(10)
    assert replica_pids(running.state_dir) == before  # replicas outlive a crashed control plane

    config = next(model_state.glob("controlplane.toml"))
    again = start(config, model_state, running.token)
    try:
        wait_ready(again, 4)
        with again.client() as client:
            fleet = client.fleet()
            adopted = client.events(kind="replica.adopted")
        assert {r.pid for r in fleet.replicas} == before and len(adopted) == 4
        assert fleet.desired_replicas == 4
    finally:
        again.process.send_signal(signal.SIGTERM)
        assert again.process.wait(90) == 0
    assert replica_pids(running.state_dir) == set()
