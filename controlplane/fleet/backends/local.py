"""Replicas as local subprocesses: ``python -m inference serve``, one per replica, each in its own session.

Own sessions keep a terminal's Ctrl-C away from the replicas: the control plane drains them itself. After
a crash of the control plane the replicas keep running, and the next control plane adopts them by pid
(checking the command line names the same replica) or stops them.
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
from inference.launcher import replica_environment

logger = logging.getLogger(__name__)


class LocalProcessBackend:
    places_replicas = False  # a replica listens where its spec says, on this host

    def __init__(self, *, log_dir: Path, state_dir: Path) -> None:
        self.log_dir = log_dir
        self.state_dir = state_dir
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def command(self, spec: ReplicaSpec) -> list[str]:
        return [sys.executable, "-m", "inference", "serve", "--model", spec.model, "--host", spec.host,
                "--port", str(spec.port), "--replica-id", spec.replica_id, "--zone", spec.zone,
                "--num-threads", str(spec.threads), "--max-num-seqs", str(spec.max_num_seqs),
                "--drain-timeout", str(spec.drain_timeout_s), *spec.engine_args(), *spec.tracing_args()]

    def spawn(self, spec: ReplicaSpec) -> ReplicaHandle:
        log_path = self.log_dir / f"{spec.replica_id}.log"
        env = replica_environment({"LLMSRE_STATE_DIR": str(self.state_dir),
                                   "INFERENCE_ADMIN_TOKEN": spec.admin_token})  # not on the command line (ps)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(self.command(spec), stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        self._children[process.pid] = process
        logger.info("[%s] spawned pid %d on port %d (zone %s, model %s)", spec.replica_id, process.pid,
                    spec.port, spec.zone, spec.model)
        return ReplicaHandle(spec.replica_id, process.pid, str(log_path))

    def is_running(self, handle: ReplicaHandle) -> bool:
        if handle.pid is None:
            return False
        child = self._children.get(handle.pid)
        if child is not None:
            return child.poll() is None
        return _pid_alive(handle.pid)

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        child = self._children.get(handle.pid) if handle.pid is not None else None
        return None if child is None else child.poll()

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
            child.poll()
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
        reuses them within minutes): a child of ours only while it is unreaped, an adopted one only while
        its pid still runs this replica of this state folder."""
        if handle.pid is None:
            return
        child = self._children.get(handle.pid)
        if child is not None:
            if child.poll() is None:
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
