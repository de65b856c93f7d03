"""Replicas forked from the fork server (:mod:`inference.forkserver`) are the replicas an exec starts: they
serve, read as ``python -m inference serve ...`` to ``ps`` and to the control plane's adoption, keep their
secret out of ``/proc/<pid>/environ``, run in their own session with their log, and outlive the fork
server; their exit status comes back, and what cannot be forked is refused with the reason."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from controlplane.fleet.backends.base import ReplicaHandle, ReplicaSpec
from controlplane.fleet.backends.local import LocalProcessBackend
from inference.forkserver import ForkedProcess, ForkServer, ForkServerError
from inference.launcher import ReplicaProcess, free_port, replica_environment

ADMIN = "admin-token-of-a-forked-replica"
READY_S = 120.0  # a forked replica is ready in about 0.5 s; this bounds a very busy host


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("forked")


@pytest.fixture(scope="module")
def server(state: Path) -> Iterator[ForkServer]:
    forks = ForkServer(replica_environment({"LLMSRE_STATE_DIR": str(state)}), state / "forkserver.log")
    try:
        forks.wait_ready()
        yield forks
    finally:
        forks.close()


def forked_replica(server: ForkServer, model: Path, replica_id: str, log: Path,
                   env: dict[str, str] | None = None) -> ReplicaProcess:
    """A replica forked through the launcher (as ``controlplane calibrate`` forks its replicas), ready."""
    replica = ReplicaProcess(free_port(), replica_id=replica_id, env=env or {}, log_path=log,
                             extra_args=["--model", str(model), "--num-threads", "1"], forkserver=server)
    replica.start()
    replica.wait_ready(READY_S)
    assert isinstance(replica.process, ForkedProcess)
    return replica


def test_a_forked_replica_serves_and_looks_exec_d_from_outside(server: ForkServer, state: Path,
                                                                 default_model_dir: Path) -> None:
    log = state / "az-a-1.log"
    replica = forked_replica(server, default_model_dir, "az-a-1", log,
                             {"LLMSRE_STATE_DIR": str(state), "INFERENCE_ADMIN_TOKEN": ADMIN})
    forked = replica.process
    assert isinstance(forked, ForkedProcess)
    try:
        answer = httpx.post(f"{replica.base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                            timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        # its command line, as psutil and a reader of the raw file split it, then one argument of blanks
        args = psutil.Process(forked.pid).cmdline()
        assert args[1:4] == ["-m", "inference", "serve"] and not args[-1].strip()
        assert args[args.index("--replica-id") + 1] == "az-a-1"
        raw = Path(f"/proc/{forked.pid}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in raw and raw[raw.index(b"--port") + 1] == str(replica.port).encode()
        # the state folder in its environment as the kernel shows it; the admin token only in the process
        environ = psutil.Process(forked.pid).environ()
        assert environ["LLMSRE_STATE_DIR"] == str(state) and "INFERENCE_ADMIN_TOKEN" not in environ
        faults = httpx.get(f"{replica.base_url}/admin/faults", timeout=10,
                           headers={"Authorization": f"Bearer {ADMIN}"})
        assert faults.status_code == 200, faults.text  # the token came over the pipe
        assert httpx.get(f"{replica.base_url}/admin/faults", timeout=10).status_code == 401
        assert os.getsid(forked.pid) == forked.pid  # a session of its own: no terminal's Ctrl-C
        assert psutil.Process(forked.pid).ppid() == server.process.pid
        assert "serving" in log.read_text()
    finally:
        forked.send_signal(signal.SIGKILL)
    assert forked.wait(30) == -signal.SIGKILL  # reaped by the fork server, which reports how
    assert not forked.running()


def test_a_replica_that_fails_at_start_exits_with_its_status_and_says_why(
        server: ForkServer, state: Path) -> None:
    log = state / "bad.log"
    replica = server.spawn(["serve", "--port", "not-a-port"], replica_environment(), log)
    assert replica.wait(60) == 2  # argparse's usage error, as an exec'd replica's
    assert "--port: invalid int value" in log.read_text()


def test_what_cannot_be_forked_is_refused_with_the_reason(server: ForkServer, state: Path) -> None:
    with pytest.raises(ForkServerError, match="does not fit"):
        server.spawn(["serve", "--served-model-name", "x" * 5000], replica_environment(), None)
    importing = ForkServer(replica_environment())
    try:  # asked before its imports are done: refused at once, so that the caller execs the replica
        with pytest.raises(ForkServerError, match="still importing"):
            importing.spawn(["serve"], replica_environment(), None)
    finally:
        importing.close()
    assert importing.process.returncode is not None


def test_replicas_outlive_their_fork_server(state: Path, default_model_dir: Path) -> None:
    """The control plane gone (its end of the pipe closed, as at ``kill -9``), the fork server exits and
    the replica it forked goes on serving: the data plane's static stability."""
    forks = ForkServer(replica_environment({"LLMSRE_STATE_DIR": str(state)}))
    forks.wait_ready()
    replica = forked_replica(forks, default_model_dir, "az-b-1", state / "az-b-1.log")
    try:
        forks.close()
        assert forks.process.returncode == 0  # it left at the end of its input, not killed
        answer = httpx.post(f"{replica.base_url}/v1/completions",
                            json={"prompt": "still here", "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200
        with pytest.raises(ForkServerError, match="exited with 0"):
            forks.spawn(["serve"], replica_environment(), None)
    finally:
        status = replica.stop()  # drained at SIGTERM
    assert status is None  # with its fork server gone nobody reports a status


def test_the_local_backend_forks_adopts_and_execs_when_its_fork_server_is_gone(
        tmp_path: Path, default_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path, fork=True)
    spec = ReplicaSpec("az-a-1", "az-a", "127.0.0.1", free_port(), str(default_model_dir), 1, "t")
    try:
        backend.prepare()
        handle = backend.spawn(spec)
        forked = backend._children[handle.pid]
        assert isinstance(forked, ForkedProcess)
        log, deadline = Path(handle.log_path or ""), time.monotonic() + READY_S
        while not (log.exists() and "serving" in log.read_text()) and time.monotonic() < deadline:
            assert forked.running()  # the log's "serving" line: it listens (the replica logs it then)
            time.sleep(0.1)
        # a control plane restarted after a crash adopts it: its command line and environment say whose
        restarted = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
        adopted = restarted.adopt(spec, handle.pid)
        assert adopted is not None and adopted.pid == handle.pid
        os.kill(handle.pid, signal.SIGKILL)  # it crashes: the fleet reads how, then forgets it
        forked.wait(30)
        assert not backend.is_running(handle) and backend.exit_status(handle) == -signal.SIGKILL
        backend.forget(handle)
        # its fork server killed: this replica is exec'd, and another fork server starts for the next
        server = backend._forkserver
        assert server is not None
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        deadline = time.monotonic() + 10
        while server.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING):
            second = backend.spawn(spec)
        assert isinstance(backend._children[second.pid], subprocess.Popen)
        assert "the fork server is gone" in caplog.text
        assert backend._forkserver is not server
    finally:
        for pid in list(backend._children):
            backend.kill(ReplicaHandle(spec.replica_id, pid))
        backend.close()
    assert backend._forkserver is not None and backend._forkserver.process.poll() is not None


def test_without_pidfds_the_backend_execs_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A kernel before Linux 5.3 has no pidfd, which holds each forked replica: no fork server then."""
    def no_pidfd(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    with caplog.at_level(logging.WARNING):
        backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path, fork=True)
    assert backend._forkserver is None
    assert "replicas start with exec, not forked: no pidfd on this system" in caplog.text
