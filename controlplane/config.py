"""The control plane's configuration: one typed home for every knob, with defaults that run as they are.

``load_config(path)`` reads an optional TOML file whose tables mirror the dataclasses below
(``[api]``, ``[gateway]``, ``[fleet]``, ...). Unknown keys, wrong types and bad values fail at start with
one line naming the file, the key and the reason.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_ZONES = ("az-a", "az-b", "az-c")
ROUTING_POLICIES = ("score", "round-robin", "least-request", "power-of-two")
STATE_DIR_ENV = "LLMSRE_STATE_DIR"


class ConfigError(ValueError):
    """A bad configuration; the message names the file, the key and the reason."""


@dataclass(slots=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # The first admin token; empty: read $CONTROLPLANE_ADMIN_TOKEN, else generate one and print it once.
    admin_token: str = ""


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    routing: str = "score"
    api_keys: list[str] = field(default_factory=list)  # empty: no client key needed (loopback default)
    max_retries: int = 2  # other replicas tried before the first byte
    retry_budget_ratio: float = 0.2  # retries allowed as a share of recent requests
    first_byte_timeout_s: float = 10.0
    stall_timeout_s: float = 2.0  # no token for this long mid-stream (or no response headers): go elsewhere
    eject_after_failures: int = 3  # consecutive failures before a replica is ejected
    probe_interval_s: float = 1.0  # active health checks (GET /ready) this often: ejected, stalled, idle
    probe_idle_replicas: bool = True  # idle replicas too: one silent for stall_timeout_s is routed around
    max_inflight_per_replica: int = 64  # beyond this on every replica: 429 before the stream starts
    rate_limit_rps: float = 0.0  # per API key; 0: off
    rate_limit_tokens_per_s: float = 0.0  # prompt + max_tokens per API key per second; 0: off
    retry_after_s: int = 1
    trace_sample_rate: float = 0.01  # traces kept below the running P95 (all above it are kept)
    trace_max_rows: int = 100_000


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


@dataclass(slots=True)
class PrometheusConfig:
    enabled: str = "auto"  # auto: when the binary is installed; on; off
    binary: str = "prometheus"
    host: str = "127.0.0.1"
    port: int = 9090
    scrape_interval_s: float = 2.0
    retention: str = "2h"


@dataclass(slots=True)
class TelemetryConfig:
    source: str = "auto"  # auto: Prometheus when it runs, else the in-process scraper
    scrape_interval_s: float = 2.0
    ring_size: int = 1800  # samples kept per series by the in-process scraper (an hour at 2 s)


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


# What the autoscaler observes per tick, by name (controlplane.autoscaler.METRICS); guards name some of them.
AUTOSCALER_METRICS = ("waiting_per_replica", "kv_cache_usage", "ttft_p95_s", "tokens_per_s_per_replica",
                      "engine_load_per_replica")


@dataclass(slots=True)
class AutoscalerConfig:
    """The autoscaler's decision loop (``controlplane.autoscaler``); rules in ``controlplane.policies``."""

    enabled: bool = True
    observe_only: bool = False  # record decisions without applying them
    tick_s: float = 5.0
    min_replicas: int = 3  # one per default zone: an idle fleet still survives a zone outage
    max_replicas: int = 12
    # Target tracking (HPA formula): the value per ready replica each metric should stay near.
    target_waiting_per_replica: float = 4.0
    target_kv_cache_usage: float = 0.8
    ttft_slo_s: float = 1.0  # P95 time to first token
    target_tokens_per_s_per_replica: float = 400.0
    # Offered engine load: request rate x mean prompt and output tokens, in engine seconds per second (the
    # replica profile converts tokens to engine time). It sizes the fleet and is panic mode's demand; the
    # target is also a replica's capacity for panic mode (30% headroom, as HPA's usual CPU target).
    target_engine_load_per_replica: float = 0.7
    # Guards forbid scaling down while over their target but do not size the fleet: TTFT has a floor and
    # lags, a queue is a backlog to drain, so ceil(current x metric / target) on them overshoots.
    guards: list[str] = field(default_factory=lambda: ["ttft_p95_s", "waiting_per_replica"])
    replica_profile: str = ""  # measured profile JSON (python -m controlplane.simulator profile); "": shipped
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


@dataclass(slots=True)
class AlertRuleConfig:
    """One alert rule (``[[alerts.rules]]``); a rule named like a default one replaces it."""

    name: str = ""  # [a-zA-Z_:][a-zA-Z0-9_:]* (it is the Prometheus alert name too)
    query: str = ""  # a built-in query (controlplane.alerts.QUERIES): works with either telemetry source
    expr: str = ""  # PromQL without the comparison; empty: the built-in query's; needs Prometheus otherwise
    by: list[str] = field(default_factory=list)  # labels that tell the expression's series apart
    comparison: str = ">"
    threshold: float = 0.0
    for_s: float = 60.0
    severity: str = "warning"  # info | warning | critical
    action: str = "notify"  # scale_up | restart_replica | abort_drill | notify | none
    webhook_url: str = ""  # notify: where to POST (empty: [alerts] webhook_url)
    summary: str = ""
    enabled: bool = True


@dataclass(slots=True)
class AlertsConfig:
    """Alert rules and their actions (``controlplane.alerts``)."""

    enabled: bool = True
    eval_interval_s: float = 5.0
    default_rules: bool = True  # error rate, P95 TTFT, KV cache, waiting requests, replica down
    disabled_rules: list[str] = field(default_factory=list)  # rule names that start disabled
    rules: list[AlertRuleConfig] = field(default_factory=list)
    webhook_url: str = ""  # where notify actions POST JSON; empty: the action is recorded as skipped
    notify_timeout_s: float = 5.0
    scale_up_step: int = 1
    max_replicas: int = 12  # scale_up never asks for more
    restart_cooldown_s: float = 300.0  # one replica is restarted at most once in this long
    action_rate_limit: int = 5  # actions of one kind (scale_up, notify, ...) per window; beyond: refused
    action_rate_window_s: float = 600.0
    action_retry_s: float = 30.0  # a firing alert's deferred action (replica starting, cooldown) retries
    history_keep: int = 10_000  # alert transition records kept in the store
    alertmanager_url: str = ""  # when set, the Prometheus we run loads the rules and sends alerts there


@dataclass(slots=True)
class DrillsConfig:
    """Failover drills (``chaos.drills``) and their schedules."""

    schedule_timezone: str = "UTC"
    # Scheduled drills (controlplane.schedules): a schedule's defaults when it does not set its own.
    schedule_overlap: str = "skip"  # a drill is already running: skip (record it) or wait for it to end
    schedule_max_wait_s: float = 1800.0  # overlap wait: give up and record a skip after this long
    schedule_misfire_grace_s: float = 300.0  # a firing missed while down still runs within this (whole s)
    schedule_shutdown_timeout_s: float = 5.0  # at stop, wait this long at most for firings in progress


@dataclass(slots=True)
class ConsoleConfig:
    """The Dash web console (``dashboards``)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8050
    refresh_s: float = 3.0  # live panels refresh this often (a toggle pauses them)
    session_ttl_s: float = 3600.0  # a login lasts this long (also the lifetime of its API token)
    # The first admin user's password; empty: $CONTROLPLANE_ADMIN_PASSWORD, else generate and print it once.
    admin_password: str = ""
    # More users as NAME:ROLE:PASSWORD_HASH (`controlplane hash-password`); also $CONTROLPLANE_USERS.
    users: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Config:
    state_dir: str = ""  # empty: $LLMSRE_STATE_DIR, else ~/.local/state/llm-sre
    api: ApiConfig = field(default_factory=ApiConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    drills: DrillsConfig = field(default_factory=DrillsConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)

    @property
    def state_path(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        env = os.environ.get(STATE_DIR_ENV)
        return Path(env) if env else Path.home() / ".local" / "state" / "llm-sre"

    @property
    def listener_ports(self) -> frozenset[int]:
        """The ports the control plane's own servers bind; replica ports are chosen around them (a replica
        spawned before the gateway binds would otherwise take the gateway's port)."""
        return frozenset({self.api.port, self.gateway.port, self.prometheus.port, self.console.port})


def validate(config: Config) -> list[tuple[str, str]]:
    """(key, reason) for every bad value."""
    problems: list[tuple[str, str]] = []

    def check(ok: bool, key: str, reason: str) -> None:
        if not ok:
            problems.append((key, reason))

    for section, cfg in (("api", config.api), ("gateway", config.gateway), ("prometheus", config.prometheus),
                         ("console", config.console)):
        check(0 < cfg.port < 65536, f"{section}.port", f"must be a TCP port, got {cfg.port}")
    check(config.gateway.routing in ROUTING_POLICIES, "gateway.routing",
          f"must be one of {', '.join(ROUTING_POLICIES)}, got {config.gateway.routing!r}")
    check(config.gateway.max_retries >= 0, "gateway.max_retries", "must be >= 0")
    check(0 <= config.gateway.retry_budget_ratio <= 1, "gateway.retry_budget_ratio", "must be in [0, 1]")
    check(config.gateway.stall_timeout_s > 0, "gateway.stall_timeout_s", "must be > 0")
    check(config.gateway.probe_interval_s > 0, "gateway.probe_interval_s", "must be > 0")
    check(config.gateway.eject_after_failures >= 1, "gateway.eject_after_failures", "must be >= 1")
    check(0 <= config.gateway.trace_sample_rate <= 1, "gateway.trace_sample_rate", "must be in [0, 1]")
    check(config.fleet.replicas >= 0, "fleet.replicas", "must be >= 0")
    check(bool(config.fleet.zones), "fleet.zones", "must name at least one zone")
    check(len(set(config.fleet.zones)) == len(config.fleet.zones), "fleet.zones", "must not repeat a zone")
    check(0 < config.fleet.base_port < 65536 - 1000, "fleet.base_port", "must leave room for replica ports")
    check(config.fleet.on_restart in ("adopt", "stop"), "fleet.on_restart", "must be adopt or stop")
    check(config.prometheus.enabled in ("auto", "on", "off"), "prometheus.enabled", "must be auto, on or off")
    check(config.telemetry.source in ("auto", "prometheus", "scraper"), "telemetry.source",
          "must be auto, prometheus or scraper")
    check(config.telemetry.ring_size >= 10, "telemetry.ring_size", "must be >= 10")
    check(2 <= config.console.refresh_s <= 60, "console.refresh_s", "must be in [2, 60]")
    check(60 <= config.console.session_ttl_s <= 12 * 3600, "console.session_ttl_s", "must be in [60, 43200]")
    problems.extend(_autoscaler_problems(config.autoscaler))
    problems.extend(_alerts_problems(config.alerts))
    problems.extend(_drill_schedule_problems(config.drills))
    return problems


ALERT_COMPARISONS = (">", ">=", "<", "<=", "==", "!=")
ALERT_ACTIONS = ("scale_up", "restart_replica", "abort_drill", "notify", "none")
ALERT_SEVERITIES = ("info", "warning", "critical")


def _alerts_problems(alerts: AlertsConfig) -> list[tuple[str, str]]:
    import re

    problems: list[tuple[str, str]] = []
    for key, ok, reason in (
        ("eval_interval_s", alerts.eval_interval_s > 0, "must be > 0"),
        ("notify_timeout_s", alerts.notify_timeout_s > 0, "must be > 0"),
        ("scale_up_step", alerts.scale_up_step >= 1, "must be >= 1"),
        ("max_replicas", alerts.max_replicas >= 1, "must be >= 1"),
        ("restart_cooldown_s", alerts.restart_cooldown_s >= 0, "must be >= 0"),
        ("action_rate_limit", alerts.action_rate_limit >= 1, "must be >= 1"),
        ("action_rate_window_s", alerts.action_rate_window_s > 0, "must be > 0"),
        ("action_retry_s", alerts.action_retry_s > 0, "must be > 0"),
        ("history_keep", alerts.history_keep >= 100, "must be >= 100"),
    ):
        if not ok:
            problems.append((f"alerts.{key}", reason))
    for i, rule in enumerate(alerts.rules):
        key = f"alerts.rules[{i}]"
        for ok, reason in (
            (re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule.name) is not None,
             f"name must match [a-zA-Z_:][a-zA-Z0-9_:]*, got {rule.name!r}"),
            (bool(rule.query or rule.expr), "needs a query or an expr"),
            (rule.comparison in ALERT_COMPARISONS,
             f"comparison must be one of {' '.join(ALERT_COMPARISONS)}"),
            (rule.action in ALERT_ACTIONS, f"action must be one of {', '.join(ALERT_ACTIONS)}"),
            (rule.severity in ALERT_SEVERITIES, f"severity must be one of {', '.join(ALERT_SEVERITIES)}"),
            (rule.for_s >= 0, "for_s must be >= 0"),
        ):
            if not ok:
                problems.append((key, reason))
    return problems


def _autoscaler_policy_problems(cfg: AutoscalerConfig) -> list[tuple[str, str]]:
    """Guards, the scale-down period and the replica profile (``controlplane.autoscaler.ours_policy``)."""
    from controlplane.sim_profile import load_profile  # loaded late: only when a profile is named

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


def _autoscaler_problems(cfg: AutoscalerConfig) -> list[tuple[str, str]]:
    from controlplane.windows import window_problems  # imports this module: loaded late

    problems: list[tuple[str, str]] = []

    def check(ok: bool, key: str, reason: str) -> None:
        if not ok:
            problems.append((f"autoscaler.{key}", reason))

    check(cfg.tick_s > 0, "tick_s", "must be > 0")
    check(0 <= cfg.min_replicas <= cfg.max_replicas, "min_replicas",
          f"need 0 <= min_replicas <= max_replicas, got {cfg.min_replicas}/{cfg.max_replicas}")
    for key in ("target_waiting_per_replica", "target_kv_cache_usage", "ttft_slo_s",
                "target_tokens_per_s_per_replica", "target_engine_load_per_replica", "anomaly_cooldown_s",
                "anomaly_min_rate_sigma", "anomaly_min_ttft_sigma_s"):
        check(getattr(cfg, key) > 0, key, "must be > 0")
    problems.extend(_autoscaler_policy_problems(cfg))
    check(0 <= cfg.tolerance < 1, "tolerance", "must be in [0, 1)")
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


def _drill_schedule_problems(cfg: DrillsConfig) -> list[tuple[str, str]]:
    import zoneinfo

    problems: list[tuple[str, str]] = []
    try:
        zoneinfo.ZoneInfo(cfg.schedule_timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        problems.append(("drills.schedule_timezone", f"unknown time zone {cfg.schedule_timezone!r}"))
    if cfg.schedule_overlap not in ("skip", "wait"):
        problems.append(("drills.schedule_overlap", f"must be skip or wait, got {cfg.schedule_overlap!r}"))
    if cfg.schedule_max_wait_s < 0:
        problems.append(("drills.schedule_max_wait_s", "must be >= 0"))
    if cfg.schedule_misfire_grace_s < 1 or cfg.schedule_misfire_grace_s != int(cfg.schedule_misfire_grace_s):
        problems.append(("drills.schedule_misfire_grace_s", "must be a whole number of seconds >= 1"))
    if cfg.schedule_shutdown_timeout_s < 0:
        problems.append(("drills.schedule_shutdown_timeout_s", "must be >= 0"))
    return problems


def load_config(path: str | Path | None = None) -> Config:
    """Defaults, overridden by the TOML file at ``path`` when given."""
    config = Config()
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"{source}: file not found") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
        _apply(config, raw, source, prefix="")
    problems = validate(config)
    if problems:
        key, reason = problems[0]
        raise ConfigError(f"{source}: {key}: {reason}")
    return config


def _apply(target: Any, raw: dict[str, Any], source: str, *, prefix: str) -> None:
    known = {f.name: f for f in dataclasses.fields(target)}
    hints = typing.get_type_hints(type(target))
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{source}: {name}: unknown key (known: {', '.join(sorted(known))})")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {name}: must be a table")
            _apply(current, value, source, prefix=f"{name}.")
            continue
        setattr(target, key, _coerce(value, hints[key], source, name))


def _coerce(value: Any, hint: Any, source: str, name: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {name}: must be a list")
        return [_coerce(v, item, source, f"{name}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):  # a list of tables ([[section.key]])
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {name}: must be a table")
        table = hint()
        _apply(table, value, source, prefix=f"{name}.")
        return table
    if origin in (typing.Union, types.UnionType):
        # Optional[X] only: TOML has no null, so a value that is present is an X.
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(hint)) != 2:
            raise ConfigError(f"{source}: {name}: unsupported type")
        return _coerce(value, args[0], source, name)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: {name}: must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value
