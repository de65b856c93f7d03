"""Slice experiments: chaos on a coloured share of real traffic, measured live against a control colour of the
same size (Netflix ChAP's design). The blast radius is the slice, not a replica.

A run (:class:`SliceExperiments`, one at a time):

1. injects the coloured fault (``error_rate``, ``token_latency`` or ``prefill_delay`` with ``colour``) on
   every replica through the fault manager (ledgered; it expires by itself a little after the run's
   duration, should the control plane die); no request carries the colour yet;
2. colours two slices of the same ``share`` through :class:`~controlplane.rollouts.traffic.TrafficSlices`:
   the experiment colour, which the fault touches, and the control colour, which it does not; the gateways
   take the plan within the endpoints feed's long poll (times in the record count from then:
   ``coloured_at``);
3. every ``check_interval_s`` reads the gateways' outcomes since the start and compares the experiment
   slice with the control slice (:func:`controlplane.rollouts.analysis.analyse`: Fisher's exact test on
   failures, Mann-Whitney U on TTFT and TPOT, failing only on a significant difference beyond the bounds);
   the requests in neither colour (the uncoloured rest: every version slice's count minus the two colours')
   are counted too, since the fault must not reach them;
4. stops by itself on the deviation (the analysis fails), at its duration, on an abort or a halt of chaos:
   the fault is reverted and the colours cleared on every way out, a failure or a cancellation included.

The record (store collection ``slice_experiments``) is written at every check: the status, the timeline of
checks, and at the end the report: both sides' figures, the differences with their 95% intervals
(:mod:`controlplane.rollouts.intervals`), the uncoloured requests' failures and why the run stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chaos.faults.base import FaultSpec
from chaos.safety import FaultManager
from chaos.targets import Selector, Target
from controlplane.errors import Conflict
from controlplane.gateway.slices import Outcome
from controlplane.rollouts.analysis import FAIL, Analysis, Thresholds, analyse
from controlplane.rollouts.intervals import median_difference, share_difference
from controlplane.rollouts.traffic import TrafficSlices
from controlplane.store.database import Store
from inference.faults import COLOUR_PATTERN, COLOURABLE

logger = logging.getLogger(__name__)

COLLECTION = "slice_experiments"
KEEP_RECORDS = 200
MAX_CHECKS = 600  # the timeline keeps the latest this many checks
FAULT_SLACK_S = 10.0  # the fault outlives the run's duration by this much, then expires by itself
CONFIDENCE = 0.95
FINISHED = ("deviated", "completed", "aborted", "failed", "interrupted")
Scalar = str | int | float | bool


class ExperimentBusy(Conflict):
    """A slice experiment is running already (one at a time), or the traffic carries colours already."""


@dataclass(slots=True, frozen=True)
class Bounds:
    """How far the experiment slice may drift from the control before the run stops itself: a failure
    share above the control's by more than ``max_error_increase`` (absolute), or a median TTFT (TPOT)
    above ``max_latency_ratio`` times the control's, each significant at ``alpha`` (one-sided); no
    decision under ``min_samples`` requests a side."""

    max_error_increase: float = 0.05
    max_latency_ratio: float = 1.5
    alpha: float = 0.01
    min_samples: int = 10

    def thresholds(self) -> Thresholds:
        return Thresholds(alpha=self.alpha, max_error_increase=self.max_error_increase,
                          max_latency_ratio=self.max_latency_ratio, min_samples=self.min_samples)


@dataclass(slots=True, frozen=True)
class ExperimentSpec:
    """One slice experiment. ValueError (naming the field) for what cannot run."""

    share: float  # of all requests, for each of the two colours
    fault: str  # error_rate | token_latency | prefill_delay
    params: Mapping[str, Scalar] = field(default_factory=dict)  # the fault's, ``colour`` set here
    duration_s: float = 60.0
    check_interval_s: float = 1.0
    bounds: Bounds = field(default_factory=Bounds)
    colour: str = "chaos"
    control: str = "control"

    def __post_init__(self) -> None:
        if not 0 < self.share <= 0.5:
            raise ValueError(f"share: must be in (0, 0.5] (two slices of it), got {self.share!r}")
        if self.fault not in COLOURABLE:
            raise ValueError(f"fault: must be one of {', '.join(sorted(COLOURABLE))} (a coloured fault), "
                             f"got {self.fault!r}")
        if not 0 < self.duration_s <= 3600:
            raise ValueError(f"duration_s: must be in (0, 3600], got {self.duration_s!r}")
        if not 0.1 <= self.check_interval_s <= 60:
            raise ValueError(f"check_interval_s: must be in [0.1, 60], got {self.check_interval_s!r}")
        for name in ("colour", "control"):
            if not COLOUR_PATTERN.match(getattr(self, name)):
                raise ValueError(f"{name}: 1-32 of a-z, 0-9 and '-', got {getattr(self, name)!r}")
        if self.colour == self.control:
            raise ValueError("control: must differ from the experiment colour")
        given = self.params.get("colour")
        if given is not None and given != self.colour:
            raise ValueError(f"params.colour: the fault takes the experiment's colour {self.colour!r}, "
                             f"got {given!r}")
        self.bounds.thresholds()  # ValueError for a bad bound

    def fault_spec(self) -> FaultSpec:
        """The coloured fault on every replica (only the experiment colour's requests feel it)."""
        return FaultSpec(self.fault, {**self.params, "colour": self.colour},
                         self.duration_s + FAULT_SLACK_S, Selector.parse("ALL"))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"params": dict(self.params)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ExperimentSpec:
        """TypeError or ValueError for a malformed one."""
        body = dict(raw)
        bounds = Bounds(**(body.pop("bounds", None) or {}))
        return cls(**body, bounds=bounds)


# ---- the pure parts: the sides, a check, the report ---------------------------------------------
@dataclass(slots=True, frozen=True)
class Sides:
    """What the gateways saw since the start: the two colours' outcomes, and the count of every request."""

    experiment: list[Outcome]
    control: list[Outcome]
    total: int
    total_failed: int

    @property
    def uncoloured(self) -> int:
        return self.total - len(self.experiment) - len(self.control)

    @property
    def uncoloured_failed(self) -> int:
        coloured_failed = sum(1 for o in (*self.experiment, *self.control) if not o.ok)
        return self.total_failed - coloured_failed


def sides(outcomes: Mapping[str, Sequence[Outcome]], spec: ExperimentSpec) -> Sides:
    """Split the merged per-slice outcomes: every request is in exactly one ``version:`` slice, and in the
    ``colour:`` slice of its colour when it has one."""
    everyone = [o for name, rows in outcomes.items() if name.startswith("version:") for o in rows]
    return Sides(list(outcomes.get(f"colour:{spec.colour}", ())),
                 list(outcomes.get(f"colour:{spec.control}", ())), len(everyone),
                 sum(1 for o in everyone if not o.ok))


def check_entry(t: float, s: Sides, analysis: Analysis) -> dict[str, Any]:
    """One point of the timeline: the counts of each side and the verdict."""
    return {"t": round(t, 3), "verdict": analysis.verdict, "reasons": analysis.reasons,
            "experiment": _counts(s.experiment), "control": _counts(s.control),
            "uncoloured": {"requests": s.uncoloured, "failed": s.uncoloured_failed}}


def _counts(rows: Sequence[Outcome]) -> dict[str, int]:
    return {"requests": len(rows), "failed": sum(1 for o in rows if not o.ok)}


def _values(rows: Sequence[Outcome], metric: str) -> list[float]:
    return [v for o in rows if o.ok and (v := (o.ttft_s if metric == "ttft" else o.tpot_s)) is not None]


def report(s: Sides, analysis: Analysis, *, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Both sides' figures (per metric: requests, failed, error rate, P50/P95/P99 in ms), the analysis, and
    each difference (experiment minus control) with its interval."""
    figures: dict[str, dict[str, Any]] = {"experiment": {}, "control": {}}
    for m in analysis.metrics:
        figures["experiment"][m.metric] = m.candidate.to_json()
        figures["control"][m.metric] = m.baseline.to_json()
    exp, ctl = _counts(s.experiment), _counts(s.control)
    differences = [share_difference(exp["failed"], exp["requests"], ctl["failed"], ctl["requests"],
                                    confidence=confidence)]
    for metric in ("ttft", "tpot"):
        differences.append(median_difference(_values(s.experiment, metric), _values(s.control, metric),
                                             metric=f"{metric}_p50_s", confidence=confidence))
    return {"experiment": {**exp, "metrics": figures["experiment"]},
            "control": {**ctl, "metrics": figures["control"]},
            "uncoloured": {"requests": s.uncoloured, "failed": s.uncoloured_failed},
            "analysis": analysis.to_json(),
            "differences": [d.to_json() for d in differences if d is not None]}


# ---- the runs -----------------------------------------------------------------------------------
class SliceExperiments:
    """Slice experiments, one at a time, in the background on the control plane's event loop; records in
    the store. ``targets`` gives the fleet's replicas as fault targets."""

    def __init__(self, slices: TrafficSlices, faults: FaultManager, targets: Callable[[], Sequence[Target]],
                 store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self.slices, self.faults, self.targets, self.store = slices, faults, targets, store
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._running_id: int | None = None
        self._abort = asyncio.Event()
        self.mark_interrupted()

    @property
    def running_id(self) -> int | None:
        return self._running_id if self._task is not None and not self._task.done() else None

    def mark_interrupted(self) -> int:
        """Records left ``running`` by a control plane that died mid-run become ``interrupted``, and their
        colours are cleared (their faults are the fault manager's leftovers, reverted at its start)."""
        stale = [r for r in self.store.records(COLLECTION, limit=KEEP_RECORDS)
                 if r.body.get("status") == "running"]
        for r in stale:
            spec = r.body.get("spec") or {}
            if set(self.slices.plan().to_json()["colours"]) & {spec.get("colour"), spec.get("control")}:
                self.slices.set_colours({})
            stopped = {"reason": "interrupted", "detail": "the control plane stopped during the run",
                       "after_s": None}
            self.store.update_record(r.id, {**r.body, "status": "interrupted", "colours_cleared": True,
                                            "stopped": stopped})
        return len(stale)

    def start(self, spec: ExperimentSpec, by: str) -> int:
        """Check and start a run; its id at once. ExperimentBusy: one runs already, or the traffic has
        colours; ValueError / KeyError: a fault the catalogue refuses; FaultError: a kind unavailable here;
        Conflict: the fault manager's plan refuses it (halted chaos)."""
        if self.running_id is not None:
            raise ExperimentBusy(f"slice experiment {self._running_id} is running; one at a time",
                                 subject=str(self._running_id))
        colours = self.slices.plan().colours
        if colours:
            raise ExperimentBusy("the traffic carries colours already: "
                                 + ", ".join(f"{c.name} {c.share:g}" for c in colours))
        plan = self.faults.plan(spec.fault_spec(), self.targets())
        if not plan.allowed:
            raise Conflict("; ".join(plan.reasons))
        if not plan.targets:
            raise Conflict("no replica to put the fault on")
        body = {"status": "running", "by": by, "spec": spec.to_json(), "started_at": self.clock(),
                "finished_at": None, "fault_ids": [], "fault_targets": [], "checks": [], "report": None,
                "stopped": None, "faults_reverted": None, "colours_cleared": None}
        record = self.store.add_record(COLLECTION, body, key=spec.fault)
        self.store.trim_records(COLLECTION, KEEP_RECORDS)
        self._running_id = record.id
        self._abort = asyncio.Event()
        self._task = asyncio.create_task(self._run(record.id, spec, body),
                                         name=f"slice-experiment-{record.id}")
        logger.info("slice experiment %d: %s on %g%% of traffic against a control of the same size",
                    record.id, spec.fault, spec.share * 100)
        return record.id

    def abort(self, experiment_id: int) -> bool:
        if self.running_id != experiment_id:
            return False
        self._abort.set()
        return True

    async def wait(self, experiment_id: int) -> dict[str, Any] | None:
        """Until the run ``experiment_id`` has finished (at once when it is not running); its record. A
        cancelled caller aborts the run and waits for its clean-up."""
        task = self._task if self.running_id == experiment_id else None
        if task is not None:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():  # the run itself was cancelled (the control plane stops): it is over
                    return self.get(experiment_id)
                self.abort(experiment_id)
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
                raise
        return self.get(experiment_id)

    async def run_to_end(self, spec: Mapping[str, Any], by: str) -> dict[str, Any]:
        """Start a run from its JSON spec (a drill's scenario) and wait for its record; cancelling the
        caller aborts the run. ValueError / TypeError for a bad spec, the errors of :meth:`start`."""
        experiment_id = self.start(ExperimentSpec.from_json(spec), by)
        record = await self.wait(experiment_id)
        assert record is not None  # it was just written
        return record

    async def aclose(self) -> None:
        """Abort a running experiment (its fault reverted, its colours cleared) and wait for its record."""
        if self._task is not None and not self._task.done():
            self._abort.set()
            await asyncio.gather(self._task, return_exceptions=True)

    def get(self, experiment_id: int) -> dict[str, Any] | None:
        record = self.store.record(experiment_id, COLLECTION)
        return None if record is None else {**record.body, "id": record.id}

    def recent(self, limit: int = 50) -> list[dict[str, Any]]:
        return [{**r.body, "id": r.id} for r in self.store.records(COLLECTION, limit=limit)]

    # -- one run -----------------------------------------------------------------------------------
    async def _run(self, record_id: int, spec: ExperimentSpec, body: dict[str, Any]) -> None:
        started = float(body["started_at"])  # until the colours go on
        injected: list[int] = []
        last: tuple[Sides, Analysis] | None = None
        stopped: dict[str, Any] = {"reason": "error", "detail": ""}
        try:
            faults = await self.faults.inject(spec.fault_spec(), self.targets())
            injected = [f.fault_id for f in faults if f.fault_id is not None]
            body.update(fault_ids=injected, fault_targets=[f.target_id for f in faults if f.ok])
            failed = [str(f.error) for f in faults if not f.ok]
            if failed:
                raise RuntimeError(f"fault not injected: {'; '.join(failed)}")
            # The fault first, then the colours: no request of the colour is served before the fault is in
            # place (the gateways take the plan within the feed's long poll), so every one of them counts.
            self.slices.set_colours({spec.colour: spec.share, spec.control: spec.share})
            started = body["coloured_at"] = self.clock()
            self._save(record_id, body)
            thresholds = spec.bounds.thresholds()
            while True:
                left = started + spec.duration_s - self.clock()
                if await self._pause(min(spec.check_interval_s, max(left, 0.0))):
                    stopped = {"reason": "abort", "detail": "aborted by an operator"}
                    break
                s = sides(await self.slices.outcomes(started), spec)
                analysis = await asyncio.to_thread(analyse, s.control, s.experiment, thresholds)
                last = (s, analysis)
                entry = check_entry(self.clock() - started, s, analysis)
                body["checks"] = [*body["checks"], entry][-MAX_CHECKS:]
                if analysis.verdict == FAIL:
                    stopped = {"reason": "deviation", "detail": "; ".join(analysis.reasons)}
                    break
                if self.faults.is_halted:
                    stopped = {"reason": "halted", "detail": "chaos was halted"}
                    break
                if self.clock() >= started + spec.duration_s:
                    stopped = {"reason": "duration", "detail": f"no deviation beyond the bounds in "
                                                               f"{spec.duration_s:g} s"}
                    break
                self._save(record_id, body)
        except asyncio.CancelledError:
            stopped = {"reason": "abort", "detail": "cancelled (the control plane is stopping)"}
            raise
        except Exception as exc:
            logger.exception("slice experiment %d failed", record_id)
            stopped = {"reason": "error", "detail": f"{type(exc).__name__}: {exc}"}
        finally:
            stopped["after_s"] = round(self.clock() - started, 3)
            await self._finish(record_id, spec, body, injected, last, stopped)

    async def _pause(self, seconds: float) -> bool:
        """Sleep, cut short by an abort; whether it was aborted."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._abort.wait(), seconds)
        return self._abort.is_set()

    async def _finish(self, record_id: int, spec: ExperimentSpec, body: dict[str, Any], injected: list[int],
                      last: tuple[Sides, Analysis] | None, stopped: dict[str, Any]) -> None:
        """Revert the fault and clear the colours whatever happened, then write the report."""
        reverts = []
        for fault_id in injected:
            try:
                result = await self.faults.revert(fault_id)
                reverts.append({"fault_id": fault_id, "ok": result.ok, "detail": result.detail})
            except Exception as exc:  # the ledger keeps it: revert_leftovers retries at the next start
                reverts.append({"fault_id": fault_id, "ok": False, "detail": f"{type(exc).__name__}: {exc}"})
        try:
            self.slices.set_colours({})
            cleared = True
        except Exception:
            logger.exception("slice experiment %d: colours not cleared", record_id)
            cleared = False
        if last is None and stopped["reason"] != "error":
            with contextlib.suppress(Exception):
                since = float(body.get("coloured_at") or body["started_at"])
                s = sides(await self.slices.outcomes(since), spec)
                thresholds = spec.bounds.thresholds()
                last = (s, await asyncio.to_thread(analyse, s.control, s.experiment, thresholds))
        if last is not None:
            try:
                body["report"] = await asyncio.to_thread(report, *last)
            except Exception as exc:
                logger.exception("slice experiment %d: no report", record_id)
                body["error"] = f"report: {exc}"
        status = {"deviation": "deviated", "duration": "completed", "error": "failed"}.get(stopped["reason"],
                                                                                         "aborted")
        body.update(status=status, stopped=stopped, finished_at=self.clock(), reverts=reverts,
                    faults_reverted=all(r["ok"] for r in reverts), colours_cleared=cleared)
        if status == "failed":
            body["error"] = stopped["detail"]
        self._save(record_id, body)
        with contextlib.suppress(Exception):
            self.store.add_event("experiment.slice.stopped", str(record_id), {
                "status": status, "reason": stopped["reason"], "after_s": stopped["after_s"]})
        logger.info("slice experiment %d: %s after %.1f s (%s)", record_id, status, stopped["after_s"],
                    stopped["detail"])

    def _save(self, record_id: int, body: dict[str, Any]) -> None:
        try:
            self.store.update_record(record_id, body)
        except Exception:  # the run goes on; the next check writes it again
            logger.exception("slice experiment %d: record not written", record_id)
