"""The safety layer between an experiment and the faults: ledger first, bounded blast radius, always revert.

Order of a fault's life: plan (selector resolved once, blast radius checked) -> the revert record is
*registered* in the durable ledger -> the fault is injected -> the ledger says ``injected`` (with the exact
revert token in ``detail``) -> after ``duration_s`` a timer reverts it -> ``reverted``. A crash anywhere
leaves a ledger row that :meth:`FaultManager.revert_leftovers` undoes at the next start. ``halt_all`` is the
big red button: every active fault is reverted concurrently within a deadline and nothing new goes in until
``release()``. Revert failures are values: stored as ``revert_failed`` with the error, never raised.

The ledger is a protocol that ``controlplane.store.database.Store`` satisfies (chaos never imports the control
plane).

Stop conditions for experiments and drills (:class:`StopCondition`, :class:`StopMonitor`, :func:`guard`,
the ready-made conditions and :func:`fleet_conditions`) live in :mod:`chaos.stop_conditions`, the clock in
:mod:`chaos.clock`; both are re-exported here, so existing ``from chaos.safety import ...`` keeps working.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from chaos.catalogue import Catalogue
from chaos.clock import Clock, MonotonicClock
from chaos.errors import Conflict
from chaos.expiry import ExpiryGuards, needs_guard
from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    RevertFailed,
    RevertResult,
    RevertToken,
)
from chaos.stop_conditions import (
    DEFAULT_CHECK_INTERVAL_S,
    Comparison,
    FleetSignals,
    Guarded,
    Probe,
    ProbeValue,
    StopCondition,
    StopMonitor,
    StopTrip,
    abort_run,
    error_rate_above,
    fleet_conditions,
    guard,
    p99_ttft_above,
    ready_replicas_below,
)
from chaos.targets import Target

__all__ = [
    "DEFAULT_CHECK_INTERVAL_S", "ActiveFault", "BlastRadiusExceeded", "Budgeted", "Clock", "Comparison",
    "FaultManager", "FleetSignals", "Guarded", "HaltReport", "Halted", "Ledger", "LedgerRow", "LedgerState",
    "MonotonicClock", "Plan", "Probe", "ProbeValue", "RevertResult", "StopCondition", "StopMonitor",
    "StopTrip", "TargetChooser", "abort_run", "error_rate_above", "fleet_conditions", "guard",
    "p99_ttft_above", "ready_replicas_below",
]

logger = logging.getLogger(__name__)

LedgerState = Literal["registered", "injected", "reverted", "revert_failed"]

DEFAULT_MAX_FRACTION_DOWN = 0.5
HALT_DEADLINE_S = 2.0
EXPIRY_REVERT_ATTEMPTS = 3
EXPIRY_RETRY_DELAY_S = 1.0


# ---- what the control plane provides -------------------------------------------------------------
class LedgerRow(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def target(self) -> str: ...

    @property
    def state(self) -> LedgerState: ...

    @property
    def revert(self) -> Mapping[str, Any]: ...

    @property
    def detail(self) -> str: ...


class Ledger(Protocol):
    """The durable faults ledger (``controlplane.store.database.Store`` satisfies it)."""

    def register_fault(self, kind: str, target: str, params: Mapping[str, Any],
                       revert: Mapping[str, Any]) -> LedgerRow: ...

    def mark_fault(self, fault_id: int, state: LedgerState, detail: str = "") -> LedgerRow: ...

    def active_faults(self) -> Sequence[LedgerRow]: ...


# ---- errors and values -------------------------------------------------------------------------
class Halted(FaultError, Conflict):
    """New injections are refused until ``release()``."""


class BlastRadiusExceeded(FaultError, Conflict):
    """The plan would take down more replicas than allowed."""


@dataclass(slots=True, frozen=True)
class Plan:
    """A dry run: what would be hit, by what, for how long, and why it would be refused."""

    spec: FaultSpec
    info: FaultKindInfo
    targets: tuple[Target, ...]
    num_down_after: int
    num_targets: int
    reasons: tuple[str, ...] = ()

    @property
    def allowed(self) -> bool:
        return not self.reasons

    @property
    def duration_s(self) -> float:
        return self.spec.duration_s


@dataclass(slots=True, frozen=True)
class ActiveFault:
    """One injected fault (``error`` is None), or one that could not be injected (``fault_id`` may be None
    when nothing was registered)."""

    fault_id: int | None
    kind: str
    target_id: str
    token: RevertToken | None
    started_at: float
    expires_at: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True, frozen=True)
class HaltReport:
    reverted: tuple[int, ...]
    failed: Mapping[int, str]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(slots=True)
class _Running:
    active: ActiveFault
    fault: Fault
    in_radius: bool  # it takes its target down or impairs it: counts against the blast radius
    expiry: asyncio.Task[None] | None = field(default=None)
    guard_pid: int | None = None  # its expiry guard (chaos.expiry), for faults that stay until reverted


def _guard_of(row: LedgerRow) -> int | None:
    """The expiry guard's pid an earlier manager recorded for this fault, if any."""
    with contextlib.suppress(ValueError, TypeError):
        body = json.loads(row.detail)
        if isinstance(body, dict) and isinstance(body.get("guard_pid"), int):
            return int(body["guard_pid"])
    return None


def _token_of(row: LedgerRow) -> RevertToken:
    """The exact token from ``detail`` when inject finished, else the record registered before it."""
    with contextlib.suppress(ValueError, TypeError):
        body = json.loads(row.detail)
        if isinstance(body, dict) and isinstance(body.get("token"), dict):
            return RevertToken.from_json(body["token"])
    return RevertToken.from_json(row.revert)


# ---- the manager ---------------------------------------------------------------------------------
class FaultManager:
    def __init__(self, catalogue: Catalogue, ledger: Ledger, *, clock: Clock | None = None,
                 max_fraction_down: float = DEFAULT_MAX_FRACTION_DOWN,
                 halt_deadline_s: float = HALT_DEADLINE_S,
                 expiry_attempts: int = EXPIRY_REVERT_ATTEMPTS,
                 expiry_retry_delay_s: float = EXPIRY_RETRY_DELAY_S,
                 guards: ExpiryGuards | None = None) -> None:
        if not 0 < max_fraction_down <= 1:
            raise ValueError(f"max_fraction_down: must be in (0, 1], got {max_fraction_down!r}")
        if halt_deadline_s <= 0:
            raise ValueError(f"halt_deadline_s: must be positive, got {halt_deadline_s!r}")
        self._catalogue = catalogue
        self._ledger = ledger
        self._clock: Clock = clock or MonotonicClock()
        self._max_fraction_down = max_fraction_down
        self._halt_deadline_s = halt_deadline_s
        self._expiry_attempts = max(1, expiry_attempts)
        self._expiry_retry_delay_s = expiry_retry_delay_s
        self._guards = guards  # None: only this manager's own timers revert at expiry
        self._running: dict[int, _Running] = {}
        self._reverts: dict[int, asyncio.Task[RevertResult]] = {}
        self._halted = False

    @property
    def is_halted(self) -> bool:
        return self._halted

    @property
    def catalogue(self) -> Catalogue:
        return self._catalogue

    @property
    def ledger(self) -> Ledger:
        """The durable ledger this manager writes (the control plane's store)."""
        return self._ledger

    def now(self) -> float:
        """The manager's clock, the one ``started_at`` and ``expires_at`` of active faults are read on."""
        return self._clock.now()

    def active(self) -> list[ActiveFault]:
        """The faults this manager injected and has not reverted yet."""
        return [r.active for r in self._running.values()]

    # -- plan ------------------------------------------------------------------------------------
    def plan(self, spec: FaultSpec, targets: Sequence[Target], *, allow_all: bool = False) -> Plan:
        """Validate, resolve the selector and check the blast radius; changes nothing.

        ValueError for a bad spec or selector, KeyError for an unknown kind, FaultUnavailable for a kind
        that cannot run here. A plan that breaks a safety limit comes back with ``reasons``.
        """
        fault = self._catalogue.validate(spec)
        info = fault.describe()
        chosen = _choose(fault, spec, targets)
        fleet = {t.replica_id for t in targets}
        in_radius = info.takes_down or info.impairs
        down_now = {r.active.target_id for r in self._running.values() if r.in_radius} & fleet
        down = down_now | ({t.replica_id for t in chosen} if in_radius else set())
        reasons: list[str] = []
        if self._halted:
            reasons.append("halted: new faults are refused until release()")
        if in_radius and not allow_all:
            verb = "take down" if info.takes_down else "impair"
            if down >= fleet:
                reasons.append(f"blast radius: {spec.kind} would {verb} all {len(fleet)} replicas "
                               "(pass allow_all=True to mean it)")
            elif len(down) / len(fleet) > self._max_fraction_down:
                reasons.append(f"blast radius: {len(down)} of {len(fleet)} replicas down or impaired "
                               f"exceeds max_fraction_down={self._max_fraction_down:g}")
        budget = getattr(fault, "over_budget", None)  # host limits (stress): allow_all does not waive them
        problem = budget(spec, chosen) if callable(budget) and chosen else None
        if problem:
            reasons.append(str(problem))
        return Plan(spec=spec, info=info, targets=chosen, num_down_after=len(down), num_targets=len(fleet),
                    reasons=tuple(reasons))

    # -- inject ----------------------------------------------------------------------------------
    async def inject(self, spec: FaultSpec, targets: Sequence[Target], *,
                     allow_all: bool = False) -> list[ActiveFault]:
        """Inject ``spec`` into the targets its selector picks (resolved once, here).

        Raises Halted or BlastRadiusExceeded before anything is touched; a target that could not be
        faulted comes back as an ActiveFault with ``error`` set (its ledger row says what happened).
        """
        if self._halted:
            raise Halted("halted: new faults are refused until release()")
        plan = self.plan(spec, targets, allow_all=allow_all)
        if not plan.allowed:
            raise BlastRadiusExceeded("; ".join(plan.reasons))
        fault = self._catalogue.get(spec.kind)
        return [await self._inject_one(fault, plan, target) for target in plan.targets]

    async def _inject_one(self, fault: Fault, plan: Plan, target: Target) -> ActiveFault:
        spec, rid = plan.spec, target.replica_id
        now = self._clock.now()
        failed = ActiveFault(None, spec.kind, rid, None, now, now)
        try:
            pre = fault.prepare(spec, target)
            params = {**spec.params, "duration_s": spec.duration_s}
            row = self._ledger.register_fault(spec.kind, rid, params, pre.to_json())
        except Exception as exc:  # nothing was injected: the failure is the value
            logger.error("%s: %s not injected: %s", rid, spec.kind, exc)
            return _with_error(failed, f"not injected: {exc}")
        try:
            token = await fault.inject(spec, target)
        except Exception as exc:
            # It may be partly in place: undo with the record registered before (the safe side).
            logger.error("%s: inject %s (fault %d) failed: %s", rid, spec.kind, row.id, exc)
            result = await self._revert_with(row.id, fault, pre, why=f"inject failed: {exc}")
            return _with_error(ActiveFault(row.id, spec.kind, rid, pre, now, now),
                               f"inject failed: {exc}" + ("" if result.ok else f"; {result.detail}"))
        started = self._clock.now()
        active = ActiveFault(row.id, spec.kind, rid, token, started, started + spec.duration_s)
        running = _Running(active, fault, plan.info.takes_down or plan.info.impairs)
        if self._guards is not None and needs_guard(fault, token):
            running.guard_pid = self._guards.start(row.id, token, spec.duration_s)
        self._running[row.id] = running
        self._mark(row.id, "injected", json.dumps({"token": token.to_json(), "guard_pid": running.guard_pid}))
        running.expiry = asyncio.create_task(self._expire(row.id, active.expires_at),
                                             name=f"chaos-expire-{row.id}")
        if self._halted:  # halt_all ran while this one was going in
            await self.revert(row.id)
        return active

    async def _expire(self, fault_id: int, expires_at: float) -> None:
        await self._clock.sleep(max(expires_at - self._clock.now(), 0.0))
        running = self._running.get(fault_id)
        if running is not None:
            running.expiry = None  # from here on, a concurrent revert must not cancel this task
        for attempt in range(self._expiry_attempts):
            result = await self.revert(fault_id)
            if result.ok or not result.retryable:
                return
            logger.warning("fault %d: revert at expiry failed (attempt %d): %s", fault_id, attempt + 1,
                           result.detail)
            await self._clock.sleep(self._expiry_retry_delay_s)

    # -- revert ----------------------------------------------------------------------------------
    async def revert(self, fault_id: int) -> RevertResult:
        """Revert one fault; idempotent, and a failure is recorded and returned, never raised."""
        task = self._reverts.get(fault_id)
        if task is None:
            task = asyncio.create_task(self._revert(fault_id), name=f"chaos-revert-{fault_id}")
            self._reverts[fault_id] = task
            task.add_done_callback(lambda _t: self._reverts.pop(fault_id, None))
        return await asyncio.shield(task)

    async def _revert(self, fault_id: int) -> RevertResult:
        running = self._running.get(fault_id)
        if running is not None:
            if running.expiry is not None:
                running.expiry.cancel()
                running.expiry = None
            if running.active.token is None:
                return RevertResult(fault_id, False, "no revert token")
            return await self._revert_with(fault_id, running.fault, running.active.token, why="revert",
                                           guard_pid=running.guard_pid)
        try:
            row = next((r for r in self._ledger.active_faults() if r.id == fault_id), None)
            if row is None:
                return RevertResult(fault_id, True, "not active (already reverted or unknown)")
            token = _token_of(row)
            fault = self._catalogue.get(token.kind)
        except Exception as exc:
            detail = f"cannot revert: {exc}"
            self._mark(fault_id, "revert_failed", json.dumps({"error": detail, "retryable": False}))
            return RevertResult(fault_id, False, detail)
        return await self._revert_with(fault_id, fault, token, why="leftover", guard_pid=_guard_of(row))

    async def _revert_with(self, fault_id: int, fault: Fault, token: RevertToken, *,
                           why: str, guard_pid: int | None = None) -> RevertResult:
        try:
            await fault.revert(token)
        except Exception as exc:
            retryable = exc.retryable if isinstance(exc, RevertFailed) else True
            detail = f"{type(exc).__name__}: {exc}"
            logger.error("%s: revert of fault %d (%s, %s) failed: %s", token.target, fault_id, token.kind,
                         why, detail)
            self._mark(fault_id, "revert_failed",
                       json.dumps({"error": detail, "retryable": retryable, "token": token.to_json()}))
            return RevertResult(fault_id, False, detail, retryable)
        self._running.pop(fault_id, None)
        if self._guards is not None:
            self._guards.stop(guard_pid, fault_id)  # its work is done; one that reverted has exited
        self._mark(fault_id, "reverted", why)
        logger.info("%s: fault %d (%s) reverted (%s)", token.target, fault_id, token.kind, why)
        return RevertResult(fault_id, True, why)

    def _failure_detail(self, fault_id: int, error: str) -> str:
        """A retryable failure, keeping the exact token (when this manager has it) for the next attempt."""
        running = self._running.get(fault_id)
        body: dict[str, Any] = {"error": error, "retryable": True}
        if running is not None and running.active.token is not None:
            body["token"] = running.active.token.to_json()
        return json.dumps(body)

    def _mark(self, fault_id: int, state: LedgerState, detail: str) -> None:
        try:
            self._ledger.mark_fault(fault_id, state, detail)
        except Exception as exc:  # the ledger still says "active", so leftovers will retry it
            logger.error("fault %d: ledger could not record %s: %s", fault_id, state, exc)

    # -- halt, release, leftovers ----------------------------------------------------------------
    async def halt_all(self) -> HaltReport:
        """Refuse new faults and revert every active one concurrently within the halt deadline."""
        self._halted = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        ids = set(self._running) | {r.id for r in self._ledger_active()}
        logger.warning("halt: reverting %d faults", len(ids))
        tasks = {fid: asyncio.ensure_future(self.revert(fid)) for fid in sorted(ids)}
        if tasks:
            await asyncio.wait(tasks.values(), timeout=self._halt_deadline_s)
        reverted: list[int] = []
        failed: dict[int, str] = {}
        for fid, task in tasks.items():
            if not task.done():
                failed[fid] = f"revert did not finish within {self._halt_deadline_s:g}s"
                self._mark(fid, "revert_failed", self._failure_detail(fid, failed[fid]))
            elif task.result().ok:
                reverted.append(fid)
            else:
                failed[fid] = task.result().detail
        return HaltReport(tuple(reverted), failed, loop.time() - started)

    def release(self) -> None:
        """Accept new injections again after ``halt_all``."""
        self._halted = False

    async def revert_leftovers(self) -> list[RevertResult]:
        """Revert whatever the ledger says may still be in place (the recovery path after a crash)."""
        ids = [r.id for r in self._ledger_active() if r.id not in self._running]
        if ids:
            logger.warning("reverting %d leftover faults: %s", len(ids), ids)
        return list(await asyncio.gather(*(self.revert(fid) for fid in ids)))

    async def aclose(self) -> None:
        """Stop the expiry timers without reverting (the ledger keeps the faults for the next start)."""
        timers = [r.expiry for r in self._running.values() if r.expiry is not None]
        for timer in timers:
            timer.cancel()
        await asyncio.gather(*timers, return_exceptions=True)
        self._running.clear()

    def _ledger_active(self) -> Sequence[LedgerRow]:
        try:
            return self._ledger.active_faults()
        except Exception as exc:
            logger.error("ledger: cannot read active faults: %s", exc)
            return ()


class TargetChooser(Protocol):
    """A fault kind that picks its own targets from its params (zone outage), instead of the selector."""

    def select(self, spec: FaultSpec, targets: Sequence[Target]) -> tuple[Target, ...]: ...


class Budgeted(Protocol):
    """A fault kind with host-wide limits (stress): why faulting ``targets`` now would exceed them, counting
    what it already runs; None when it fits. The plan refuses with that reason, whatever ``allow_all``."""

    def over_budget(self, spec: FaultSpec, targets: Sequence[Target]) -> str | None: ...


def _choose(fault: Fault, spec: FaultSpec, targets: Sequence[Target]) -> tuple[Target, ...]:
    select = getattr(fault, "select", None)
    if callable(select):
        return tuple(select(spec, targets))
    return spec.selector.resolve(targets)


def _with_error(active: ActiveFault, error: str) -> ActiveFault:
    return dataclasses.replace(active, error=error)
