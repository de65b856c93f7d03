"""Stopping a replica or a gateway signals that process and nothing else.

A pid is reused once its process is reaped (here the kernel hands out at most 32,768, and a busy host
cycles through them within minutes), and another control plane on the host names its first replica
``az-a-1`` too. Real processes stand in for the other owners: a plain ``sleep``, and a process whose
command line and environment look like another state folder's replica or gateway.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.fleet import gateways
from controlplane.fleet.backends import local
from controlplane.fleet.backends.base import ReplicaHandle, ReplicaSpec
from controlplane.fleet.backends.local import LocalProcessBackend
from controlplane.fleet.gateways import ManagedGateway

SLEEP = "import time; time.sleep(60)"


def still_running(process: subprocess.Popen[bytes]) -> bool:
    """Alive a moment after any signal that was sent (a SIGKILL lands when the process next runs)."""
    try:
        process.wait(0.5)
    except subprocess.TimeoutExpired:
        return True
    return False


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, env=env, start_new_session=True)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def replica_lookalike(replica_id: str = "az-a-1") -> list[str]:
    """A command line as a replica's reads to ``ps``: python ... inference serve --replica-id ID."""
    return [sys.executable, "-c", SLEEP, "inference", "serve", "--replica-id", replica_id]


def spec(replica_id: str = "az-a-1") -> ReplicaSpec:
    return ReplicaSpec(replica_id, "az-a", "127.0.0.1", 1, "default", 1, "t")


def test_a_pid_that_runs_something_else_is_neither_adopted_nor_signalled(
        tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    other = spawn(["sleep", "60"])
    processes.append(other)
    backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    handle = ReplicaHandle("az-a-1", other.pid)
    assert backend.adopt(spec(), other.pid) is None
    backend.drain(handle)
    backend.kill(handle)
    assert still_running(other), "a process that is not the replica was signalled"


def test_another_state_folders_replica_of_the_same_name_is_not_ours(
        tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    twin = spawn(replica_lookalike(), env={"LLMSRE_STATE_DIR": str(theirs), "PATH": "/usr/bin:/bin"})
    processes.append(twin)
    mine = LocalProcessBackend(log_dir=ours / "logs", state_dir=ours)
    handle = ReplicaHandle("az-a-1", twin.pid)
    assert mine.adopt(spec(), twin.pid) is None
    mine.kill(handle)
    assert still_running(twin), "another state folder's replica was killed"
    owner = LocalProcessBackend(log_dir=theirs / "logs", state_dir=theirs)  # its own control plane: yes
    adopted = owner.adopt(spec(), twin.pid)
    assert adopted is not None and adopted.pid == twin.pid
    owner.kill(adopted)
    assert twin.wait(10) == -signal.SIGKILL


def test_a_reaped_child_is_not_signalled_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a child is reaped its pid may run anything: no signal goes to it any more. (Which process
    takes a pid next cannot be arranged, so the test watches os.kill instead of a reused pid.)"""
    backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    child = subprocess.Popen(["true"])
    child.wait()  # reaped, as the control plane's health check reaps a replica that crashed
    backend._children[child.pid] = child
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(local.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    backend.drain(ReplicaHandle("az-a-1", child.pid))
    backend.kill(ReplicaHandle("az-a-1", child.pid))
    assert sent == []


def test_gateways_signal_only_their_own_process(tmp_path: Path, processes: list[subprocess.Popen[bytes]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    twin = spawn([sys.executable, "-c", SLEEP, "controlplane.gateway", "--name", "gw-1", "--state-dir",
                  str(theirs / "gateways" / "gw-1")])
    processes.append(twin)
    adopted = ManagedGateway("gw-1", 1, pid=twin.pid)
    gateways._signal(adopted, signal.SIGKILL, ours)
    assert still_running(twin), "another state folder's gateway was killed"
    assert not gateways._is_our_gateway(twin.pid, "gw-1", ours)
    assert gateways._is_our_gateway(twin.pid, "gw-1", theirs)
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(gateways.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    gateways._signal(ManagedGateway("gw-1", 1, pid=reaped.pid, process=reaped), signal.SIGTERM, ours)
    assert sent == []
    gateways._signal(adopted, signal.SIGKILL, theirs)  # its own control plane: yes
    assert sent == [(twin.pid, signal.SIGKILL)]
