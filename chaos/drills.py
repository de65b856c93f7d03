"""RTO/RPO failover drills: steady state -> load -> fault at t0 -> observe -> revert -> report.

Where it sits: the control plane's ``DrillService`` (``controlplane.drills.service``) hands a
:class:`DrillRunner` a :class:`DrillPort` (fleet view, targets, rollout trigger, gateway events, store marks)
and the :class:`~chaos.safety.FaultManager`; the runner starts the load client as a separate process
(``python -m inference.bench serve`` against the gateway, loopback only, temperature 0, fixed seed,
``ignore_eos`` so every stream owes exactly ``max_tokens`` tokens, per-request JSONL), injects the
scenario's faults (``chaos.scenarios``) at t0 through the fault manager's ledger, polls the fleet until
capacity is back or the deadline passes, reverts, and derives the figures from the CLIENT's JSONL, not
from the control plane's own view. The load is Poisson at the scenario's rate, or a window of an Azure LLM
trace replayed with its own arrivals and token counts (``LoadProfile``); either way it lasts
``duration_s``. t0 is ``fault_at_s`` after the gateway first sees the load's requests in flight (and, at
most ``STREAM_WAIT_S`` later, once a stream is in flight).

Aim (:func:`chaos.drill_aim.resolve_aim`): a single-replica fault (``COUNT(1)``) hits the replica the caller
named, else the replica with the most streams in flight at t0 (in the zone the caller named, if any); a
zone fault hits the zone the caller named, else the busiest replica's zone, so that by default the drill
hits live streams.
The caller's names are checked against the fleet when the drill starts (:meth:`DrillRunner.check`) and
resolved again at t0; the report keeps both (``targets_requested``, ``targets_resolved``). All times are
wall-clock POSIX seconds on this host, read from the runner's clock (a :class:`~chaos.clock.WallClock`
unless one is given: tests drive the phases on simulated time); the report gives them relative to t0.

The figures (t_detect, t_switch, t_first_ok, t_service, t_slo, t_capacity, RTO and RPO), the prediction and
the verdict are pure functions of the client timeline and the fleet samples, defined and computed in
:mod:`chaos.drill_figures`; their names are re-exported here for the modules and tests that import them
from ``chaos.drills``, as are the aim's (:mod:`chaos.drill_aim`), the load client's command line and
diagnosis (:mod:`chaos.drill_load`), and the port a drill runs against with the errors it raises
(:mod:`chaos.drill_port`). What the steady state is, and its gateway probe, is
:mod:`chaos.drill_steady_state`; the report's conclusion (verdict, figures, timeline, status) is
:mod:`chaos.drill_report`. This module is the runner: the phases, the load process, the faults, and the
measurements the report is concluded from.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos.clock import Clock, WallClock
from chaos.drill_aim import Aim, check_aim, resolve_aim
from chaos.drill_figures import (
    ClientRequest,
    Figures,
    FleetSample,
    Prediction,
    Thresholds,
    Timings,
    client_timeline,
    derive_figures,
    percentile,
    predict,
    timeline_series,
    verdict,
)
from chaos.drill_load import LOAD_GRACE_S, describe_load, load_command, load_not_started
from chaos.drill_port import (
    DrillAborted,
    DrillBusy,
    DrillError,
    DrillPort,
    FaultNotInjected,
    LoadFailed,
    LoadNotFlowing,
    NoTarget,
)
from chaos.drill_report import conclude
from chaos.drill_steady_state import steady_state
from chaos.faults.base import FaultError, FaultSpec
from chaos.safety import ActiveFault, FaultManager
from chaos.scenarios import SCENARIOS, Scenario, scenario
from chaos.targets import Selector
from inference.bench.report import read_jsonl
from inference.environment import child_environment

logger = logging.getLogger(__name__)

Progress = Callable[[str, float], None]  # (phase, fraction of the whole drill in [0, 1])

SAMPLE_INTERVAL_S = 0.2  # fleet polling while a drill runs
SETTLE_S = 2.0  # capacity must hold this long before observation ends early
LOAD_START_TIMEOUT_S = 60.0  # the load client's first request must reach the gateway by then
STREAM_WAIT_S = 3.0  # at most this long past fault_at_s for a stream in flight to aim at
STEADY_POLL_S = 1.0  # a steady state not met yet is checked again this often, up to the scenario's timeout
NUM_MARKS = 5  # acknowledged store writes checked for loss


# ---- the runner -----------------------------------------------------------------------------------
class DrillRunner:
    """Runs one drill at a time against a port and a fault manager; the report is a JSON-ready dict.

    Failures inside a run become the report's ``status`` ("error", with the reason) and every injected
    fault is reverted on the way out, whatever happened.
    """

    def __init__(self, port: DrillPort, faults: FaultManager, *, clock: Clock | None = None) -> None:
        self.port = port
        self.faults = faults
        self.clock: Clock = clock or WallClock()  # POSIX seconds: the load client's JSONL is on them too

    # -- plan (dry run) --------------------------------------------------------------------------
    def check(self, sc: Scenario) -> None:
        """ValueError (naming ``replicas`` or ``zones``) when the scenario's aim is not in the fleet now."""
        check_aim(sc, self.port.targets())

    def aim(self, sc: Scenario) -> Aim:
        """The scenario's aim resolved against the fleet and its streams in flight now."""
        return resolve_aim(sc, self.port.targets(), self.port.inflight())

    def fault_specs(self, sc: Scenario, aim: Aim | None = None) -> list[tuple[FaultSpec, bool]]:
        """The scenario's fault steps aimed at ``aim`` (default: resolved now): a single-replica step at
        its replica, a zone step at its zone."""
        if not sc.faults:
            return []
        aim = aim or self.aim(sc)
        out = []
        for step in sc.faults:
            if step.zone:
                zones, ids = list(aim.zones), []
            elif step.is_single:
                zones, ids = [], list(aim.replicas)
            else:
                zones, ids = list(sc.zones), list(sc.replicas)
            selector = Selector.parse(step.selector, zones=zones, replica_ids=ids)
            out.append((FaultSpec(step.kind, dict(step.params), step.duration_s, selector), step.allow_all))
        return out

    def plan(self, sc: Scenario) -> dict[str, Any]:
        """What the drill would do: the load, the aim, the faults with their resolved targets, the
        prediction. Targets resolved from streams in flight are resolved again at t0."""
        targets = self.port.targets()
        aim = self.aim(sc)
        faults: list[dict[str, Any]] = []
        num_hit = 0
        for spec, allow_all in self.fault_specs(sc, aim):
            p = self.faults.plan(spec, targets, allow_all=allow_all)
            faults.append({"kind": spec.kind, "selector": spec.selector.describe(),
                           "duration_s": spec.duration_s, "targets": [t.replica_id for t in p.targets],
                           "allowed": p.allowed, "reasons": list(p.reasons)})
            num_hit += len(p.targets)
        pred = predict(sc, self.port.timings(), num_hit=num_hit, ttft_s=0.0, e2e_s=0.0)
        return {"scenario": sc.describe(), "load": describe_load(sc), "targets_requested": aim.requested(),
                "targets_resolved": aim.resolved(), "faults": faults, "prediction": dataclasses.asdict(pred)}

    # -- run -------------------------------------------------------------------------------------
    async def run(self, drill_id: str, sc: Scenario, *, workdir: Path, progress: Progress | None = None,
                  abort: asyncio.Event | None = None) -> dict[str, Any]:
        if sc.action == "control-plane-crash":  # it kills the process this runner would live in
            raise DrillError(f"{sc.id} runs outside the control plane (controlplane.drills.crash)",
                             subject=drill_id)
        run = _Run(self, drill_id, sc, workdir, progress or (lambda _p, _f: None), abort or asyncio.Event())
        return await run.execute()


def _reason_kind(reason: str) -> str:
    """A steady-state reason without its numbers ("fleet: 1 of 3 replicas ready" and "fleet: 2 of 3 ..."
    are one kind), so that waiting notes each kind once."""
    return re.sub(r"\d+(\.\d+)?", "N", reason)


class _Run:
    """One drill's state while it runs."""

    def __init__(self, runner: DrillRunner, drill_id: str, sc: Scenario, workdir: Path, progress: Progress,
                 abort: asyncio.Event) -> None:
        self.runner, self.port, self.faults, self.clock = runner, runner.port, runner.faults, runner.clock
        self.drill_id, self.sc, self.workdir = drill_id, sc, workdir
        self.progress, self.abort = progress, abort
        self.samples: list[FleetSample] = []
        self.injected: list[ActiveFault] = []
        self.hit: list[str] = []
        self.load: asyncio.subprocess.Process | None = None
        self.slice_run: asyncio.Task[dict[str, Any]] | None = None  # slice-experiment: the run
        self.report: dict[str, Any] = {"id": drill_id, "scenario": sc.id, "title": sc.title,
                                       "config": sc.describe(), "status": "running",
                                       "targets_requested": {"replicas": list(sc.replicas),
                                                             "zones": list(sc.zones)},
                                       "started_at": self.clock.now(), "events": []}
        self.jsonl = workdir / "load.jsonl"

    def note(self, what: str, **detail: Any) -> None:
        logger.info("drill %s: %s %s", self.drill_id, what, detail or "")
        self.report["events"].append({"t": self.clock.now(), "what": what, **detail})

    def phase(self, name: str, fraction: float) -> None:
        self.report["phase"] = name
        with contextlib.suppress(Exception):  # a console's progress callback must not break the drill
            self.progress(name, min(max(fraction, 0.0), 1.0))

    async def execute(self) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            await self._drill()
        except DrillAborted:
            self.report["status"] = "aborted"
            self.note("aborted")
        except Exception as exc:  # a failed drill is a report, never an exception out of the run
            logger.exception("drill %s failed", self.drill_id)
            self.report["status"] = "error"
            self.report["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            await self._stop_load()
            await self._revert()
            self.report["finished_at"] = self.clock.now()
            self.phase("done", 1.0)
        return self.report

    async def _drill(self) -> None:
        self.phase("steady-state", 0.0)
        steady = await self._wait_steady_state()
        self.report["steady_state"] = steady
        if not steady["ok"]:
            self.report["status"] = "aborted"
            waited = f" after waiting {steady['waited_s']:g}s" if steady["waited_s"] else ""
            self.report["error"] = f"steady state not met{waited}: " + "; ".join(steady["reasons"])
            return
        specs = self.runner.fault_specs(self.sc)
        num_hit = sum(len(self.faults.plan(s, self.port.targets(), allow_all=a).targets) for s, a in specs)
        timings = self.port.timings()
        pred = predict(self.sc, timings, num_hit=num_hit, ttft_s=steady["probe_ttft_s"],
                       e2e_s=steady["probe_e2e_s"])
        self.report["timings"] = dataclasses.asdict(timings)
        self.report["prediction"] = dataclasses.asdict(pred)
        marks = self.port.write_marks(self.drill_id, NUM_MARKS)
        await self._start_load()
        load_start = await self._load_flowing()
        await self._observe_until(load_start + self.sc.fault_at_s, load_start)
        await self._streams_in_flight(load_start)
        asked = self.clock.now()
        await self._strike()
        t0 = self.clock.now()  # the fault is in effect once inject returns (an eBPF filter compiles first)
        self.report["t0"] = t0
        self.report["inject_s"] = round(t0 - asked, 4)
        await self._observe_recovery(t0, load_start)
        await self._revert()
        load_end = self.clock.now()
        self.phase("report", 0.97)
        self._conclude(t0, load_start, load_end, marks)

    # -- phases ----------------------------------------------------------------------------------
    async def _wait_steady_state(self) -> dict[str, Any]:
        """The steady state, waited for up to the scenario's ``steady_state_timeout_s``: a fleet still
        starting (right after ``controlplane up``), a rollout finishing, a gateway not routing yet or a
        slow probe. Chaos halted by an operator is not waited for. The result says how long it waited and
        for what (each reason seen on the way, once)."""
        started = self.clock.now()
        deadline = started + self.sc.steady_state_timeout_s
        waited_for: list[str] = []
        while True:
            steady = await steady_state(self.port.fleet_sample(), self.faults, self.sc, self.port.gateway_url,
                                        self.clock)
            new = [r for r in steady["reasons"] if _reason_kind(r) not in map(_reason_kind, waited_for)]
            if new and self.clock.now() < deadline and not self.faults.is_halted:
                self.note("waiting for steady state", reasons=new)
            waited_for += new
            waited = round(self.clock.now() - started, 3)
            if steady["ok"] or self.faults.is_halted or self.clock.now() >= deadline:
                if steady["ok"] and waited_for:
                    self.note("steady state reached", waited_s=waited)
                return {**steady, "waited_s": waited if waited_for else 0.0, "waited_for": waited_for,
                        "timeout_s": self.sc.steady_state_timeout_s}
            await self._sleep(min(STEADY_POLL_S, max(deadline - self.clock.now(), 0.0)))

    async def _start_load(self) -> None:
        sc = self.sc
        cmd = load_command(sc, self.port.gateway_url, self.workdir)
        log = (self.workdir / "load.log").open("wb")
        try:
            self.load = await asyncio.create_subprocess_exec(
                *cmd, stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                env=child_environment())  # the load client needs none of the operators' secrets
        finally:
            log.close()
        load = describe_load(sc)
        self.report["load"] = {**load, "command": " ".join(cmd[1:]), "pid": self.load.pid,
                               "jsonl": str(self.jsonl)}
        self.note("load started", pid=self.load.pid, **load)

    async def _load_flowing(self) -> float:
        """When the gateway first sees the load's streams in flight (the load client takes a while to
        start on a busy machine, and t0 counts from its first requests). When it never does, the error
        (and the report's ``load.not_started``) says why: the client exited, was still starting, or sent
        requests the gateway did not route."""
        started = self.clock.now()
        while self.clock.now() < started + LOAD_START_TIMEOUT_S:
            await self.port.refresh_inflight()
            if sum(self.port.inflight().values()) > 0:
                self.note("load flowing", after_s=round(self.clock.now() - started, 3))
                return self.clock.now()
            if self.load is not None and self.load.returncode is not None:
                break
            await self._sleep(0.05)
        why = load_not_started(self.load, self.workdir / "load.log", waited_s=self.clock.now() - started)
        self.report.setdefault("load", {})["not_started"] = why
        raise LoadNotFlowing(f"the load never reached the gateway: {why}; see {self.workdir / 'load.log'}",
                             subject=self.drill_id)

    async def _streams_in_flight(self, load_start: float) -> None:
        """At a low rate the fault's targets may be idle at fault_at_s; wait a little for a stream on them,
        so that the drill measures a failover and not an idle kill (t0 is taken after this anyway). The
        targets are the scenario's aim resolved afresh each time (a named replica or zone: its replicas; the
        busiest replica: any stream will do); a process crash has no replica aim and waits for any stream.
        The view is read fresh from the gateways each time, so that the aim taken right after it finds the
        stream. When the wait runs out, the report's notes say so."""
        deadline = self.clock.now() + STREAM_WAIT_S
        await self.port.refresh_inflight()
        while self._inflight_on_aim() == 0 and self.clock.now() < deadline:
            self._sample(load_start)
            await self._sleep(0.02)
            await self.port.refresh_inflight()
        if self._inflight_on_aim() == 0:
            self.note("no stream in flight on the targets", waited_s=STREAM_WAIT_S)

    def _inflight_on_aim(self) -> int:
        """Streams in flight on the replicas the fault would hit now (the whole fleet's when the aim names
        no replica or cannot be resolved: the strike reports that)."""
        inflight = self.port.inflight()
        try:
            aimed = self.runner.aim(self.sc).replicas
        except ValueError:
            aimed = ()
        return sum(inflight.get(r, 0) for r in aimed) if aimed else sum(inflight.values())

    async def _observe_until(self, until: float, load_start: float) -> None:
        while self.clock.now() < until:
            self._sample(load_start)
            if self.load is not None and self.load.returncode is not None:
                raise LoadFailed(f"the load client exited early ({self.load.returncode}); see "
                                 f"{self.workdir / 'load.log'}", subject=self.drill_id)
            await self._sleep(min(SAMPLE_INTERVAL_S, max(until - self.clock.now(), 0.0)))

    async def _sleep(self, seconds: float) -> None:
        """The clock's sleep, cut short by an abort."""
        if not self.abort.is_set():
            nap = asyncio.ensure_future(self.clock.sleep(seconds))
            aborted = asyncio.ensure_future(self.abort.wait())
            _, pending = await asyncio.wait((nap, aborted), return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
        if self.abort.is_set():
            raise DrillAborted("aborted by an operator", subject=self.drill_id)

    def _sample(self, load_start: float) -> None:
        self.samples.append(self.port.fleet_sample())
        total = self.sc.duration_s + 5.0
        name = "observe" if "t0" in self.report else "load"  # after t0: faults in, waiting for recovery
        self.phase(name, 0.05 + 0.8 * min((self.clock.now() - load_start) / total, 1.0))

    async def _strike(self) -> None:
        targets = self.port.targets()
        try:
            aim = self.runner.aim(self.sc)
        except ValueError as exc:  # a named replica or zone left the fleet since the drill started
            raise NoTarget(f"no target at t0: {exc}", subject=self.drill_id) from exc
        self.report["targets_resolved"] = aim.resolved()
        if self.sc.action == "rollout":
            model = self.port.start_rollout()
            self.note("rollout started", model=model)
            return
        if self.sc.action == "gateway-crash":
            self.report["gateway_killed"] = self.port.kill_gateway()
            self.note("gateway killed", gateway=self.report["gateway_killed"])
            return
        if self.sc.slice_step is not None:
            self.slice_run = asyncio.ensure_future(self.port.run_slice_experiment(
                self.sc.slice_step.spec(), f"drill-{self.drill_id}"))
            await asyncio.sleep(0.05)  # it starts at once, or is refused at once
            if self.slice_run.done() and self.slice_run.exception() is not None:
                raise FaultNotInjected(f"slice experiment: {self.slice_run.exception()}",
                                       subject=self.drill_id)
            self.note("slice experiment started", **self.sc.slice_step.spec())
            return
        for spec, allow_all in self.runner.fault_specs(self.sc, aim):
            try:
                faults = await self.faults.inject(spec, targets, allow_all=allow_all)
            except (FaultError, ValueError, KeyError) as exc:
                raise FaultNotInjected(f"fault {spec.kind} not injected: {exc}",
                                       subject=self.drill_id) from exc
            self.injected += faults
            failed = [f.error for f in faults if not f.ok]
            if failed:
                raise FaultNotInjected(f"fault {spec.kind} not injected: {'; '.join(str(e) for e in failed)}",
                                       subject=self.drill_id)
            self.hit += [f.target_id for f in faults]
            self.note("fault injected", kind=spec.kind, targets=[f.target_id for f in faults],
                      fault_ids=[f.fault_id for f in faults])
        self.report["fault_targets"] = self.hit

    async def _observe_recovery(self, t0: float, load_start: float) -> None:
        deadline = t0 + self.sc.capacity_deadline_s
        min_end = t0 + max(self.sc.fault_duration_s, 1.0) + SETTLE_S
        load_done = False
        while self.clock.now() < deadline:
            self._sample(load_start)
            if not load_done and self.load is not None and self.load.returncode is not None:
                load_done = True
                self.note("load finished", returncode=self.load.returncode)
            if load_done and self.clock.now() >= min_end and self._settled():
                return
            await self._sleep(SAMPLE_INTERVAL_S)
        self.note("deadline passed", deadline_s=self.sc.capacity_deadline_s)
        if self.load is not None and self.load.returncode is None:
            await self._wait_load(LOAD_GRACE_S)

    def _settled(self) -> bool:
        recent = [s for s in self.samples if s.t >= self.clock.now() - SETTLE_S]
        return bool(recent) and all(s.has_capacity for s in recent) and \
            self.samples[0].t < self.clock.now() - SETTLE_S

    async def _wait_load(self, timeout: float) -> None:
        assert self.load is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.load.wait(), timeout)

    async def _stop_load(self) -> None:
        if self.load is None or self.load.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.load.pid, signal.SIGTERM)
        await self._wait_load(5.0)
        if self.load.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.load.pid, signal.SIGKILL)
            await self._wait_load(5.0)

    async def _revert(self) -> None:
        if self.slice_run is not None:  # it stops itself; an early end of the drill aborts it
            if not self.slice_run.done():
                self.slice_run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(self.slice_run, return_exceptions=True)
        for fault in self.injected:
            if fault.fault_id is not None:
                result = await self.faults.revert(fault.fault_id)
                if not result.ok:
                    self.note("revert failed", fault_id=fault.fault_id, detail=result.detail)
        self.injected = []

    # -- report (what the run measured; chaos.drill_report concludes it) -------------------------
    def _conclude(self, t0: float, load_start: float, load_end: float, marks: list[int]) -> None:
        records = read_jsonl(self.jsonl) if self.jsonl.exists() else []
        if not records:
            raise LoadFailed(f"the load client wrote no records; see {self.workdir / 'load.log'}",
                             subject=self.drill_id)
        requests = client_timeline(records)
        fig = derive_figures(requests, self.samples, t0=t0, slo=self.sc.slo, fault_targets=self.hit)
        fig.requests_resumed = self.port.resumes_between(load_start, load_end)
        fig.writes_lost = len(marks) - self.port.count_marks(marks)
        slice_record = self._slice_record() if self.slice_run is not None else None
        conclude(self.report, fig, requests, self.samples, self.sc, t0=t0, slice_record=slice_record)
        self.note("report", status=self.report["status"])

    def _slice_record(self) -> dict[str, Any] | None:
        """The slice experiment's record; None when it outlived the drill's observation (its figures fail)."""
        run = self.slice_run
        assert run is not None
        if not run.done() or run.cancelled():
            self.note("slice experiment cut short by the end of the drill")
            return None
        if run.exception() is not None:
            raise FaultNotInjected(f"slice experiment: {run.exception()}", subject=self.drill_id)
        return run.result()


__all__ = ["LOAD_GRACE_S", "SCENARIOS", "Aim", "ClientRequest", "DrillAborted", "DrillBusy", "DrillError",
           "DrillPort", "DrillRunner", "FaultNotInjected", "Figures", "FleetSample", "LoadFailed",
           "LoadNotFlowing", "NoTarget", "Prediction", "Thresholds", "Timings", "check_aim",
           "client_timeline", "derive_figures", "describe_load", "load_command", "load_not_started",
           "percentile", "predict", "resolve_aim", "scenario", "timeline_series", "verdict"]
