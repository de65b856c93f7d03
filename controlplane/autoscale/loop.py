"""The autoscaler's live loop: observe a snapshot, decide (pure), apply once, record why.

Every ``tick_s`` the loop reads the fleet (desired, ready and starting replicas) and telemetry into an
:class:`~controlplane.autoscale.decide.Observation` (:mod:`controlplane.autoscale.observe`);
:func:`~controlplane.autoscale.decide.decide` turns it into a plan with its reasons. The loop applies the
plan once through ``fleet.scale`` (not in observe-only mode, and never recorded as applied when the call
failed) and stores a decision record in the store's ``decisions`` collection with every input, proposal,
clamp and the outcome. Time is injected (``clock``, ``wall``, ``sleep``), so tests run a cooldown at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from controlplane.autoscale.checks import autoscaler_problems
from controlplane.autoscale.config import AutoscalerConfig, ScheduleWindowConfig
from controlplane.autoscale.decide import (
    Observation,
    Plan,
    applied,
    decide,
    new_state,
    record_body,
    with_work,
)
from controlplane.autoscale.observe import observe_telemetry
from controlplane.autoscale.policies import Recommendation
from controlplane.autoscale.profile import load_profile
from controlplane.autoscale.windows import Window, active_window, parse_windows, window_problems
from controlplane.replicas import ReplicaEndpoint
from controlplane.store.database import Store
from controlplane.telemetry.base import Telemetry

logger = logging.getLogger(__name__)

COLLECTION = "decisions"
TRIM_EVERY_TICKS = 100
OVERRIDES_KEY = "autoscaler.overrides"
PAUSED_KEY = "autoscaler.paused"
WINDOWS_KEY = "autoscaler.windows"  # windows set through the API; they replace the config's
# Fields an operator may change at run time (PUT /api/v1/autoscaler/config).
MUTABLE = ("observe_only", "min_replicas", "max_replicas", "target_waiting_per_replica",
           "target_kv_cache_usage", "ttft_slo_s", "target_tokens_per_s_per_replica",
           "target_engine_load_per_replica", "tolerance", "scale_down_stabilization_s", "scale_down_period_s")


class ScalableFleet(Protocol):
    """What the loop needs of ``controlplane.fleet.reconcile.Fleet``."""

    desired_total: int

    def endpoints(self) -> list[ReplicaEndpoint]: ...

    def scale(self, replicas: int) -> None: ...


class Autoscaler:
    """The loop; ``tick()`` is one pass, ``run()`` ticks every ``tick_s`` until ``stop()``."""

    def __init__(self, config: AutoscalerConfig, fleet: ScalableFleet, telemetry: Telemetry, store: Store, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 refused: Callable[[float], float | None] | None = None,
                 inflight_limit: Callable[[], int | None] | None = None) -> None:
        self.fleet, self.telemetry, self.store = fleet, telemetry, store
        self.refused = refused  # the gateways' capacity refusals per second over a window (fleet.refusals)
        self.inflight_limit = inflight_limit  # the gateways' in-flight requests per replica at most, now
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.config = config
        self.profile = load_profile(config.replica_profile or None)  # validated with the config
        self.paused = False
        self.ticks = 0
        self.last: dict[str, Any] | None = None
        self._restore_operator_state()
        self.windows = parse_windows(self.config.windows)
        self.window_configs, self.windows_source = list(self.config.windows), "config"
        self._restore_windows()
        self.state = new_state(self.config, history=self._restore_history())
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ---- operator controls ---------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return "paused" if self.paused else "observe_only" if self.config.observe_only else "active"

    def pause(self) -> None:
        self.paused = True
        self.store.kv_put(PAUSED_KEY, True)

    def resume(self) -> None:
        self.paused = False
        self.store.kv_put(PAUSED_KEY, False)

    def update(self, changes: Mapping[str, Any]) -> AutoscalerConfig:
        """Change run-time settings (``MUTABLE``); ``ValueError`` names the bad key. Kept across restarts."""
        unknown = sorted(set(changes) - set(MUTABLE))
        if unknown:
            raise ValueError(f"{unknown[0]}: cannot be changed at run time (allowed: {', '.join(MUTABLE)})")
        candidate = dataclasses.replace(self.config, **changes)
        problems = autoscaler_problems(candidate)
        if problems:
            key, reason = problems[0]
            raise ValueError(f"{key.removeprefix('autoscaler.')}: {reason}")
        self.config = candidate
        stored = dict(self.store.kv_get(OVERRIDES_KEY, {}) or {})
        self.store.kv_put(OVERRIDES_KEY, {**stored, **changes})
        return candidate

    def _restore_operator_state(self) -> None:
        overrides = {k: v for k, v in (self.store.kv_get(OVERRIDES_KEY, {}) or {}).items() if k in MUTABLE}
        if overrides:
            try:
                candidate = dataclasses.replace(self.config, **overrides)
                if not autoscaler_problems(candidate):
                    self.config = candidate
                    logger.info("autoscaler: operator overrides restored: %s", sorted(overrides))
            except TypeError:
                logger.warning("autoscaler: stored overrides ignored (unreadable)")
        self.paused = bool(self.store.kv_get(PAUSED_KEY, False))

    def check_windows(self, cfgs: list[ScheduleWindowConfig]) -> list[Window]:
        """The windows parsed and checked as the configuration loader checks them (bad cron or time zone,
        overlaps, bounds outside min/max); ``ValueError`` names the window and the field."""
        windows = parse_windows(cfgs, now=datetime.fromtimestamp(self.wall(), UTC))
        problems = window_problems(dataclasses.replace(self.config, windows=list(cfgs)))
        if problems:
            raise ValueError(problems[0][1])
        return windows

    def set_windows(self, cfgs: list[ScheduleWindowConfig]) -> list[Window]:
        """Replace every cron window (kept in the store across restarts, over the config's); the loop uses
        them from its next tick. ``ValueError`` as :meth:`check_windows`."""
        windows = self.check_windows(cfgs)
        self.store.kv_put(WINDOWS_KEY, [dataclasses.asdict(c) for c in cfgs])
        self.window_configs, self.windows_source, self.windows = list(cfgs), "api", windows
        return windows

    def _restore_windows(self) -> None:
        stored = self.store.kv_get(WINDOWS_KEY)
        if stored is None:
            return
        try:
            cfgs = [ScheduleWindowConfig(**raw) for raw in stored]
            self.windows = self.check_windows(cfgs)
        except (TypeError, ValueError) as exc:  # e.g. a time zone this host lacks: the config's stand
            logger.warning("autoscaler: stored windows ignored, the config's used: %s", exc)
            return
        self.window_configs, self.windows_source = cfgs, "api"
        logger.info("autoscaler: %d schedule window(s) restored from the store", len(cfgs))

    def _restore_history(self) -> tuple[Recommendation, ...]:
        """Recommendations of the stabilization window survive a restart (stored wall time -> loop clock)."""
        now, wall = self.clock(), self.wall()
        since = wall - self.config.scale_down_stabilization_s
        stored = reversed(self.store.records(COLLECTION, since=since, limit=5000))
        history = tuple(Recommendation(now - (wall - rec.body.get("at", rec.ts)),
                                       int(rec.body["recommendation"])) for rec in stored)
        latest = self.store.records(COLLECTION, limit=1)
        self.last = dict(latest[0].body, id=latest[0].id) if latest else None
        return history

    # ---- the loop ------------------------------------------------------------------------------
    async def tick(self) -> dict[str, Any] | None:
        """One pass: observe, decide, apply once, record. None while paused."""
        if self.paused:
            return None
        self.ticks += 1
        cfg, windows, current = self.config, self.windows, self.fleet.desired_total
        endpoints = self.fleet.endpoints()
        window_s = cfg.metrics_window_s or None
        obs = await asyncio.to_thread(observe_telemetry, self.telemetry, endpoints, now=self.clock(),
                                      wall=self.wall(), current=current, window_s=window_s,
                                      profile=self.profile, panic_window_s=cfg.panic_window_s,
                                      refused=self.refused)
        obs = with_work(obs, self.state, cfg, self.profile,
                        inflight_limit=self.inflight_limit() if self.inflight_limit else None)
        plan, self.state = await asyncio.to_thread(decide, obs, self.state, cfg, windows)
        body = self._apply(obs, plan, cfg)
        if body["applied"]:  # only a scale that happened starts a scale-down period
            self.state = applied(self.state, obs, plan)
        rec = await asyncio.to_thread(self.store.add_record, COLLECTION, body, "", obs.wall)
        if self.ticks % TRIM_EVERY_TICKS == 0:
            await asyncio.to_thread(self.store.trim_records, COLLECTION, cfg.decisions_keep)
        self.last = dict(body, id=rec.id)
        return self.last

    def _apply(self, obs: Observation, plan: Plan, cfg: AutoscalerConfig) -> dict[str, Any]:
        mode = "observe_only" if cfg.observe_only else "active"
        change = f"{obs.current} -> {plan.replicas}"
        if plan.replicas == obs.current:
            return record_body(obs, plan, tick=self.ticks, mode=mode, applied=False, outcome="no change")
        if cfg.observe_only:
            return record_body(obs, plan, tick=self.ticks, mode=mode, applied=False,
                               outcome=f"observe-only: would scale {change}")
        try:
            self.fleet.scale(plan.replicas)
        except Exception as exc:  # recorded, and the next tick tries again
            logger.warning("autoscaler: scaling %s failed: %s", change, exc)
            return record_body(obs, plan, tick=self.ticks, mode=mode, applied=False,
                               outcome=f"scale {change} failed", error=str(exc))
        logger.info("autoscaler: scaled %s (%s)", change,
                    "; ".join(p.reason for p in plan.decision.proposals))
        return record_body(obs, plan, tick=self.ticks, mode=mode, applied=True, outcome=f"scaled {change}")

    async def run(self) -> None:
        while not self._stopping:
            started = self.clock()
            try:
                await self.tick()
            except Exception:  # a failed tick is logged and retried; the loop must not die
                logger.exception("autoscaler tick failed")
            await self.sleep(max(self.config.tick_s - (self.clock() - started), 0.0))

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="autoscaler")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config)
        window = active_window(self.windows, datetime.fromtimestamp(self.wall(), UTC))
        return {"mode": self.mode, "paused": self.paused, "observe_only": self.config.observe_only,
                "ticks": self.ticks, "desired_replicas": self.fleet.desired_total,
                "window": None if window is None else {"name": window.name, "schedule": window.describe},
                "last_decision": self.last, "config": cfg,
                "replica_profile": self.profile.source,  # what converts tokens to engine load
                "enabled": self.config.enabled,  # False: the loop never runs (autoscaler.enabled = false)
                "windows_source": self.windows_source}  # "config", or "api" once set through the API
