"""What runs on a Ray node: the actor that starts, watches and stops one replica process there, and the
task that stops a whole node.

Where it sits: the Ray backend (:mod:`controlplane.fleet.backends.ray`, through the one thread that talks
to Ray, ``ray_thread.py``) creates one detached, named :class:`ReplicaActor` per replica and drives it;
Ray imports this module on the node, so it imports only the standard library, psutil and Ray (the replica
itself is ``python -m inference serve``, a child of the actor). The child dies with its actor
(``PR_SET_PDEATHSIG``): an actor killed by Ray, or lost with its node, leaves no replica process behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from inference.environment import child_environment

PR_SET_PDEATHSIG = 1
PORT_SEARCH = 200  # ports tried above the preferred one
STOP_WAIT_S = 5.0


def _die_with_parent() -> None:
    """In the child, between fork and exec: SIGKILL when the actor's process goes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _pid_space() -> str:
    """Which machine and pid namespace this runs in: pids compare only within one."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"


def _free_port(host: str, preferred: int) -> int:
    """The first port from ``preferred`` up that nobody listens on at ``host``."""
    for port in range(preferred, min(preferred + PORT_SEARCH, 65536)):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{preferred}, {preferred + PORT_SEARCH}) on {host}")


class ReplicaActor:
    """One replica on one node. Async methods: they all run on the actor's one event-loop thread, which
    is also the thread that forks the child (the death signal follows the forking thread)."""

    def __init__(self, replica_id: str) -> None:
        import ray

        self.replica_id = replica_id
        self.host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.node_id = ray.get_runtime_context().get_node_id()
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.starts = 0

    async def start(self, order: dict[str, Any]) -> dict[str, Any]:
        """Start the replica (a running one is killed first: a start asks for a fresh process)."""
        await self.signal("SIGKILL")
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_WAIT_S)
        self.port = _free_port(self.host, int(order["port"]))
        log_path = Path(order["log_path"])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "inference", "serve", "--host", self.host, "--port", str(self.port),
                   *order["args"]]
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env = child_environment(order["env"], base=base)  # the replica's own admin token, and no other secret
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        self.starts += 1
        return await self.status()

    async def status(self) -> dict[str, Any]:
        process = self.process
        return {"replica_id": self.replica_id, "host": self.host, "port": self.port, "node_id": self.node_id,
                "pid": process.pid if process else None,
                "returncode": process.poll() if process else None, "starts": self.starts,
                "pid_space": _pid_space()}

    async def signal(self, name: str) -> None:
        """SIGTERM (drain: the replica finishes its streams and exits) or SIGKILL to the replica."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.Signals[name])


def stop_this_node() -> int:
    """Kill this node's raylet and everything under it (workers, actors, their replicas), this task's
    own worker last: the node is lost as if its machine had died. A worker's parent is its raylet."""
    raylet = psutil.Process(os.getppid())
    if raylet.name() != "raylet":
        raise RuntimeError(f"this worker's parent is {raylet.name()!r}, not a raylet")
    victims = [p for p in raylet.children(recursive=True) if p.pid != os.getpid()]
    for process in [raylet, *victims]:
        with contextlib.suppress(psutil.Error):
            process.kill()
    os.kill(os.getpid(), signal.SIGKILL)
    return len(victims) + 1  # never returned: the caller learns of the stop from Ray's node table
