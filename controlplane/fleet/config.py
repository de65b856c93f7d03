"""The fleet's section of the configuration (``[fleet]``)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_ZONES = ("az-a", "az-b", "az-c")


@dataclass(slots=True)
class FleetConfig:
    replicas: int = 3
    zones: list[str] = field(default_factory=lambda: list(DEFAULT_ZONES))
    model: str = "default"
    base_port: int = 8101
    replica_threads: int = 1  # torch threads per replica (three replicas share two cores)
    max_num_seqs: int = 64
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


def fleet_problems(cfg: FleetConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[fleet]``."""
    problems: list[tuple[str, str]] = []
    for key, ok, reason in (
        ("replicas", cfg.replicas >= 0, "must be >= 0"),
        ("zones", bool(cfg.zones), "must name at least one zone"),
        ("zones", len(set(cfg.zones)) == len(cfg.zones), "must not repeat a zone"),
        ("base_port", 0 < cfg.base_port < 65536 - 1000, "must leave room for replica ports"),
        ("on_restart", cfg.on_restart in ("adopt", "stop"), "must be adopt or stop"),
    ):
        if not ok:
            problems.append((f"fleet.{key}", reason))
    return problems
