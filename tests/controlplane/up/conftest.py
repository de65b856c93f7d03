"""Fixtures that run ``controlplane up`` as a user does: a real process with real replicas, gateway, API
and Prometheus. Ports are picked free on loopback and passed through a TOML config, so the tests never
collide with a control plane already running on the default ports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from controlplane.client import ControlPlaneClient
from inference.launcher import free_port
from inference.models.default import ensure_default_model

START_TIMEOUT_S = 150.0
T = TypeVar("T")


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


def write_config(tmp: Path, *, replicas: int = 3, autoscaler: bool = False, alerts: bool = False,
                 gateways: int = 1) -> Path:
    """A config on free ports. The autoscaler and the alert loop are off unless asked for (then their
    tables are left for the caller to append): most tests assert exact replica counts and states, which a
    loop resizing or restarting the fleet under their load or faults would change."""
    config = tmp / "controlplane.toml"
    loops = {"autoscaler": autoscaler, "alerts": alerts}
    off = "".join(f"[{name}]\nenabled = false\n" for name, on in loops.items() if not on)
    config.write_text(f"""
state_dir = "{tmp / 'state'}"
[api]
port = {free_port()}
[gateway]
port = {free_port()}
processes = {gateways}
[fleet]
replicas = {replicas}
base_port = {free_port() + 100}
[prometheus]
port = {free_port()}
scrape_interval_s = 1.0
{off}""")
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
    """Seconds until ``want`` replicas are ready at the control plane and routable at the gateway (the
    gateway learns the replica set from the control plane's feed a moment after the fleet says ready)."""
    started = time.monotonic()
    deadline = started + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert running.process.poll() is None, running.log.read_text()[-3000:]
        try:
            with running.client() as client:
                if client.fleet().ready_replicas >= want and len(routable_at(running.gateway)) >= want:
                    return time.monotonic() - started
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"fleet not ready in time:\n{running.log.read_text()[-3000:]}")


def routable_at(gateway: str) -> list[str]:
    """The replicas a gateway routes to now, by its ``/health``."""
    health = httpx.get(f"{gateway}/health", timeout=5, trust_env=False).json()
    return list(health["routable"])


def processes(match: Callable[[list[bytes], Path], bool]) -> set[int]:
    """Processes whose command line (split on NULs) and ``/proc`` folder ``match`` accepts, less any
    whose parent has the same command line: a child between its fork and its exec reads as its parent for
    that moment (a gateway's imports run ``ldconfig -p``, a replica's start runs ``ninja``), and a scan
    once caught a third gateway that way."""
    found: dict[int, bytes] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            if match(cmd.split(b"\0"), proc):
                found[int(proc.name)] = cmd
        except OSError:
            continue
    return {pid for pid, cmd in found.items() if found.get(_parent(pid)) != cmd}


def _parent(pid: int) -> int | None:
    try:  # the field after the command name, which may itself hold ") "
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def replica_pids(state_dir: Path) -> set[int]:
    """Processes serving a replica for this state dir (children of any control plane)."""
    return processes(lambda cmd, proc: b"serve" in cmd and b"inference" in cmd
                     and str(state_dir).encode() in (proc / "environ").read_bytes())


def console_pids_of(api: str) -> set[int]:
    """Console processes serving this control plane (they outlive a killed control plane, to be adopted)."""
    return processes(lambda cmd, _: b"dashboards" in cmd and b"--api" in cmd
                     and cmd[cmd.index(b"--api") + 1] == api.encode())


def gateway_pids(state_dir: Path) -> set[int]:
    """Gateway processes whose state lives under this state dir (they outlive a killed control plane)."""
    return processes(lambda cmd, _: b"controlplane.gateway" in cmd
                     and any(a.startswith(f"{state_dir}/gateways/".encode()) for a in cmd))


@pytest.fixture(scope="module")
def model_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("up")
    ensure_default_model(tmp / "state")  # built once, before three replicas race for it
    return tmp


def shutdown(running: Running, *, timeout: float = 90.0,
             leftovers: Callable[[], Iterable[int]] = lambda: ()) -> None:
    """Stop a control plane as Ctrl-C would (SIGTERM), kill it if it hangs, then kill whatever replica (or
    ``leftovers()`` process) survived it, so that a failing test still leaves no process behind."""
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(timeout)
        except subprocess.TimeoutExpired:
            running.process.kill()
    owned = replica_pids(running.state_dir) | gateway_pids(running.state_dir) | console_pids_of(running.api) \
        | prometheus_pids(running.state_dir)
    for pid in owned | set(leftovers()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def running(model_state: Path) -> Iterator[Running]:
    config = write_config(model_state)
    proc = start(config, model_state, "admin-token-for-tests")
    try:
        yield proc
    finally:
        shutdown(proc, timeout=60)




def prometheus_pids(state_dir: Path) -> set[int]:
    """Prometheus processes started for this state dir."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        is_prometheus = cmd.startswith(b"prometheus") or b"/prometheus\0" in cmd
        if is_prometheus and str(state_dir).encode() in cmd:
            pids.add(int(proc.name))
    return pids


def poll(fetch: Callable[[], T], done: Callable[[T], object], *, timeout: float = 30.0) -> T:
    """``fetch()`` until ``done(value)`` holds, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)
