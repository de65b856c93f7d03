"""Alert rules: what is watched, the built-in queries, the rules that run out of the box, and their export.

Where it sits: ``[alerts]`` in the config (``controlplane.config``) becomes a list of :class:`Rule` through
:func:`rules_from_config` (the :func:`default_rules`, replaced or extended by ``[[alerts.rules]]``). A rule
is ``expr <comparison> threshold`` held for ``for_s`` seconds, with an action; its expression is PromQL,
and a rule naming one of the built-in :data:`QUERIES` can also be evaluated by the in-process scraper's
telemetry methods. The evaluation engine, the alert states and the actions live in
:mod:`controlplane.alerts.engine`, which takes from here the values it passes around about a rule (an
:class:`Observation`, a :class:`RuleStatus`, an alert's :func:`instance_key`, an Alertmanager
:class:`ExternalAlert`) and re-exports the names other modules import from it.

:func:`rule_file` exports the rules as a Prometheus rule file, so a real Prometheus + Alertmanager can
evaluate them instead (:mod:`controlplane.alerts.delegation` writes that file for the Prometheus the control
plane runs when ``[alerts] alertmanager_url`` is set). Nothing here does I/O.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

from controlplane.alerts.config import (
    ALERT_ACTIONS,
    ALERT_COMPARISONS,
    ALERT_SEVERITIES,
    AlertRuleConfig,
    AlertsConfig,
)
from controlplane.telemetry.base import (
    HTTP_REQUESTS,
    INFERENCE_PATHS,
    KV_USAGE,
    NUM_WAITING,
    SERVER_ERROR_CODES,
    TTFT,
    Group,
    Regex,
    Telemetry,
)
from controlplane.telemetry.promql import duration, gauge_query, quantile_query, rate_query

QUERY_WINDOW_S = 60.0  # rate and quantile window of the built-in queries
REPLICAS_JOB = "replicas"  # the scrape job of the replicas (Prometheus' and the scraper's)
RULE_GROUP = "llm-sre"

ActionKind = Literal["scale_up", "restart_replica", "abort_drill", "notify", "none"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq,
    "!=": operator.ne,
}


# ---- built-in queries -----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class BuiltinQuery:
    """One expression in two forms: PromQL for Prometheus, and the same value from telemetry methods."""

    name: str
    promql: str
    by: tuple[str, ...]
    evaluate: Callable[[Telemetry], dict[Group, float]]
    help: str


_INFERENCE = {"path": Regex(INFERENCE_PATHS)}
_SERVER_ERROR = Regex(SERVER_ERROR_CODES)
_ERRORS = {**_INFERENCE, "status_code": _SERVER_ERROR}
_UP = {"job": REPLICAS_JOB}


def _error_rate(t: Telemetry) -> dict[Group, float]:
    # One read by status code: the errors and the total come from the same samples (read a scrape apart,
    # a burst of 5xx could be put over the previous window's total and read over 100%).
    by_code = t.rate(HTTP_REQUESTS, window_s=QUERY_WINDOW_S, by=("status_code",), match=_INFERENCE)
    total = sum(by_code.values())
    if not total:
        return {}  # no inference request in the window: no share to compare
    errors = sum(rate for (code,), rate in by_code.items() if _SERVER_ERROR.matches(code))
    return {(): errors / total}


QUERIES: dict[str, BuiltinQuery] = {q.name: q for q in (
    BuiltinQuery("error_rate",
                 f"{rate_query(HTTP_REQUESTS, window_s=QUERY_WINDOW_S, by=(), match=_ERRORS)} / "
                 f"{rate_query(HTTP_REQUESTS, window_s=QUERY_WINDOW_S, by=(), match=_INFERENCE)}",
                 (), _error_rate, "share of inference requests answered 5xx over 1 min"),
    BuiltinQuery("ttft_p95", quantile_query(TTFT, 0.95, window_s=QUERY_WINDOW_S, by=(), match=None), (),
                 lambda t: t.quantile(TTFT, 0.95, window_s=QUERY_WINDOW_S, by=()),
                 "fleet P95 time to first token (s) over 1 min"),
    BuiltinQuery("kv_cache_usage", gauge_query(KV_USAGE, by=(), match=None, agg="avg"), (),
                 lambda t: t.gauge(KV_USAGE, by=(), agg="avg"), "mean KV-cache usage of the replicas (0..1)"),
    BuiltinQuery("num_waiting", gauge_query(NUM_WAITING, by=(), match=None, agg="sum"), (),
                 lambda t: t.gauge(NUM_WAITING, by=(), agg="sum"), "requests waiting in all replica queues"),
    BuiltinQuery("replica_up", gauge_query("up", by=("replica",), match=_UP, agg="min"), ("replica",),
                 lambda t: t.gauge("up", by=("replica",), match=_UP, agg="min"),
                 "1 when the replica's /metrics answered the last scrape, else 0"),
)}


# ---- rules ----------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Rule:
    """``expr <comparison> threshold`` held for ``for_s`` seconds fires the alert and runs ``action``."""

    name: str
    expr: str  # PromQL, without the comparison
    comparison: str
    threshold: float
    for_s: float
    severity: str = "warning"
    action: ActionKind = "notify"
    query: str = ""  # a QUERIES name: evaluable without Prometheus
    by: tuple[str, ...] = ()
    webhook_url: str = ""
    summary: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    enabled: bool = True

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"rule name must match {_NAME.pattern}, got {self.name!r}")
        if self.comparison not in _COMPARE:
            raise ValueError(f"rule {self.name}: comparison must be one of {' '.join(ALERT_COMPARISONS)}")
        if self.action not in ALERT_ACTIONS:
            raise ValueError(f"rule {self.name}: action must be one of {', '.join(ALERT_ACTIONS)}")
        if self.severity not in ALERT_SEVERITIES:
            raise ValueError(f"rule {self.name}: severity must be one of {', '.join(ALERT_SEVERITIES)}")
        if self.for_s < 0:
            raise ValueError(f"rule {self.name}: for_s must be >= 0, got {self.for_s}")
        if self.query and self.query not in QUERIES:
            raise ValueError(f"rule {self.name}: unknown query {self.query!r} (known: {', '.join(QUERIES)})")
        if not self.expr.strip():
            raise ValueError(f"rule {self.name}: needs an expr or a query")
        for name in (*self.by, *self.labels):
            if not _LABEL.fullmatch(name):
                raise ValueError(f"rule {self.name}: not a label name: {name!r}")
        if self.webhook_url:
            check_webhook_url(self.webhook_url)

    def breaches(self, value: float) -> bool:
        return _COMPARE[self.comparison](value, self.threshold)

    @property
    def condition(self) -> str:
        return f"{self.comparison} {self.threshold:g}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "expr": self.expr, "comparison": self.comparison,
                "threshold": self.threshold, "for_s": self.for_s, "severity": self.severity,
                "action": self.action, "query": self.query, "by": list(self.by),
                "webhook_url": redact_url(self.webhook_url), "summary": self.summary,
                "labels": dict(self.labels), "enabled": self.enabled}


def check_webhook_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"webhook url must be http(s)://host/..., got {url!r}")


def redact_url(url: str) -> str:
    """Scheme, host and path only: user info and the query string may carry a secret."""
    if not url:
        return ""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def _query_rule(name: str, query: str, comparison: str, threshold: float, for_s: float, severity: str,
                action: ActionKind, summary: str) -> Rule:
    q = QUERIES[query]
    return Rule(name, q.promql, comparison, threshold, for_s, severity, action, query=query, by=q.by,
                summary=summary)


def default_rules() -> list[Rule]:
    """The rules that run out of the box."""
    return [
        _query_rule("HighErrorRate", "error_rate", ">", 0.01, 300, "critical", "notify",
                    "more than 1% of inference requests fail with 5xx"),
        _query_rule("SlowTimeToFirstToken", "ttft_p95", ">", 5.0, 120, "warning", "scale_up",
                    "P95 time to first token above 5 s"),
        _query_rule("KVCacheFull", "kv_cache_usage", ">", 0.95, 300, "warning", "scale_up",
                    "KV cache more than 95% used"),
        _query_rule("LongQueue", "num_waiting", ">", 500, 60, "warning", "scale_up",
                    "more than 500 requests waiting"),
        _query_rule("ReplicaDown", "replica_up", "<", 1, 30, "critical", "restart_replica",
                    "a replica's metrics endpoint does not answer"),
    ]


def rule_from_config(cfg: AlertRuleConfig) -> Rule:
    builtin = QUERIES.get(cfg.query)
    if cfg.query and builtin is None:
        raise ValueError(f"rule {cfg.name}: unknown query {cfg.query!r} (known: {', '.join(QUERIES)})")
    expr = cfg.expr or (builtin.promql if builtin else "")
    by = tuple(cfg.by) if cfg.by or builtin is None else builtin.by
    return Rule(cfg.name, expr, cfg.comparison, cfg.threshold, cfg.for_s, cfg.severity,
                cfg.action, query=cfg.query, by=by,  # type: ignore[arg-type]  # checked in __post_init__
                webhook_url=cfg.webhook_url, summary=cfg.summary, enabled=cfg.enabled)


def rules_from_config(config: AlertsConfig) -> list[Rule]:
    """Default rules (unless switched off), replaced or extended by ``[[alerts.rules]]``."""
    rules = {r.name: r for r in (default_rules() if config.default_rules else [])}
    for cfg in config.rules:
        rules[cfg.name] = rule_from_config(cfg)
    unknown = set(config.disabled_rules) - rules.keys()
    if unknown:
        raise ValueError(f"alerts.disabled_rules: no rule named {', '.join(sorted(unknown))}")
    return [replace(r, enabled=False) if r.name in config.disabled_rules else r for r in rules.values()]


def instance_key(rule: str, labels: Mapping[str, str]) -> str:
    """``Rule{a="x",b="y"}`` (alertname left out): the alert's identity in records and the API."""
    inner = ",".join(f"{k}={_q(v)}" for k, v in sorted(labels.items()) if k != "alertname")
    return f"{rule}{{{inner}}}"


# ---- evaluation results ---------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Observation:
    """One rule's values in one evaluation, or why there are none."""

    values: Mapping[Group, float] = field(default_factory=dict)
    error: str = ""


@dataclass(slots=True)
class RuleStatus:
    last_eval: float | None = None
    last_error: str = ""


# ---- Prometheus and Alertmanager ------------------------------------------------------------------
def _q(text: str) -> str:
    """A double-quoted YAML scalar (JSON string syntax is valid YAML)."""
    return json.dumps(text, ensure_ascii=False)


def rule_file(rules: Iterable[Rule], *, interval_s: float) -> str:
    """A Prometheus rule file (``rule_files:``) with one alerting rule per enabled rule."""
    lines = ["# Generated by `controlplane alerts export`: the control plane's alert rules.", "groups:",
             f"  - name: {_q(RULE_GROUP)}", f"    interval: {duration(interval_s)}", "    rules:"]
    enabled = [r for r in rules if r.enabled]
    if not enabled:
        lines[-1] = "    rules: []"
    for rule in enabled:
        lines += [f"      - alert: {_q(rule.name)}",
                  f"        expr: {_q(f'({rule.expr}) {rule.comparison} {rule.threshold!r}')}"]
        if rule.for_s > 0:
            lines.append(f"        for: {duration(rule.for_s)}")
        labels = {**rule.labels, "severity": rule.severity, "action": rule.action}
        lines.append("        labels:")
        lines += [f"          {k}: {_q(v)}" for k, v in sorted(labels.items())]
        annotations = {"summary": rule.summary or rule.name,
                       "description": f"{rule.name}: value {{{{ $value }}}} {rule.condition}"}
        lines.append("        annotations:")
        lines += [f"          {k}: {_q(v)}" for k, v in sorted(annotations.items())]
    return "\n".join(lines) + "\n"


@dataclass(slots=True, frozen=True)
class ExternalAlert:
    """One alert of an Alertmanager webhook payload (v4), validated."""

    status: Literal["firing", "resolved"]
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: str
    ends_at: str
    fingerprint: str

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")
