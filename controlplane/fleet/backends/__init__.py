"""Where replicas run. ``ReplicaBackend`` is the seam: local subprocesses (``local``) or detached actors on
a Ray cluster (``ray``, also under KubeRay); ``select.replica_backend`` builds the one that
``[fleet] backend`` names."""

from controlplane.fleet.backends.base import ReplicaBackend, ReplicaHandle, ReplicaSpec

__all__ = ["ReplicaBackend", "ReplicaHandle", "ReplicaSpec"]
