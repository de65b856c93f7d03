"""Alerts as the API shows them: the rules, the active alerts, each transition with the action it took
(``/api/v1/alerts/*``). Part of :mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class AlertRule:
    name: str
    expr: str
    comparison: str
    threshold: float
    for_s: float
    severity: str
    action: str
    enabled: bool
    query: str = ""
    by: tuple[str, ...] = ()
    summary: str = ""
    webhook_url: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    last_eval: float | None = None
    last_error: str | None = None
    pending: int = 0
    firing: int = 0


@dataclass(slots=True, frozen=True)
class ActiveAlert:
    key: str
    rule: str
    state: str  # pending | firing
    since: float
    value: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    source: str = "rules"  # rules | alertmanager
    fired_at: float | None = None
    record_id: int = 0


@dataclass(slots=True, frozen=True)
class AlertAction:
    """What a firing alert's action did."""

    kind: str
    target: str
    outcome: str  # ok | error | skipped | deferred | cooldown | rate_limited
    detail: str
    at: float
    attempts: int = 1


@dataclass(slots=True, frozen=True)
class AlertTransition:
    """One state change of an alert (pending, firing, resolved) and the action it took."""

    id: int
    key: str
    rule: str
    state: str
    at: float
    ts: float | None = None
    since: float | None = None
    value: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    source: str = "rules"
    severity: str = ""
    action: str = ""
    fired_at: float | None = None
    fired: bool | None = None  # resolved: whether it had fired
    reason: str = ""
    result: AlertAction | None = None


@dataclass(slots=True, frozen=True)
class RuleSwitch:
    name: str
    enabled: bool
    resolved: tuple[str, ...]  # alerts the switch resolved
