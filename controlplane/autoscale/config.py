"""The autoscaler's section of the configuration (``[autoscaler]``, ``[[autoscaler.windows]]``).

The values here are checked by :func:`controlplane.autoscale.checks.autoscaler_problems`, which needs the
window parser and the replica profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.vocabulary import AUTOSCALER_METRICS


@dataclass(slots=True)
class ScheduleWindowConfig:
    """A cron window (``[[autoscaler.windows]]``) that sets the replica bounds while it is active."""

    name: str = ""
    cron: str = ""  # five fields (minute hour day month weekday), standard cron numbering (0 or 7: Sunday)
    duration_s: float = 0.0  # how long the window lasts after each start; or end_cron
    end_cron: str = ""
    timezone: str = "UTC"
    weekdays: list[str] = field(default_factory=list)  # mon..sun; empty: the cron's own weekday field
    min_replicas: int | None = None  # None: the autoscaler's own bound
    max_replicas: int | None = None


# What the autoscaler observes per tick, by name (``controlplane.autoscale.loop.METRICS``), is
# ``AUTOSCALER_METRICS`` of ``controlplane.vocabulary``; guards name some of them.
__all__ = ["AUTOSCALER_METRICS", "AutoscalerConfig", "ScheduleWindowConfig"]


@dataclass(slots=True)
class AutoscalerConfig:
    """The autoscaler's decision loop (``controlplane.autoscale.loop``); rules in
    ``controlplane.autoscale.policies``."""

    enabled: bool = True
    observe_only: bool = False  # record decisions without applying them
    tick_s: float = 5.0
    min_replicas: int = 3  # one per default zone: an idle fleet still survives a zone outage
    max_replicas: int = 12
    # Target tracking (HPA formula): the value per ready replica each metric should stay near.
    target_waiting_per_replica: float = 4.0
    target_kv_cache_usage: float = 0.8
    ttft_slo_s: float = 1.0  # P95 time to first token
    tpot_slo_s: float = 0.1  # time per output token
    # Sizing by work (controlplane.autoscale.work): prefill by Erlang C against the TTFT SLO at this
    # quantile, decode slots against the TPOT SLO, KV demand against KV capacity; the largest proposes.
    work_sizing: bool = True
    slo_quantile: float = 0.95
    target_tokens_per_s_per_replica: float = 400.0
    # Offered engine load: request rate x mean prompt and output tokens, in engine seconds per second (the
    # replica profile converts tokens to engine time). It is panic mode's demand, and sizes the fleet only
    # with work_sizing off (a guard otherwise, as the generated tokens are); the target is also a
    # replica's capacity for panic mode (30% headroom, as HPA's usual CPU target).
    target_engine_load_per_replica: float = 0.7
    # Guards forbid scaling down while over their target but do not size the fleet: TTFT has a floor and
    # lags, a queue is a backlog to drain, so ceil(current x metric / target) on them overshoots.
    guards: list[str] = field(default_factory=lambda: ["ttft_p95_s", "waiting_per_replica"])
    replica_profile: str = ""  # measured profile JSON (controlplane calibrate); "": shipped
    tolerance: float = 0.1
    metrics_window_s: float = 0.0  # rate and quantile window; 0: the telemetry source's own window
    scale_down_stabilization_s: float = 300.0
    scale_up_max_step: int = 4
    scale_up_max_percent: float = 100.0
    scale_down_max_step: int = 1
    scale_down_period_s: float = 60.0  # at most one scale-down per period (0: every tick may scale down)
    # Panic mode (KPA): offered engine load over the panic window above panic_threshold x ready capacity
    # (target_engine_load_per_replica per ready replica) goes straight to what that load needs.
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0
    panic_skips_rate_limit: bool = True
    # Anomaly source: STL (robust) of request rate and P95 TTFT, IsolationForest on the residuals.
    anomaly_enabled: bool = True
    anomaly_period: int = 12  # ticks per season
    anomaly_history: int = 120  # ticks kept and fitted (bounded: the fit stays cheap)
    anomaly_refit_every: int = 12  # ticks between IsolationForest refits
    anomaly_z: float = 3.0  # a residual must also exceed this many robust standard deviations
    anomaly_cooldown_s: float = 300.0  # after the anomaly source fired, before a new episode may fire
    anomaly_min_rate_sigma: float = 0.2  # requests/s: smaller residual scales are noise (idle fleets)
    anomaly_min_ttft_sigma_s: float = 0.05
    decisions_keep: int = 20_000  # decision records kept in the store
    windows: list[ScheduleWindowConfig] = field(default_factory=list)
