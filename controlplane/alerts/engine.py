"""Alert states, the pure step between them, and the automation firing alerts drive.

Where it sits: every ``[alerts] eval_interval_s`` the :class:`AlertEngine` observes each enabled rule of
:mod:`controlplane.alerts.rules` through the telemetry interface (PromQL through Prometheus when it runs;
with the in-process scraper, the rule's built-in query), decides the transitions with the pure :func:`step`
and applies them once: a transition record in the store's ``alerts`` collection, then, for an alert that
starts firing, its action through :class:`Actions` (scale up, restart a replica, abort the running drill,
notify a webhook). Alertmanager can drive the same actions: its v4 webhook payload arrives at
``POST /api/v1/alerts/webhook`` (``controlplane.api.alerts``) and :meth:`AlertEngine.receive` turns it into
the same transitions. The rules, queries and rule-file export that callers import from here are
re-exported from :mod:`controlplane.alerts.rules`.

Actions (:mod:`controlplane.alerts.actions`) are idempotent (one per firing; a replica is restarted at most
once per cooldown), rate-limited per kind, audited as the ``alerts`` principal and recorded with the alert.
A failed action is a value in the record, never an exception that stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from controlplane.alerts.actions import (
    RESULT_FIELDS,
    RETRYABLE,
    AbortDrill,
    ActionResult,
    Actions,
    FleetControl,
    Post,
    Source,
    post_json,
)
from controlplane.alerts.config import ALERT_ACTIONS, AlertsConfig
from controlplane.alerts.delegation import SETTINGS_KEY, alert_delegation, rule_file_writer, rule_switches
from controlplane.alerts.rules import (
    QUERIES,
    ActionKind,
    ExternalAlert,
    Observation,
    Rule,
    RuleStatus,
    check_webhook_url,
    default_rules,
    instance_key,
    redact_url,
    rule_file,
    rules_from_config,
)
from controlplane.auth import Auditor
from controlplane.errors import ControlPlaneError, NotFound
from controlplane.store.database import Record, Store
from controlplane.telemetry.base import Group, Telemetry, TelemetryError
from controlplane.telemetry.prometheus import PrometheusSource

__all__ = [
    "QUERIES", "ActionKind", "ActionResult", "Actions", "Alert", "AlertEngine", "AlertError", "ExternalAlert",
    "FleetControl", "Observation", "Rule", "RuleStatus", "Transition", "UnknownRule", "alert_delegation",
    "build_engine", "check_webhook_url", "default_rules", "instance_key", "post_json", "redact_url",
    "rule_file", "rule_file_writer", "rule_switches", "rules_from_config", "step",
]

logger = logging.getLogger(__name__)

COLLECTION = "alerts"  # one record per transition; key: the alert instance
REBUILD_RECORDS = 5_000  # newest transitions read at start to rebuild the current states
TRIM_EVERY = 100  # ticks between trims of the alerts collection

State = Literal["pending", "firing", "resolved"]


class AlertError(ControlPlaneError):
    """A bad rule, an unknown rule name or a bad webhook payload; the message says which."""


class UnknownRule(AlertError, NotFound):
    """No alert rule has this name."""


# ---- states and the pure step ---------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Alert:
    """One active alert instance (a rule and one group of its labels): pending or firing."""

    key: str
    rule: str
    labels: Mapping[str, str]
    state: Literal["pending", "firing"]
    since: float  # when the condition started to hold (wall seconds)
    value: float | None
    source: Source = "rules"
    fired_at: float | None = None
    record_id: int = 0  # the record of the latest transition
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Transition:
    key: str
    rule: str
    labels: Mapping[str, str]
    state: State
    at: float
    since: float
    value: float | None
    fired: bool = False  # resolved: whether it had fired (else it cleared while pending)
    reason: str = ""


def step(rule: Rule, values: Mapping[Group, float], active: Mapping[str, Alert], now: float
         ) -> list[Transition]:
    """The transitions of ``rule`` given this evaluation's ``values`` and its currently active alerts."""
    out: list[Transition] = []
    breaching: set[str] = set()
    for group, value in sorted(values.items()):
        if not rule.breaches(value):
            continue
        labels = {"alertname": rule.name, **dict(zip(rule.by, group))}
        key = instance_key(rule.name, labels)
        breaching.add(key)
        current = active.get(key)
        if current is None:
            state: State = "firing" if rule.for_s <= 0 else "pending"
            out.append(Transition(key, rule.name, labels, state, now, now, value))
        elif current.state == "pending" and now - current.since >= rule.for_s:
            out.append(Transition(key, rule.name, labels, "firing", now, current.since, value))
    for key, alert in sorted(active.items()):
        if alert.rule == rule.name and alert.source == "rules" and key not in breaching:
            fired = alert.state == "firing"
            out.append(Transition(key, rule.name, alert.labels, "resolved", now, alert.since, None, fired,
                                  "" if fired else "cleared before it fired"))
    return out


# ---- the engine -----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Deferred:
    """A firing alert's action that was refused for now; tried again every ``action_retry_s``."""

    record: Record
    kind: ActionKind
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    source: Source
    webhook_url: str
    body: Mapping[str, Any]
    last: float
    attempts: int = 1


class AlertEngine:
    """Evaluates the rules on a clock, keeps the active alerts, records transitions and runs actions."""

    def __init__(self, rules: Sequence[Rule], config: AlertsConfig, *, store: Store, actions: Actions,
                 telemetry: Telemetry | None, clock: Callable[[], float] = time.time) -> None:
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate rule names: {sorted({n for n in names if names.count(n) > 1})}")
        self.config = config
        self.store = store
        self.actions = actions
        self.telemetry = telemetry
        self.clock = clock
        self._rules = {r.name: r for r in rules}
        self.status = {r.name: RuleStatus() for r in rules}
        self.active: dict[str, Alert] = {}
        self._ticks = 0
        self._deferred: dict[str, _Deferred] = {}  # alert key -> its refused-for-now action
        self._stopping = asyncio.Event()
        self.on_rules_changed: Callable[[str], None] = lambda _: None  # gets the rule file after a switch

    # -- rules
    @property
    def rules(self) -> list[Rule]:
        return list(self._rules.values())

    def rule(self, name: str) -> Rule:
        try:
            return self._rules[name]
        except KeyError:
            raise UnknownRule(f"no alert rule named {name!r}", param="name", subject=name) from None

    def set_enabled(self, name: str, enabled: bool) -> list[Transition]:
        """Enable or disable a rule (kept across restarts); disabling resolves its active alerts."""
        rule = self.rule(name)
        self._rules[name] = replace(rule, enabled=enabled)
        settings = rule_switches(self.store)
        settings[name] = enabled
        self.store.kv_put(SETTINGS_KEY, settings)
        self.on_rules_changed(self.export())
        if enabled:
            return []
        now = self.clock()
        gone = [Transition(a.key, name, a.labels, "resolved", now, a.since, None, a.state == "firing",
                           "rule disabled")
                for a in self.active.values() if a.rule == name and a.source == "rules"]
        for t in gone:
            self._record(t, self._rules[name])
        return gone

    def export(self) -> str:
        return rule_file(self.rules, interval_s=self.config.eval_interval_s)

    # -- state from the store
    def rebuild(self) -> None:
        """Current states, rule switches and recent actions from the store (after a restart)."""
        for name, enabled in rule_switches(self.store).items():
            if name in self._rules:
                self._rules[name] = replace(self._rules[name], enabled=bool(enabled))
        latest: dict[str, Record] = {}
        for rec in self.store.records(COLLECTION, limit=REBUILD_RECORDS, newest_first=False):
            latest[rec.key] = rec
            result = rec.body.get("result")
            if result:
                self.actions.remember(ActionResult(**{k: result[k] for k in RESULT_FIELDS}))
        self.active = {}
        for key, rec in latest.items():
            body = rec.body
            if body.get("state") in ("pending", "firing"):
                self.active[key] = Alert(key, body["rule"], dict(body["labels"]), body["state"],
                                         body["since"], body.get("value"), body.get("source", "rules"),
                                         body.get("fired_at"), rec.id, dict(body.get("annotations", {})))
                self._rebuild_deferred(rec)
        logger.info("alerts: %d active after rebuild from the store", len(self.active))

    def _rebuild_deferred(self, rec: Record) -> None:
        body, result = rec.body, rec.body.get("result") or {}
        if body.get("state") != "firing" or result.get("outcome") not in RETRYABLE:
            return
        rule = self._rules.get(body["rule"]) if body.get("source", "rules") == "rules" else None
        labels = {**body["labels"], **({"severity": rule.severity, "action": rule.action} if rule else {})}
        annotations = dict(body.get("annotations", {}))
        self._deferred[rec.key] = _Deferred(
            rec, result["kind"], labels, annotations, body.get("source", "rules"),
            rule.webhook_url if rule else "", {"alert": body["rule"], "key": rec.key, "state": "firing",
                                               "labels": labels, "annotations": annotations},
            result["at"], int(result.get("attempts", 1)))

    # -- evaluation
    def observe(self) -> dict[str, Observation]:
        """Query every enabled rule (blocking: run it off the event loop)."""
        return {rule.name: self._observe(rule) for rule in self.rules if rule.enabled}

    def _observe(self, rule: Rule) -> Observation:
        if self.telemetry is None:
            return Observation(error="telemetry is not running")
        try:
            if isinstance(self.telemetry, PrometheusSource):
                return Observation(self.telemetry.instant(rule.expr, rule.by))
            if rule.query:
                return Observation(QUERIES[rule.query].evaluate(self.telemetry))
        except (TelemetryError, ValueError) as exc:
            return Observation(error=str(exc))
        return Observation(error="a PromQL expression needs Prometheus (the in-process scraper answers only "
                                 f"the built-in queries: {', '.join(QUERIES)})")

    async def evaluate_once(self) -> list[Transition]:
        observations = await asyncio.to_thread(self.observe)
        return await self.apply(observations)

    async def apply(self, observations: Mapping[str, Observation]) -> list[Transition]:
        """Decide every rule's transitions on these observations, record them, act on new firings."""
        now = self.clock()
        done: list[Transition] = []
        for name, obs in observations.items():
            rule = self._rules.get(name)
            if rule is None or not rule.enabled:
                continue
            self.status[name] = RuleStatus(now, obs.error)
            if obs.error:
                logger.warning("alert rule %s not evaluated: %s", name, obs.error)
                continue  # unknown is not resolved: states stay as they are
            for transition in step(rule, obs.values, self.active, now):
                await self._apply_one(transition, rule)
                done.append(transition)
        for key in [k for k, d in self._deferred.items() if now - d.last >= self.config.action_retry_s]:
            await self._retry(key)
        self._ticks += 1
        if self._ticks % TRIM_EVERY == 0:
            self.store.trim_records(COLLECTION, self.config.history_keep)
        return done

    async def _apply_one(self, transition: Transition, rule: Rule) -> None:
        record = self._record(transition, rule)
        if transition.state != "firing" or self._stopping.is_set():
            return  # stopping: the fleet drains, no action may restart or scale it now
        if self.config.alertmanager_url:  # Prometheus evaluates the same rules and Alertmanager calls back
            self._attach(record, ActionResult(rule.action, "", "skipped", "delegated to alertmanager",
                                              self.clock()))
            return
        labels = {**transition.labels, "severity": rule.severity, "action": rule.action}
        annotations = {"summary": rule.summary or rule.name}
        await self._act(_Deferred(record, rule.action, labels, annotations, "rules", rule.webhook_url,
                                  _notification(transition, labels, annotations), self.clock(), 0))

    async def _act(self, job: _Deferred) -> ActionResult:
        """Run a firing alert's action, attach the result to its record; keep it for a retry if deferred."""
        key = job.record.key
        result = await self.actions.run(job.kind, alert=key, labels=job.labels, annotations=job.annotations,
                                        source=job.source, webhook_url=job.webhook_url, body=job.body)
        job.attempts += 1
        job.last = result.at
        self._attach(job.record, result, attempts=job.attempts)
        if result.outcome in RETRYABLE and self.active.get(key, None) is not None:
            self._deferred[key] = job
        else:
            self._deferred.pop(key, None)
        return result

    async def _retry(self, key: str) -> None:
        job = self._deferred.get(key)
        current = self.active.get(key)
        if job is None or current is None or current.record_id != job.record.id or self._stopping.is_set():
            self._deferred.pop(key, None)  # resolved (or fired anew) since: nothing to retry
            return
        logger.info("alert %s: trying its deferred %s action again (attempt %d)", key, job.kind,
                    job.attempts + 1)
        await self._act(job)

    def _record(self, t: Transition, rule: Rule | None, *, source: Source = "rules",
                annotations: Mapping[str, str] | None = None,
                extra: Mapping[str, Any] | None = None) -> Record:
        body: dict[str, Any] = {
            "rule": t.rule, "labels": dict(t.labels), "state": t.state, "at": t.at, "since": t.since,
            "value": t.value, "source": source, "annotations": dict(annotations or {}),
            "severity": rule.severity if rule else t.labels.get("severity", ""),
            "action": rule.action if rule else t.labels.get("action", "none"),
            "fired_at": t.at if t.state == "firing" else None, **(extra or {}),
        }
        if t.state == "resolved":
            body["fired"] = t.fired
            body["reason"] = t.reason
        record = self.store.add_record(COLLECTION, body, key=t.key, ts=t.at)
        if t.state == "resolved":
            self.active.pop(t.key, None)
        else:
            previous = self.active.get(t.key)
            state: Literal["pending", "firing"] = "firing" if t.state == "firing" else "pending"
            self.active[t.key] = Alert(t.key, t.rule, dict(t.labels), state, t.since, t.value, source,
                                       t.at if t.state == "firing" else None, record.id,
                                       dict(annotations or (previous.annotations if previous else {})))
        logger.info("alert %s %s (value %s)", t.key, t.state, t.value)
        return record

    def _attach(self, record: Record, result: ActionResult, *, attempts: int = 1) -> None:
        body = {**record.body, "result": {**asdict(result), "attempts": attempts}}
        self.store.update_record(record.id, body)

    # -- Alertmanager
    async def receive(self, alerts: Sequence[ExternalAlert]) -> list[dict[str, Any]]:
        """Apply an Alertmanager notification: new firings act once, resolutions are recorded."""
        now = self.clock()
        out: list[dict[str, Any]] = []
        for alert in alerts:
            key = f"alertmanager:{alert.fingerprint}"
            current = self.active.get(key)
            labels = dict(alert.labels)
            if alert.status == "resolved":
                if current is None:
                    out.append({"key": key, "alert": alert.name, "outcome": "already resolved"})
                    continue
                t = Transition(key, alert.name, labels, "resolved", now, current.since, None,
                               current.state == "firing", "resolved by alertmanager")
                self._record(t, None, source="alertmanager", annotations=alert.annotations,
                             extra={"starts_at": alert.starts_at, "ends_at": alert.ends_at})
                out.append({"key": key, "alert": alert.name, "outcome": "resolved"})
                continue
            if current is not None and current.annotations.get("starts_at") == alert.starts_at:
                due = key in self._deferred and now - self._deferred[key].last >= self.config.action_retry_s
                if due:
                    result = await self._act(self._deferred[key])
                    out.append({"key": key, "alert": alert.name, "outcome": "retried",
                                "action": asdict(result)})
                else:
                    out.append({"key": key, "alert": alert.name, "outcome": "already acted on this firing"})
                continue
            if (known := self._rules.get(alert.name)) and not known.enabled:  # fired before the reload
                out.append({"key": key, "alert": alert.name, "outcome": "ignored: the rule is disabled"})
                continue
            annotations = {**alert.annotations, "starts_at": alert.starts_at}
            t = Transition(key, alert.name, labels, "firing", now, now, None)
            record = self._record(t, None, source="alertmanager", annotations=annotations,
                                  extra={"starts_at": alert.starts_at, "fingerprint": alert.fingerprint})
            kind = labels.get("action", "none")
            if kind not in ALERT_ACTIONS:
                kind = "none"
            rule = self._rules.get(alert.name)  # a notify rule's webhook stays here, not in the rule file
            result = await self._act(_Deferred(record, kind, labels,  # type: ignore[arg-type]
                                               alert.annotations, "alertmanager",
                                               rule.webhook_url if rule else "",
                                               _notification(t, labels, alert.annotations), now, 0))
            out.append({"key": key, "alert": alert.name, "outcome": "fired", "action": asdict(result)})
        return out

    # -- views
    def active_alerts(self) -> list[dict[str, Any]]:
        return [{**asdict(a), "labels": dict(a.labels), "annotations": dict(a.annotations)}
                for a in sorted(self.active.values(), key=lambda a: (a.state != "firing", a.key))]

    def history(self, *, limit: int = 200, rule: str | None = None,
                since: float | None = None) -> list[dict[str, Any]]:
        records = self.store.records(COLLECTION, since=since, limit=limit if rule is None else 5_000)
        out = [{"id": r.id, "key": r.key, "ts": r.ts, **r.body} for r in records
               if rule is None or r.body.get("rule") == rule]
        return out[:limit]

    def rules_json(self) -> list[dict[str, Any]]:
        out = []
        for rule in self.rules:
            status = self.status.get(rule.name, RuleStatus())
            states = [a.state for a in self.active.values() if a.rule == rule.name]
            out.append({**rule.to_json(), "last_eval": status.last_eval, "last_error": status.last_error,
                        "pending": states.count("pending"), "firing": states.count("firing")})
        return out

    # -- the loop
    async def run(self) -> None:
        """Evaluate every ``eval_interval_s`` until :meth:`stop`; one bad tick never ends the loop."""
        self._stopping.clear()
        while not self._stopping.is_set():
            try:
                await self.evaluate_once()
            except Exception:
                logger.exception("alert evaluation failed; next try in %gs", self.config.eval_interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.eval_interval_s)

    def stop(self) -> None:
        self._stopping.set()


def _notification(t: Transition, labels: Mapping[str, str], annotations: Mapping[str, str]) -> dict[str, Any]:
    """What a notify webhook receives."""
    return {"alert": t.rule, "key": t.key, "state": t.state, "value": t.value, "since": t.since, "at": t.at,
            "labels": dict(labels), "annotations": dict(annotations)}


def build_engine(config: AlertsConfig, *, store: Store, auditor: Auditor, telemetry: Telemetry | None,
                 fleet: FleetControl | None, abort_drill: AbortDrill | None = None,
                 clock: Callable[[], float] = time.time, post: Post = post_json) -> AlertEngine:
    """The engine with the configured rules, its state rebuilt from the store."""
    actions = Actions(config, fleet=fleet, auditor=auditor, clock=clock, abort_drill=abort_drill, post=post)
    engine = AlertEngine(rules_from_config(config), config, store=store, actions=actions, telemetry=telemetry,
                         clock=clock)
    engine.rebuild()
    return engine
