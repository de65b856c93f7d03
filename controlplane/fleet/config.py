"""The fleet's section of the configuration (``[fleet]``)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_ZONES = ("az-a", "az-b", "az-c")
BACKENDS = ("local", "ray")
NODE_LOSS_POLICIES = ("stay", "spill")


@dataclass(slots=True)
class FleetConfig:
    replicas: int = 3
    zones: list[str] = field(default_factory=lambda: list(DEFAULT_ZONES))
    model: str = "default"
    base_port: int = 8101
    replica_threads: int = 1  # torch threads per replica (three replicas share two cores)
    max_num_seqs: int = 64
    # Replicas decode attention with the C++ paged kernel (inference/cpu_attention.py; CPU replicas, float32
    # or bfloat16 caches; built once per machine on first use). Unset: each replica's default, on where it
    # applies and builds; false: the torch path (the replica profile should then be calibrated without it,
    # `controlplane calibrate --no-cpu-decode-kernel`).
    cpu_decode_kernel: bool | None = None
    # Replicas lay their linear weights out once at load (CPU replicas, float32 or bfloat16: in the C++
    # kernel's blocks where it runs the dtype, else for oneDNN; 1.2-1.5x the tokens/s of torch's linear).
    # Unset: each replica's default, on where it applies; false: torch's linear (the replica profile should
    # then be calibrated without it, `controlplane calibrate --no-packed-weights`).
    packed_weights: bool | None = None
    # Each replica's CPU limit in cores (a cgroup's CFS quota, as a container's limits.cpu: `inference serve
    # --cpu-limit`); unset: none. A limited replica runs at the speed a profile calibrated under the same
    # limit measured (`controlplane calibrate --cpu-limit`) whatever else the host runs, as long as the
    # limits and the host's other work fit its cores. Needs root or a delegated cgroup: a replica that
    # cannot have its limit refuses to start, and the fleet reports it as crashing.
    replica_cpu_limit: float | None = None
    # Start each local replica by forking it from a process that has imported the replica's code once
    # (inference/forkserver.py): ready in about 0.5 s instead of 2.5-3.5 s, which a scale-up and a crashed
    # replica's restart wait for. false: a fresh `python -m inference serve` each (the Ray backend always).
    fork_replicas: bool = True
    ready_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    crash_loop_restarts: int = 5  # restarts within crash_loop_window_s that mark a crash loop
    crash_loop_window_s: float = 120.0
    reconcile_interval_s: float = 0.5
    health_interval_s: float = 1.0
    on_restart: str = "adopt"  # what a restarted control plane does with replicas it finds: adopt | stop
    rollout_observe_s: float = 10.0  # a new replica serves this long before the next step
    rollout_max_error_increase: float = 0.05  # new replica's 5xx share above the old ones': roll back
    # Where replicas run: "local" (subprocesses of this host) or "ray" (detached actors on a Ray cluster).
    backend: str = "local"
    # The Ray cluster: "auto" (the one running on this host), "ray://host:port" (a Ray Client, as for the
    # lab: ray://10.199.0.2:10001) or "local" (start a private single-node Ray).
    ray_address: str = "auto"
    ray_namespace: str = ""  # empty: "llmsre-" and a hash of the state folder (one per control plane)
    # How long to keep asking a cluster that answers but refuses a session. One refused attempt can take
    # 30 s (a head's Ray Client server that fails to start a session's server, a race inside Ray seen on a
    # freshly started head, answers after its own 30 s channel timeout), so this leaves room for retries.
    ray_connect_timeout_s: float = 120.0
    ray_num_cpus: float = 1.0  # Ray resources each replica's actor asks for
    ray_num_gpus: float = 0.0  # CUDA devices per replica (Ray's num_gpus)
    ray_num_npus: float = 0.0  # Ascend NPUs per replica (Ray's "NPU" resource)
    # When every node of a zone is lost: "stay" (its replicas wait in the zone for a node to come back)
    # or "spill" (they are re-placed in the zones that have nodes, and move back when it returns).
    on_node_loss: str = "stay"


def fleet_problems(cfg: FleetConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[fleet]``."""
    problems: list[tuple[str, str]] = []
    for key, ok, reason in (
        ("replicas", cfg.replicas >= 0, "must be >= 0"),
        ("zones", bool(cfg.zones), "must name at least one zone"),
        ("zones", len(set(cfg.zones)) == len(cfg.zones), "must not repeat a zone"),
        ("base_port", 0 < cfg.base_port < 65536 - 1000, "must leave room for replica ports"),
        ("on_restart", cfg.on_restart in ("adopt", "stop"), "must be adopt or stop"),
        ("backend", cfg.backend in BACKENDS, f"must be one of {', '.join(BACKENDS)}"),
        ("ray_address", cfg.ray_address in ("auto", "local") or _is_ray_url(cfg.ray_address),
         "must be auto, local or ray://host:port"),
        ("ray_connect_timeout_s", cfg.ray_connect_timeout_s > 0, "must be > 0"),
        ("replica_cpu_limit", cfg.replica_cpu_limit is None or cfg.replica_cpu_limit >= 0.1,
         "must be at least 0.1 (cores) or unset"),
        ("ray_num_cpus", cfg.ray_num_cpus >= 0, "must be >= 0"),
        ("ray_num_gpus", cfg.ray_num_gpus >= 0, "must be >= 0"),
        ("ray_num_npus", cfg.ray_num_npus >= 0, "must be >= 0"),
        ("on_node_loss", cfg.on_node_loss in NODE_LOSS_POLICIES,
         f"must be one of {', '.join(NODE_LOSS_POLICIES)}"),
    ):
        if not ok:
            problems.append((f"fleet.{key}", reason))
    return problems


def _is_ray_url(address: str) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return address.startswith("ray://") and bool(host) and port.isdigit() and 0 < int(port) < 65536
