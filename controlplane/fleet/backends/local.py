"""Replicas as local subprocesses: ``python -m inference serve``, one per replica, each in its own session.

Own sessions keep a terminal's Ctrl-C away from the replicas: the control plane drains them itself. After
a crash of the control plane the replicas keep running, and the next control plane adopts them by pid
(checking the command line names the same replica) or stops them.

With ``fork=True`` (``[fleet] fork_replicas``, the default of ``controlplane up``) each replica is forked
from a fork server that imported the replica's code once (:mod:`inference.forkserver`): ready in about
0.5 s instead of 2.5-3.5 s, at a sixth of the CPU, which a scale-up and a crashed replica's restart wait
for. Such a replica is the same process from outside (command line, environment, session, log); where the
fork server cannot fork it (still importing, gone, or a command line it cannot show) the replica is exec'd
as before and the log says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from controlplane.fleet.backends.base import NodeState, ReplicaHandle, ReplicaLocation, ReplicaSpec
from inference.cpu_limit import sweep
from inference.forkserver import ForkedProcess, ForkServer, ForkServerError, still_running
from inference.launcher import replica_environment

logger = logging.getLogger(__name__)


class LocalProcessBackend:
    places_replicas = False  # a replica listens where its spec says, on this host

    def __init__(self, *, log_dir: Path, state_dir: Path, fork: bool = False) -> None:
        self.log_dir = log_dir
        self.state_dir = state_dir
        self._children: dict[int, subprocess.Popen[bytes] | ForkedProcess] = {}
        log_dir.mkdir(parents=True, exist_ok=True)
        self._forkserver: ForkServer | None = None
        if fork:  # it imports while the control plane starts
            try:
                self._forkserver = self._new_forkserver()
            except ForkServerError as exc:
                logger.warning("replicas start with exec, not forked: %s", exc)

    def prepare(self) -> None:
        """Wait for the fork server's imports (a few seconds; called off the event loop before the first
        spawn), or give up forking with the reason logged."""
        if self._forkserver is not None:
            try:
                self._forkserver.wait_ready()
            except ForkServerError as exc:
                logger.warning("replicas start with exec, not forked: %s", exc)

    def close(self) -> None:
        """Stop the fork server (the replicas it forked are stopped by the fleet, or go on without it)."""
        if self._forkserver is not None:
            self._forkserver.close()

    def _new_forkserver(self) -> ForkServer:
        """Its environment is the replicas' less the admin token (``/proc/<pid>/environ`` of every replica
        it forks; the token goes to each replica over its pipe)."""
        env = replica_environment({"LLMSRE_STATE_DIR": str(self.state_dir)})
        return ForkServer(env, self.log_dir / "forkserver.log")

    def command(self, spec: ReplicaSpec) -> list[str]:
        return [sys.executable, "-m", "inference", "serve", "--model", spec.model, "--host", spec.host,
                "--port", str(spec.port), "--replica-id", spec.replica_id, "--zone", spec.zone,
                "--num-threads", str(spec.threads), "--max-num-seqs", str(spec.max_num_seqs),
                "--drain-timeout", str(spec.drain_timeout_s), *spec.engine_args(), *spec.tracing_args()]

    def spawn(self, spec: ReplicaSpec) -> ReplicaHandle:
        log_path = self.log_dir / f"{spec.replica_id}.log"
        env = replica_environment({"LLMSRE_STATE_DIR": str(self.state_dir),
                                   "INFERENCE_ADMIN_TOKEN": spec.admin_token})  # not on the command line (ps)
        command = self.command(spec)
        process: subprocess.Popen[bytes] | ForkedProcess | None = self._fork(spec, command[3:], env, log_path)
        if process is None:
            with open(log_path, "ab") as log:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
        self._children[process.pid] = process
        logger.info("[%s] spawned pid %d on port %d (zone %s, model %s, %s)", spec.replica_id, process.pid,
                    spec.port, spec.zone, spec.model,
                    "forked" if isinstance(process, ForkedProcess) else "exec'd")
        return ReplicaHandle(spec.replica_id, process.pid, str(log_path))

    def _fork(self, spec: ReplicaSpec, argv: list[str], env: dict[str, str],
              log_path: Path) -> ForkedProcess | None:
        """The replica forked from the fork server, or None (exec it) with the reason logged: a fork server
        that died is started again for the next replicas."""
        server = self._forkserver
        if server is None or not server.ready:
            if server is not None and server.died:
                logger.warning("the fork server is gone (%s): starting another", server.failure)
                self._forkserver = self._new_forkserver()
            return None
        try:
            return server.spawn(argv, env, log_path)
        except ForkServerError as exc:
            logger.warning("[%s] exec'd, not forked: %s", spec.replica_id, exc)
            return None

    def is_running(self, handle: ReplicaHandle) -> bool:
        if handle.pid is None:
            return False
        child = self._children.get(handle.pid)
        if child is not None:
            return still_running(child)
        return _pid_alive(handle.pid)

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        child = self._children.get(handle.pid) if handle.pid is not None else None
        return None if child is None or still_running(child) else child.returncode

    def drain(self, handle: ReplicaHandle) -> None:
        self._signal(handle, signal.SIGTERM)

    def kill(self, handle: ReplicaHandle) -> None:
        self._signal(handle, signal.SIGKILL)
        child = self._children.pop(handle.pid, None) if handle.pid is not None else None
        if child is not None:
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                logger.error("[%s] pid %d did not exit after SIGKILL", handle.replica_id, handle.pid)
        sweep()  # a killed replica leaves its CPU limit's group ([fleet] replica_cpu_limit)

    def forget(self, handle: ReplicaHandle) -> None:
        """Reap an exited child so that no zombie is left."""
        child = self._children.pop(handle.pid, None) if handle.pid is not None else None
        if child is not None:
            still_running(child)  # reaps an exited child (or closes a forked one's pidfd)
        sweep()  # a crashed replica leaves its CPU limit's group

    def adopt(self, spec: ReplicaSpec, pid: int | None) -> ReplicaHandle | None:
        if pid is None or not _pid_alive(pid):
            return None
        if not _is_our_replica(pid, spec.replica_id, self.state_dir):
            logger.warning("[%s] pid %d runs something else; not adopting it", spec.replica_id, pid)
            return None
        return ReplicaHandle(spec.replica_id, pid, str(self.log_dir / f"{spec.replica_id}.log"))

    def location(self, handle: ReplicaHandle) -> ReplicaLocation | None:
        return None

    def nodes(self) -> Sequence[NodeState]:
        return ()

    def _signal(self, handle: ReplicaHandle, sig: signal.Signals) -> None:
        """Signal the replica, never whatever runs under its pid now (pids are reused, and a busy host
        reuses them within minutes): a child of ours only while it is unreaped (a forked one through its
        pidfd), an adopted one only while its pid still runs this replica of this state folder."""
        if handle.pid is None:
            return
        child = self._children.get(handle.pid)
        if child is not None:
            if still_running(child):
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(sig)
            return
        if _is_our_replica(handle.pid, handle.replica_id, self.state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, sig)


def _pid_alive(pid: int) -> bool:
    """Running (or stopped): an exited process nobody reaped yet (a zombie) does not count."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's process: alive, though not ours to adopt
        return True


def _is_our_replica(pid: int, replica_id: str, state_dir: Path) -> bool:
    """``pid`` runs replica ``replica_id`` spawned for this state folder: another control plane's replica
    of the same name (``az-a-1`` is everyone's first), or whatever took the pid over since, is not ours."""
    try:
        process = psutil.Process(pid)
        args = process.cmdline()
        home = process.environ().get("LLMSRE_STATE_DIR")
    except psutil.Error:
        return False
    return "inference" in args and "serve" in args and "--replica-id" in args and \
        args[args.index("--replica-id") + 1] == replica_id and home is not None and \
        Path(home).resolve() == state_dir.resolve()
