"""Progressive canary releases: a version's share of traffic grows by steps, each step analysed against the
stable version over the same window, and the release aborts itself at the first step that fails.

One release at a time. :meth:`CanaryController.start` registers the release and runs it as a task:

1. the fleet starts the canary's replicas beside the stable ones (``Fleet.start_canary``), answering to the
   stable model's name; no traffic reaches them until the split gives their version a share;
2. for each step share, the split is published to the gateways (:class:`TrafficSlices`), the step waits
   its interval, and the gateways' outcomes of both versions since the step began are analysed
   (:mod:`controlplane.rollouts.analysis`). *pass*: the next step; *fail*: abort; *inconclusive* (too
   little traffic): the step waits another interval, at most ``max_extensions`` times, then aborts;
3. after the last step (100%), promotion: a rolling update moves the stable fleet to the version's model
   while the canary serves, then the split is cleared, the canary's replicas drain and the version becomes
   the current one.

An abort sets the version's share to 0 first (the gateways take it within their long poll), then ends the
canary. Every decision is a step record with its numbers (both sides' figures, the tests, the reason),
saved in the release as it is made, like the autoscaler's decision records. Operators may promote at any
step (the remaining steps are skipped), abort, pause (the share holds and no step is analysed) and resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from controlplane.errors import Conflict, NotFound, Refused
from controlplane.fleet.plan import Canary, Rollout
from controlplane.gateway.slices import Outcome
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.rollouts.analysis import FAIL, INCONCLUSIVE, PASS, Analysis, Thresholds, analyse
from controlplane.rollouts.traffic import TrafficSlices
from controlplane.rollouts.versions import Release, VersionRegistry

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often a waiting step looks at pause, abort and promote


class CanaryConflict(Conflict):
    """A release is already running, or none is (for promote, abort, pause)."""


class CanaryRefused(Refused):
    """Bad steps or thresholds."""


class FleetPort(Protocol):
    """What a canary needs of the fleet (``controlplane.fleet.reconcile.Fleet``)."""

    model: str
    rollout: Rollout | None
    canary: Canary | None

    def endpoints(self) -> list[ReplicaEndpoint]: ...
    def start_canary(self, version: str, model: str, replicas: int = 1) -> Canary: ...
    def end_canary(self) -> None: ...
    def start_rollout(self, model: str) -> Rollout: ...


@dataclass(slots=True, frozen=True)
class CanaryPolicy:
    steps: tuple[float, ...] = (0.05, 0.2, 0.5, 1.0)  # shares of traffic, increasing, the last 1.0
    interval_s: float = 60.0  # each step's analysis window
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_extensions: int = 3  # an inconclusive step waits this many more intervals, then the release aborts
    replicas: int = 1  # the canary's replicas
    ready_timeout_s: float = 180.0  # for the canary's replicas to be ready, and for the promotion's update
    # The first step's first seconds are not analysed: a fresh replica's first requests pay one-off costs
    # (first forward passes, allocations) that say nothing about the version.
    warmup_s: float = 2.0

    def __post_init__(self) -> None:
        steps = self.steps
        if not steps or any(not 0 < s <= 1 for s in steps) or list(steps) != sorted(set(steps)):
            raise CanaryRefused("steps: increasing shares in (0, 1], e.g. 0.05,0.2,0.5,1", param="steps")
        if steps[-1] != 1.0:
            raise CanaryRefused("steps: the last step must be 1 (100%): promotion follows it", param="steps")
        if not 1 <= self.interval_s <= 3600:
            raise CanaryRefused("interval_s: must be in [1, 3600]", param="interval_s")
        if not 0 <= self.max_extensions <= 20:
            raise CanaryRefused("max_extensions: must be in [0, 20]", param="max_extensions")
        if not 1 <= self.replicas <= 16:
            raise CanaryRefused("replicas: must be in [1, 16]", param="replicas")
        if not 0 <= self.warmup_s < self.interval_s:
            raise CanaryRefused("warmup_s: must be in [0, interval_s)", param="warmup_s")

    def to_json(self) -> dict[str, Any]:
        t = self.thresholds
        return {"steps": list(self.steps), "interval_s": self.interval_s,
                "max_extensions": self.max_extensions, "replicas": self.replicas, "warmup_s": self.warmup_s,
                "thresholds": {
                    "alpha": t.alpha, "max_error_increase": t.max_error_increase,
                    "max_latency_ratio": t.max_latency_ratio, "min_samples": t.min_samples,
                    "min_latency_increase_s": t.min_latency_increase_s}}


class _Stop(Exception):
    """An operator's abort or promote ended the waiting."""


@dataclass(slots=True)
class _Run:
    release: Release
    policy: CanaryPolicy
    model: str
    task: asyncio.Task[None] | None = None
    paused: bool = False
    command: str | None = None  # abort | promote, from an operator
    command_reason: str = ""
    baseline: list[Outcome] = field(default_factory=list)  # the last step's stable outcomes (for 100%)


class CanaryController:
    def __init__(self, fleet: FleetPort, registry: VersionRegistry, traffic: TrafficSlices, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.fleet, self.registry, self.traffic = fleet, registry, traffic
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.run: _Run | None = None

    # ---- what the API asks ----
    def start(self, version: str, policy: CanaryPolicy) -> Release:
        if self.run is not None and self.run.release.outcome in ("running", "paused"):
            raise CanaryConflict(f"release {self.run.release.id} of {self.run.release.version} is running")
        target = self.registry.get(version)
        current = self.registry.current() or ""
        if self.fleet.rollout is not None or self.fleet.canary is not None:
            raise CanaryConflict("a rolling update or another canary is in progress")
        self.fleet.start_canary(version, target.model, policy.replicas)
        release = self.registry.begin_release(version, current, "canary")
        release.steps.append({"event": "started", "at": self.wall(), "policy": policy.to_json()})
        self.registry.save_release(release)
        self.run = _Run(release, policy, target.model)
        self.run.task = asyncio.create_task(self._guarded(self.run), name=f"canary-{release.id}")
        return release

    def command(self, release_id: int, action: str, reason: str = "") -> Release:
        """promote | abort | pause | resume, on the running release."""
        run = self.run
        if run is None or run.release.id != release_id:
            raise NotFound(f"release {release_id} is not running", subject=str(release_id))
        if run.release.outcome not in ("running", "paused"):
            raise CanaryConflict(f"release {release_id} has ended ({run.release.outcome})")
        if action in ("abort", "promote"):
            run.command, run.command_reason = action, reason or f"{action} by an operator"
        elif action in ("pause", "resume"):
            run.paused = action == "pause"
            run.release.outcome = "paused" if run.paused else "running"
            self._note(run, {"event": action, "at": self.wall()})
        else:
            raise CanaryRefused(f"action: one of promote, abort, pause, resume; got {action!r}",
                                param="action")
        return run.release

    def status(self) -> dict[str, Any]:
        run = self.run
        return {"plan": self.traffic.plan().to_json(), "current": self.registry.current(),
                "release": None if run is None else run.release.to_json()}

    async def stop(self) -> None:
        """At shutdown: a running release aborts (its split back to 0, its canary drained with the fleet)."""
        run = self.run
        if run is None or run.task is None or run.task.done():
            return
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.task
        self._abort(run, "the control plane stopped during the release")

    def recover(self) -> None:
        """At start: a release a previous control plane left running (it was killed) is aborted, since
        nobody analysed its steps meanwhile: the split goes back to 0 and the adopted canary drains."""
        for release in self.registry.releases(limit=5):
            if release.outcome in ("running", "paused"):
                self._abort(_Run(release, CanaryPolicy(), ""),
                            "the control plane restarted during the release")

    # ---- the release ----
    async def _guarded(self, run: _Run) -> None:
        try:
            await self._release(run)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the release must end cleanly whatever failed
            logger.exception("canary release %d failed", run.release.id)
            self._abort(run, f"the release failed: {type(exc).__name__}: {exc}")

    async def _release(self, run: _Run) -> None:
        version = run.release.version
        try:
            await self._until(run, lambda: self._canary_ready(version), run.policy.ready_timeout_s,
                              "the canary's replicas were not ready in time")
            for i, share in enumerate(run.policy.steps):
                if not await self._step(run, share, warmup_s=run.policy.warmup_s if i == 0 else 0.0):
                    return
        except _Stop:
            if run.command == "abort":
                self._abort(run, run.command_reason)
                return
        await self._promote(run)

    async def _step(self, run: _Run, share: float, *, warmup_s: float) -> bool:
        """One step; False when the release aborted."""
        version = run.release.version
        self.traffic.set_split(version, share)
        self._note(run, {"event": "step", "share": share, "at": self.wall()})
        await self._wait(run, warmup_s)
        started = self.wall()
        for extension in range(run.policy.max_extensions + 1):
            await self._wait(run, run.policy.interval_s)
            outcomes = await self.traffic.outcomes(started)
            baseline = outcomes.get("version:stable", [])
            if len(baseline) < run.policy.thresholds.min_samples and share >= 1.0:
                baseline = run.baseline  # nothing is stable at 100%: the previous step's stable side
            analysis = await asyncio.to_thread(analyse, baseline, outcomes.get(f"version:{version}", []),
                                               run.policy.thresholds)  # statistics: off the event loop
            decision = self._decide(analysis, extension, run.policy.max_extensions)
            self._record(run, share, started, analysis, decision)
            if decision == "abort":
                self._abort(run, "; ".join(analysis.reasons) or "the analysis stayed inconclusive")
                return False
            if decision == "next":
                run.baseline = baseline
                return True
        return False  # not reached: the last extension decides next or abort

    @staticmethod
    def _decide(analysis: Analysis, extension: int, max_extensions: int) -> str:
        if analysis.verdict == PASS:
            return "next"
        if analysis.verdict == FAIL or (analysis.verdict == INCONCLUSIVE and extension >= max_extensions):
            return "abort"
        return "extend"

    async def _promote(self, run: _Run) -> None:
        version, model = run.release.version, run.model
        self._note(run, {"event": "promoting", "at": self.wall(), "reason": run.command_reason or
                         "every step passed"})
        if self.fleet.model != model:
            self.fleet.start_rollout(model)
            await self._until(run, lambda: self.fleet.rollout is None, run.policy.ready_timeout_s * 4,
                              "the stable fleet's rolling update did not finish", stoppable=False)
            if self.fleet.model != model:
                self._abort(run, "the stable fleet's rolling update rolled back")
                return
        self.traffic.set_split(version, 0.0)
        self.fleet.end_canary()
        self.registry.set_current(version)
        self._end(run, "promoted", "every step passed" if run.command != "promote" else run.command_reason)

    def _abort(self, run: _Run, reason: str) -> None:
        decided = self.wall()
        self.traffic.set_split(run.release.version, 0.0)  # first: the gateways stop sending it traffic
        self.fleet.end_canary()
        self._note(run, {"event": "aborted", "at": decided, "reason": reason})
        self._end(run, "aborted", reason)

    def _end(self, run: _Run, outcome: str, reason: str) -> None:
        run.release.outcome, run.release.ended, run.release.reason = outcome, self.wall(), reason
        self.registry.save_release(run.release)
        logger.warning("canary release %d of %s %s: %s", run.release.id, run.release.version, outcome, reason)

    # ---- records and waiting ----
    def _record(self, run: _Run, share: float, started: float, analysis: Analysis, decision: str) -> None:
        body = analysis.to_json()
        self._note(run, {"event": "analysis", "share": share, "window": [started, self.wall()],
                         "decision": decision, **body})
        self.registry.set_analysis(run.release.version, {"share": share, "decision": decision, **body})

    def _note(self, run: _Run, step: dict[str, Any]) -> None:
        run.release.steps.append(step)
        self.registry.save_release(run.release)

    def _canary_ready(self, version: str) -> bool:
        mine = [e for e in self.fleet.endpoints() if dict(e.labels).get("version") == version]
        return bool(mine) and any(e.state is ReplicaState.READY for e in mine)

    async def _wait(self, run: _Run, seconds: float) -> None:
        """``seconds`` of unpaused time; an operator's abort or promote raises :class:`_Stop`."""
        left = seconds
        while left > 0:
            if run.command is not None:
                raise _Stop
            await self.sleep(min(POLL_S, left))
            if not run.paused:
                left -= POLL_S

    async def _until(self, run: _Run, done: Callable[[], bool], timeout_s: float, why: str, *,
                     stoppable: bool = True) -> None:
        deadline = self.clock() + timeout_s
        while not done():
            if stoppable and run.command is not None:
                raise _Stop
            if self.clock() > deadline:
                raise TimeoutError(why)
            await self.sleep(POLL_S)
