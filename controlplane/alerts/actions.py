"""What a firing alert does: scale up, restart a replica, abort the running drill, or notify a webhook.

Where it sits: :class:`controlplane.alerts.engine.AlertEngine` calls :meth:`Actions.run` once per alert that
starts firing (from its own rules or from Alertmanager's webhook). Each kind of action runs within its rate
limit (``action_rate_limit`` per ``action_rate_window_s``), a replica is restarted at most once per
``restart_cooldown_s``, and every outcome, refusals included, is audited as the ``alerts`` principal and
returned as an :class:`ActionResult` value: a failed action never stops the alert loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

from controlplane.alerts.config import AlertsConfig
from controlplane.alerts.rules import ActionKind, check_webhook_url, redact_url
from controlplane.auth import Auditor, Principal, Role
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import Outcome

logger = logging.getLogger(__name__)

ALERTS_PRINCIPAL = Principal("alerts", Role.OPERATOR)
# A replica the fleet is already bringing up, draining or restarting is not restarted again by an alert.
NOT_RESTARTABLE = (ReplicaState.STARTING, ReplicaState.DRAINING, ReplicaState.CRASHED, ReplicaState.STOPPED)

ActionOutcome = Literal["ok", "error", "skipped", "deferred", "cooldown", "rate_limited"]
# Refusals that may pass later: a firing alert tries its action again every ``action_retry_s``.
RETRYABLE: tuple[str, ...] = ("deferred", "cooldown", "rate_limited")
Source = Literal["rules", "alertmanager"]
AbortDrill = Callable[[str], Awaitable[object] | object]
Post = Callable[[str, Mapping[str, Any], float], int]


class FleetControl(Protocol):
    """The part of the fleet that alert actions drive (``controlplane.fleet.reconcile.Fleet`` satisfies
    it)."""

    @property
    def desired_total(self) -> int: ...

    def scale(self, replicas: int) -> None: ...

    def restart(self, replica_id: str) -> None: ...

    def endpoints(self) -> list[ReplicaEndpoint]: ...


@dataclass(slots=True, frozen=True)
class ActionResult:
    kind: str
    target: str
    outcome: ActionOutcome
    detail: str
    at: float


RESULT_FIELDS = ("kind", "target", "outcome", "detail", "at")
_AUDIT_OUTCOME: dict[str, Outcome] = {"ok": "ok", "error": "error", "skipped": "denied", "deferred": "denied",
                                      "cooldown": "denied", "rate_limited": "denied"}


def post_json(url: str, body: Mapping[str, Any], timeout_s: float) -> int:
    """POST ``body`` as JSON; the HTTP status (raises httpx.HTTPError when it cannot be sent)."""
    with httpx.Client(timeout=timeout_s, trust_env=False) as http:
        return http.post(url, json=dict(body)).status_code


class Actions:
    """Runs an alert's action once, within its rate limit and cooldown, and audits the outcome."""

    def __init__(self, config: AlertsConfig, *, fleet: FleetControl | None, auditor: Auditor,
                 clock: Callable[[], float] = time.time, abort_drill: AbortDrill | None = None,
                 post: Post = post_json) -> None:
        self.config = config
        self.fleet = fleet
        self.auditor = auditor
        self.clock = clock
        self.abort_drill = abort_drill
        self.post = post
        self._done: dict[str, deque[float]] = {}  # kind -> times actions of it ran (ok or error)
        self._restarted: dict[str, float] = {}  # replica id -> when an alert last restarted it

    def remember(self, result: ActionResult) -> None:
        """Count an action taken earlier (rebuilt from the records at start) against limits and cooldowns."""
        if result.outcome in ("ok", "error"):
            self._done.setdefault(result.kind, deque()).append(result.at)
        if result.kind == "restart_replica" and result.outcome == "ok":
            self._restarted[result.target] = max(result.at, self._restarted.get(result.target, 0.0))

    async def run(self, kind: ActionKind, *, alert: str, labels: Mapping[str, str],
                  annotations: Mapping[str, str], source: Source, webhook_url: str = "",
                  body: Mapping[str, Any] | None = None) -> ActionResult:
        now = self.clock()
        target = self._target(kind, labels, webhook_url)
        shown = redact_url(target) if kind == "notify" else target or "-"  # a URL may carry a secret
        if kind == "none":
            return ActionResult(kind, shown, "skipped", "the alert names no action", now)
        refusal = self._refusal(kind, target, now)
        if refusal is not None:
            result = ActionResult(kind, shown, refusal[0], refusal[1], now)
        else:
            try:
                outcome, detail = await self._execute(kind, target, body or {})
            except Exception as exc:  # any failure is the action's result, never the loop's end
                outcome, detail = "error", f"{type(exc).__name__}: {exc}"
            result = ActionResult(kind, shown, outcome, detail, now)
            self.remember(result)
        self.auditor.record(ALERTS_PRINCIPAL, f"alerts.{kind}", shown, {"alert": alert, "source": source},
                            _AUDIT_OUTCOME[result.outcome], result.detail)
        log = logger.warning if result.outcome == "error" else logger.info
        log("alert %s: action %s on %s: %s %s", alert, kind, shown, result.outcome, result.detail)
        return result

    def _target(self, kind: ActionKind, labels: Mapping[str, str], webhook_url: str) -> str:
        if kind == "restart_replica":
            return labels.get("replica", "")
        if kind == "notify":
            return webhook_url or self.config.webhook_url
        return "fleet" if kind == "scale_up" else kind

    def _refusal(self, kind: str, target: str, now: float) -> tuple[ActionOutcome, str] | None:
        if kind == "restart_replica":
            last = self._restarted.get(target)
            if last is not None and now - last < self.config.restart_cooldown_s:
                return "cooldown", (f"{target} was restarted by an alert {now - last:.0f}s ago "
                                    f"(cooldown {self.config.restart_cooldown_s:g}s)")
        done = self._done.setdefault(kind, deque())
        while done and now - done[0] >= self.config.action_rate_window_s:
            done.popleft()
        if len(done) >= self.config.action_rate_limit:
            return "rate_limited", (f"{len(done)} {kind} actions in the last "
                                    f"{self.config.action_rate_window_s:g}s (limit "
                                    f"{self.config.action_rate_limit})")
        return None

    async def _execute(self, kind: str, target: str, body: Mapping[str, Any]) -> tuple[ActionOutcome, str]:
        if kind == "scale_up":
            return self._scale_up()
        if kind == "restart_replica":
            return self._restart(target)
        if kind == "abort_drill":
            if self.abort_drill is None:
                return "skipped", "no drill service to abort"
            result = self.abort_drill(f"alert {body.get('alert', '')}")
            if inspect.isawaitable(result):
                result = await result
            return "ok", f"abort requested: {result}" if result is not None else "abort requested"
        return await self._notify(target, body)

    def _scale_up(self) -> tuple[ActionOutcome, str]:
        if self.fleet is None:
            return "skipped", "no fleet"
        current = self.fleet.desired_total
        wanted = min(current + self.config.scale_up_step, self.config.max_replicas)
        if wanted <= current:
            return "skipped", f"already at max_replicas ({self.config.max_replicas})"
        self.fleet.scale(wanted)
        return "ok", f"desired replicas {current} -> {wanted}"

    def _restart(self, replica_id: str) -> tuple[ActionOutcome, str]:
        if not replica_id:
            return "error", "the alert has no replica label"
        if self.fleet is None:
            return "skipped", "no fleet"
        states = {e.replica_id: e.state for e in self.fleet.endpoints()}
        state = states.get(replica_id)
        if state is None:
            return "error", f"no replica {replica_id!r} in the fleet"
        if state in NOT_RESTARTABLE:
            return "deferred", f"{replica_id} is {state.value}: the fleet is already handling it"
        self.fleet.restart(replica_id)
        self._restarted[replica_id] = self.clock()
        return "ok", f"restarted {replica_id} (was {state.value})"

    async def _notify(self, url: str, body: Mapping[str, Any]) -> tuple[ActionOutcome, str]:
        if not url:
            return "skipped", "no webhook_url configured"
        check_webhook_url(url)
        status = await asyncio.to_thread(self.post, url, body, self.config.notify_timeout_s)
        if 200 <= status < 300:
            return "ok", f"webhook answered {status}"
        return "error", f"webhook answered {status}"
