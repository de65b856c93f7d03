"""What the rest of the control plane knows about one replica: its address, zone, state and load.

The fleet owns replicas and publishes :class:`ReplicaEndpoint` snapshots; the gateway routes over them,
telemetry scrapes them, chaos targets them. :class:`ReplicaLoad` is the slice of a replica's metrics
that routing and autoscaling read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
    model: str  # the model folder or "default"
    pid: int | None = None
    generation: int = 0  # rollout generation (model version) it belongs to
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"{self.base_url}/admin/faults"


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """Instant load of one replica, from its /metrics page (vLLM names)."""

    replica_id: str
    num_waiting: float  # vllm:num_requests_waiting
    num_running: float  # vllm:num_requests_running
    kv_cache_usage: float  # vllm:kv_cache_usage_perc, 0..1
    observed_at: float  # monotonic seconds
