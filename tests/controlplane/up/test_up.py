"""``controlplane up`` as a user runs it: a real process with real replicas, gateway, API and Prometheus.

Ports are picked free on loopback and passed through a TOML config, so the test never collides with a
control plane already running on the default ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from controlplane.client import ControlPlaneClient
from inference.launcher import free_port
from inference.models.default import ensure_default_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

START_TIMEOUT_S = 150.0


@dataclass
class Running:
    process: subprocess.Popen[str]
    api: str
    gateway: str
    token: str
    state_dir: Path
    log: Path

    def client(self) -> ControlPlaneClient:
        return ControlPlaneClient(self.api, self.token)


def write_config(tmp: Path, *, replicas: int = 3) -> Path:
    config = tmp / "controlplane.toml"
    config.write_text(f"""
state_dir = "{tmp / 'state'}"
[api]
port = {free_port()}
[gateway]
port = {free_port()}
[fleet]
replicas = {replicas}
base_port = {free_port() + 100}
[prometheus]
port = {free_port()}
scrape_interval_s = 1.0
""")
    return config


def start(config: Path, tmp: Path, token: str) -> Running:
    import tomllib

    raw = tomllib.loads(config.read_text())
    log = tmp / f"up-{time.monotonic_ns()}.log"
    env = {**os.environ, "CONTROLPLANE_ADMIN_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    return Running(process, f"http://127.0.0.1:{raw['api']['port']}",
                   f"http://127.0.0.1:{raw['gateway']['port']}", token, Path(raw["state_dir"]), log)


def wait_ready(running: Running, want: int) -> float:
    started = time.monotonic()
    deadline = started + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert running.process.poll() is None, running.log.read_text()[-3000:]
        try:
            with running.client() as client:
                if client.fleet().ready_replicas >= want:
                    return time.monotonic() - started
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"fleet not ready in time:\n{running.log.read_text()[-3000:]}")


def replica_pids(state_dir: Path) -> set[int]:
    """Processes serving a replica for this state dir (children of any control plane)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"serve" in cmd and b"inference" in cmd and str(state_dir).encode() in env:
            pids.add(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def model_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("up")
    ensure_default_model(tmp / "state")  # built once, before three replicas race for it
    return tmp


@pytest.fixture
def running(model_state: Path) -> Iterator[Running]:
    config = write_config(model_state)
    proc = start(config, model_state, "admin-token-for-tests")
    try:
        yield proc
    finally:
        if proc.process.poll() is None:
            proc.process.send_signal(signal.SIGTERM)
            try:
                proc.process.wait(60)
            except subprocess.TimeoutExpired:
                proc.process.kill()
        for pid in replica_pids(proc.state_dir):
            os.kill(pid, signal.SIGKILL)


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

    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(90) == 0
    assert replica_pids(running.state_dir) == set()
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
