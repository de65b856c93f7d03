"""Checks of the autoscaler's configuration: bounds, targets, guards, the replica profile and the windows.

The configuration loader (:func:`controlplane.config.validate`) and the live loop (a policy change through
the API) ask :func:`autoscaler_problems` before they accept a value.
"""

from __future__ import annotations

from controlplane.autoscale.config import AUTOSCALER_METRICS, AutoscalerConfig
from controlplane.autoscale.profile import load_profile
from controlplane.autoscale.windows import window_problems


def autoscaler_problems(cfg: AutoscalerConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[autoscaler]``, its windows and its replica profile."""
    problems: list[tuple[str, str]] = []

    def check(ok: bool, key: str, reason: str) -> None:
        if not ok:
            problems.append((f"autoscaler.{key}", reason))

    check(cfg.tick_s > 0, "tick_s", "must be > 0")
    check(0 <= cfg.min_replicas <= cfg.max_replicas, "min_replicas",
          f"need 0 <= min_replicas <= max_replicas, got {cfg.min_replicas}/{cfg.max_replicas}")
    for key in ("target_waiting_per_replica", "target_kv_cache_usage", "ttft_slo_s", "tpot_slo_s",
                "target_tokens_per_s_per_replica", "target_engine_load_per_replica", "anomaly_cooldown_s",
                "anomaly_min_rate_sigma", "anomaly_min_ttft_sigma_s"):
        check(getattr(cfg, key) > 0, key, "must be > 0")
    problems.extend(_policy_problems(cfg))
    check(0 <= cfg.tolerance < 1, "tolerance", "must be in [0, 1)")
    check(0.5 <= cfg.slo_quantile < 1, "slo_quantile", "must be in [0.5, 1)")
    check(cfg.metrics_window_s >= 0, "metrics_window_s", "must be >= 0 (0: the telemetry window)")
    check(cfg.scale_down_stabilization_s >= 0, "scale_down_stabilization_s", "must be >= 0")
    check(cfg.scale_up_max_step >= 1 and cfg.scale_down_max_step >= 1, "scale_up_max_step",
          "scale_up_max_step and scale_down_max_step must be >= 1")
    check(cfg.scale_up_max_percent >= 0, "scale_up_max_percent", "must be >= 0")
    check(cfg.panic_window_s > 0, "panic_window_s", "must be > 0")
    check(cfg.panic_threshold > 1, "panic_threshold", "must be > 1")
    check(cfg.anomaly_period >= 2, "anomaly_period", "must be >= 2 ticks")
    check(cfg.anomaly_history >= 3 * cfg.anomaly_period, "anomaly_history",
          f"must hold at least 3 periods ({3 * cfg.anomaly_period} ticks)")
    check(cfg.anomaly_refit_every >= 1, "anomaly_refit_every", "must be >= 1")
    check(cfg.anomaly_z > 0, "anomaly_z", "must be > 0")
    check(cfg.decisions_keep >= 100, "decisions_keep", "must be >= 100")
    problems.extend((f"autoscaler.{key}", reason) for key, reason in window_problems(cfg))
    return problems


def _policy_problems(cfg: AutoscalerConfig) -> list[tuple[str, str]]:
    """Guards, the scale-down period and the replica profile (``controlplane.autoscale.loop.ours_policy``)."""
    problems: list[tuple[str, str]] = []
    unknown = [g for g in cfg.guards if g not in AUTOSCALER_METRICS]
    if unknown:
        problems.append(("autoscaler.guards", f"unknown metric {unknown[0]!r} (known: "
                                              f"{', '.join(AUTOSCALER_METRICS)})"))
    elif set(AUTOSCALER_METRICS) <= set(cfg.guards):
        problems.append(("autoscaler.guards", "at least one metric must size the fleet (not a guard)"))
    if cfg.scale_down_period_s < 0:
        problems.append(("autoscaler.scale_down_period_s", "must be >= 0 (0: every tick may scale down)"))
    if cfg.replica_profile:
        try:
            load_profile(cfg.replica_profile)
        except (OSError, ValueError) as exc:
            problems.append(("autoscaler.replica_profile", f"cannot be read: {exc}"))
    return problems
