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

from chaos.egress import parse_entry
from controlplane.alerts.config import AlertsConfig, alerts_problems
from controlplane.autoscale.checks import autoscaler_problems
from controlplane.autoscale.config import AutoscalerConfig
from controlplane.drills.config import DrillsConfig, drills_problems
from controlplane.errors import Refused
from controlplane.fleet.config import FleetConfig, fleet_problems
from controlplane.gateway.config import GatewayConfig, gateway_problems
from controlplane.sim.config import SimulatorConfig, simulator_problems
from controlplane.store.config import RetentionConfig, retention_problems
from controlplane.telemetry.config import PrometheusConfig, TelemetryConfig, telemetry_problems

STATE_DIR_ENV = "LLMSRE_STATE_DIR"


class ConfigError(Refused, ValueError):
    """A bad configuration; the message names the file, the key and the reason."""


@dataclass(slots=True)
class LoginLimits:
    """Backoff for ``POST /api/v1/auth/login`` (``[api.login]``): after ``*_free_failures`` failed logins
    for one user name, or from one client address, each further attempt waits ``backoff_s``, doubled per
    failure up to ``max_backoff_s`` (429 with Retry-After). A failure is forgotten ``max_backoff_s`` after
    the last one; at most ``max_tracked`` names and as many addresses are remembered (the least recent go).
    The console logs its users in from one address, so the client's allowance is the larger one."""

    user_free_failures: int = 5
    client_free_failures: int = 20
    backoff_s: float = 1.0
    max_backoff_s: float = 300.0
    max_tracked: int = 10_000


@dataclass(slots=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # The first admin token; empty: read $CONTROLPLANE_ADMIN_TOKEN, else generate one and print it once.
    admin_token: str = ""
    # Larger request bodies get 413, from Content-Length before reading (and while reading a chunked one);
    # after the token check. 4 MiB holds the largest legitimate body (an inline simulation trace).
    max_body_bytes: int = 4 << 20
    login: LoginLimits = field(default_factory=LoginLimits)


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
class ChaosConfig:
    """Experiments the control plane runs for its operators (``POST /api/v1/chaos/experiments``)."""

    # Hosts (``host`` or ``host:port``) their http providers may reach besides the control plane's own
    # listeners and its replicas; nothing else is requested (see the README's Security section).
    experiment_hosts: list[str] = field(default_factory=list)


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
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)

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
        gw = self.gateway
        admin = range(gw.admin_port, gw.admin_port + gw.processes) if gw.admin_port else range(0)
        return frozenset({self.api.port, gw.port, self.prometheus.port, self.console.port, *admin})


def validate(config: Config) -> list[tuple[str, str]]:
    """(key, reason) for every bad value, section by section (each sub-package checks its own)."""
    problems: list[tuple[str, str]] = []
    for section, cfg in (("api", config.api), ("console", config.console)):
        if not 0 < cfg.port < 65536:
            problems.append((f"{section}.port", f"must be a TCP port, got {cfg.port}"))
    problems.extend(api_problems(config.api))
    if not 2 <= config.console.refresh_s <= 60:
        problems.append(("console.refresh_s", "must be in [2, 60]"))
    if not 60 <= config.console.session_ttl_s <= 12 * 3600:
        problems.append(("console.session_ttl_s", "must be in [60, 43200]"))
    problems.extend(gateway_problems(config.gateway))
    problems.extend(fleet_problems(config.fleet))
    problems.extend(telemetry_problems(config.prometheus, config.telemetry))
    problems.extend(autoscaler_problems(config.autoscaler))
    problems.extend(alerts_problems(config.alerts))
    problems.extend(drills_problems(config.drills))
    problems.extend(retention_problems(config.retention))
    problems.extend(simulator_problems(config.simulator))
    for i, host in enumerate(config.chaos.experiment_hosts):
        try:
            parse_entry(host)
        except ValueError as exc:
            problems.append((f"chaos.experiment_hosts[{i}]", str(exc)))
    return problems


def api_problems(api: ApiConfig) -> list[tuple[str, str]]:
    problems = []
    if not 1024 <= api.max_body_bytes <= 1 << 30:
        problems.append(("api.max_body_bytes", "must be in [1024, 1073741824]"))
    login = api.login
    for name in ("user_free_failures", "client_free_failures", "max_tracked"):
        if getattr(login, name) < 1:
            problems.append((f"api.login.{name}", "must be >= 1"))
    if not 0 < login.backoff_s <= login.max_backoff_s:
        problems.append(("api.login.backoff_s", "must be > 0 and <= max_backoff_s"))
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
