"""The alerts' section of the configuration (``[alerts]``, ``[[alerts.rules]]``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ALERT_COMPARISONS = (">", ">=", "<", "<=", "==", "!=")
ALERT_ACTIONS = ("scale_up", "restart_replica", "abort_drill", "notify", "none")
ALERT_SEVERITIES = ("info", "warning", "critical")


@dataclass(slots=True)
class AlertRuleConfig:
    """One alert rule (``[[alerts.rules]]``); a rule named like a default one replaces it."""

    name: str = ""  # [a-zA-Z_:][a-zA-Z0-9_:]* (it is the Prometheus alert name too)
    # a built-in query (controlplane.alerts.engine.QUERIES): works with either telemetry source
    query: str = ""
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
    """Alert rules and their actions (``controlplane.alerts.engine``)."""

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


def alerts_problems(alerts: AlertsConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[alerts]`` and its rules."""
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
