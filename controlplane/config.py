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
    stall_timeout_s: float = 2.0  # no token for this long mid-stream: resume elsewhere
    eject_after_failures: int = 3  # consecutive failures before a replica is ejected
    probe_interval_s: float = 1.0  # ejected replicas are probed this often for re-admission
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
class AutoscalerConfig:
    """The autoscaler's decision loop (``controlplane.autoscaler``); rules in ``controlplane.policies``."""

    enabled: bool = True
    observe_only: bool = False  # record decisions without applying them
    tick_s: float = 5.0
    min_replicas: int = 1
    max_replicas: int = 12


@dataclass(slots=True)
class AlertsConfig:
    """Alert rules and their actions (``controlplane.alerts``)."""

    enabled: bool = True
    eval_interval_s: float = 5.0


@dataclass(slots=True)
class DrillsConfig:
    """Failover drills (``chaos.drills``) and their schedules."""

    schedule_timezone: str = "UTC"


@dataclass(slots=True)
class ConsoleConfig:
    """The Dash web console (``dashboards``)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8050


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
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{source}: {name}: unsupported type")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: {name}: must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value
