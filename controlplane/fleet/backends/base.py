"""The interface between the fleet and whatever runs replica processes.

The fleet decides (how many, which model, which to drain); a backend only executes: start a replica
from a :class:`ReplicaSpec`, tell whether it still runs, stop it gracefully or at once, and find again
a replica that an earlier control plane started. A Kubernetes backend maps these verbs to pods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    replica_id: str
    zone: str
    host: str
    port: int
    model: str
    generation: int
    admin_token: str
    threads: int = 1
    max_num_seqs: int = 64
    drain_timeout_s: float = 30.0


@dataclass(slots=True, frozen=True)
class ReplicaHandle:
    """How a backend finds its replica again (a pid here; a pod name elsewhere)."""

    replica_id: str
    pid: int | None
    log_path: str | None = None


class ReplicaBackend(Protocol):
    def spawn(self, spec: ReplicaSpec) -> ReplicaHandle: ...

    def is_running(self, handle: ReplicaHandle) -> bool: ...

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        """The exit status once it has exited (None while running or when unknown)."""
        ...

    def drain(self, handle: ReplicaHandle) -> None:
        """Ask the replica to finish in-flight work and exit (SIGTERM for a process)."""
        ...

    def kill(self, handle: ReplicaHandle) -> None: ...

    def adopt(self, spec: ReplicaSpec, pid: int | None) -> ReplicaHandle | None:
        """Re-attach to a replica an earlier control plane started; None if it is gone or not ours."""
        ...
