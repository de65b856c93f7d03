"""What the rest of the control plane knows about one replica: its address, zone, state and load.

The fleet owns replicas and publishes :class:`ReplicaEndpoint` snapshots; the gateway routes over them,
telemetry scrapes them, chaos targets them. :class:`ReplicaLoad` is the slice of a replica's metrics
that routing and autoscaling read.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ReplicaState(enum.Enum):
    STARTING = "starting"  # spawned, not yet ready
    READY = "ready"  # passing /ready, receives traffic
    UNREADY = "unready"  # running but failing /ready (hung, overloaded, device failure)
    DRAINING = "draining"  # finishing in-flight work before removal
    EJECTED = "ejected"  # failing: the gateway stopped routing to it until a probe passes
    CRASHED = "crashed"  # exited; the fleet restarts it with backoff
    STOPPED = "stopped"  # removed on purpose

    @property
    def is_routable(self) -> bool:
        return self is ReplicaState.READY


@dataclass(slots=True, frozen=True)
class ReplicaEndpoint:
    replica_id: str
    zone: str
    host: str
    port: int
    state: ReplicaState
    model: str  # the model folder or a bundled model's name ("default", "default-moe")
    pid: int | None = None
    generation: int = 0  # rollout generation (model version) it belongs to
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"{self.base_url}/admin/faults"

    def to_json(self) -> dict[str, Any]:
        """The endpoint as the gateways receive it (and keep on disk)."""
        return {"replica_id": self.replica_id, "zone": self.zone, "host": self.host, "port": self.port,
                "state": self.state.value, "model": self.model, "pid": self.pid,
                "generation": self.generation, "labels": [list(pair) for pair in self.labels]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ReplicaEndpoint:
        """The inverse of :meth:`to_json`; ``ValueError`` (or ``KeyError``) for a malformed entry."""
        port = int(raw["port"])
        if not 0 < port < 65536:
            raise ValueError(f"port: must be a TCP port, got {port}")
        pid = raw.get("pid")
        return cls(replica_id=str(raw["replica_id"]), zone=str(raw["zone"]), host=str(raw["host"]), port=port,
                   state=ReplicaState(raw["state"]), model=str(raw["model"]),
                   pid=None if pid is None else int(pid), generation=int(raw.get("generation", 0)),
                   labels=tuple((str(k), str(v)) for k, v in raw.get("labels", ())))


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """Instant load of one replica, from its /metrics page (vLLM names)."""

    replica_id: str
    num_waiting: float  # vllm:num_requests_waiting
    num_running: float  # vllm:num_requests_running
    kv_cache_usage: float  # vllm:kv_cache_usage_perc, 0..1
    observed_at: float  # monotonic seconds

    def to_json(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "num_waiting": self.num_waiting,
                "num_running": self.num_running, "kv_cache_usage": self.kv_cache_usage}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], *, observed_at: float) -> ReplicaLoad:
        """A load received from elsewhere, timed by the receiver's clock (``observed_at``)."""
        return cls(str(raw["replica_id"]), float(raw["num_waiting"]), float(raw["num_running"]),
                   float(raw["kv_cache_usage"]), observed_at)
