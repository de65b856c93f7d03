"""Where replicas run. ``ReplicaBackend`` is the seam: local subprocesses today, Kubernetes later."""

from controlplane.fleet.backends.base import ReplicaBackend, ReplicaHandle, ReplicaSpec

__all__ = ["ReplicaBackend", "ReplicaHandle", "ReplicaSpec"]
