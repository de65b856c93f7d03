"""Which backend runs the replicas, from ``[fleet] backend``: the one place that builds one."""

from __future__ import annotations

from pathlib import Path

from controlplane.fleet.backends.base import ReplicaBackend
from controlplane.fleet.backends.local import LocalProcessBackend
from controlplane.fleet.config import FleetConfig


def replica_backend(cfg: FleetConfig, state: Path) -> ReplicaBackend:
    """Local processes, or actors on the Ray cluster at ``ray_address`` (joined here: RayUnavailable, in
    one line, when Ray is not installed or the cluster does not answer)."""
    if cfg.backend == "local":
        return LocalProcessBackend(log_dir=state / "logs", state_dir=state, fork=cfg.fork_replicas)
    from controlplane.fleet.backends.ray import RayBackend, connect, namespace_for
    from controlplane.fleet.backends.ray_thread import RayPlacement

    namespace = cfg.ray_namespace or namespace_for(state)
    ray = connect(cfg.ray_address, namespace, timeout_s=cfg.ray_connect_timeout_s)
    placement = RayPlacement(namespace, zoned=cfg.ray_address != "local", num_cpus=cfg.ray_num_cpus,
                             num_gpus=cfg.ray_num_gpus, num_npus=cfg.ray_num_npus,
                             log_dir=str(state / "logs"), state_dir=str(state))
    return RayBackend(ray, placement)
