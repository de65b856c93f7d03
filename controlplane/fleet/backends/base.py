"""The interface between the fleet and whatever runs replica processes.

The fleet decides (how many, which model, which to drain); a backend only executes: start a replica
from a :class:`ReplicaSpec`, tell whether it still runs, stop it gracefully or at once, and find again
a replica that an earlier control plane started. Local processes listen where the spec says; a backend
that places replicas itself (Ray: a node of the replica's zone, a free port there) says where each one
listens once it knows (:meth:`ReplicaBackend.location`) and how its nodes fare (:meth:`ReplicaBackend.nodes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inference.config import TracingConfig, switch_args


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
    # The gateway's OTLP settings ([gateway] otlp_*), so that the replica's spans join the gateway's traces
    tracing: TracingConfig = field(default_factory=TracingConfig)
    version: str = ""  # a canary's version (the gateways' split label); "" for the stable fleet
    served_model_name: str = ""  # a canary answers to the stable fleet's model name, so clients see one
    cpu_decode_kernel: bool | None = None  # [fleet] cpu_decode_kernel
    packed_weights: bool | None = None  # [fleet] packed_weights
    cpu_limit: float | None = None  # [fleet] replica_cpu_limit

    def engine_args(self) -> list[str]:
        """``inference serve``'s engine flags beyond threads and batch size (none by default)."""
        limit = [] if self.cpu_limit is None else ["--cpu-limit", f"{self.cpu_limit:g}"]
        return [*switch_args("--cpu-decode-kernel", self.cpu_decode_kernel),
                *switch_args("--packed-weights", self.packed_weights), *limit]

    def tracing_args(self) -> list[str]:
        """``inference serve``'s trace export and model-name flags (none when not needed)."""
        t = self.tracing
        name = ["--served-model-name", self.served_model_name] if self.served_model_name else []
        return [*name, *(["--otlp-traces-endpoint", t.endpoint, "--otlp-sample-ratio", f"{t.sample_ratio:g}"]
                         if t.is_enabled else [])]


@dataclass(slots=True, frozen=True)
class ReplicaHandle:
    """How a backend finds its replica again (a pid here; a pod name elsewhere)."""

    replica_id: str
    pid: int | None
    log_path: str | None = None


@dataclass(slots=True, frozen=True)
class ReplicaLocation:
    """Where a placed replica listens, and on which node (``node``: the node's address, as people name
    it; ``node_id``: the backend's own id for it)."""

    host: str
    port: int
    node: str | None = None
    node_id: str | None = None
    pid: int | None = None  # its process, when it shares this machine's pid space (None: elsewhere)


@dataclass(slots=True, frozen=True)
class NodeState:
    """One node of the cluster a backend places replicas on, as last seen."""

    node_id: str
    address: str
    zone: str | None
    alive: bool


class ReplicaBackend(Protocol):
    places_replicas: bool
    """False: the replica listens on the spec's host and port; True: the backend picks node and port."""

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

    def forget(self, handle: ReplicaHandle) -> None:
        """The fleet is done with this handle (the replica exited or was removed): release what holds it."""
        ...

    def location(self, handle: ReplicaHandle) -> ReplicaLocation | None:
        """Where a placed replica listens, once known (None before; always None without placement)."""
        ...

    def nodes(self) -> Sequence[NodeState]:
        """The nodes replicas may run on, alive or lost (empty for local processes)."""
        ...
