"""A native runner for experiments in Chaos Toolkit's format, writing a superset of its journal.

Where it sits: the CLI (``controlplane chaos run``) and the REST API run experiments through it; the
actions and probes usually come from :mod:`chaos.ctk`, which drives the control plane over HTTP. The
format itself (loading, validation, tolerances, the plan and the journal's keys) is described and checked
in :mod:`chaos.experiment_format`, the providers live in :mod:`chaos.experiment_providers`; their public
names are re-exported here. This module plays the phases.

A run: steady state before (not met: ``failed``, method skipped) -> method, while the stop conditions are
checked every ``check_interval_s`` (a trip: ``aborted``, the commands running are killed, the faults the
run injected so far are reverted at once) -> steady state after (not met: ``failed`` and ``deviated``) ->
rollbacks (by default always).
A hypothesis without probes is not checked; a method may be empty (the steady state is checked alone).
An activity with ``background: true`` runs concurrently with the ones after it; the method's are joined
before the steady state after, the rollbacks' at their end, as Chaos Toolkit does. Records keep the order
the activities started in. A failed activity is a record in the journal (status, exception), never an
exception out of the run; so is a tolerance that cannot be judged. No process provider's command outlives
its run: an abort, a cancellation (Ctrl-C) or the end of the run kills what is still running.

What a run may reach, when a server runs it for a caller: python providers only from the modules the
server allows and only the functions those modules list (:func:`~chaos.experiment_format.provider_function`);
``http`` providers only to the hosts of an ``egress`` allow-list (:class:`~chaos.egress.HostAllowList`),
without following redirects, keeping at most ``MAX_HTTP_BODY_BYTES`` of each answer; no process providers
(``allow_process`` defaults to ``allow_env``: a runner that may read its environment is the operator's
own, and runs local commands as ``chaos run`` does; one that may not is a server's, and runs none). Secret
values (the experiment's and the caller's own token) are redacted as Chaos Toolkit does: any string equal
to one, or holding one, is written ``***`` in activity outputs, exceptions, the journal and the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import httpx

from chaos.clock import Clock, MonotonicClock
from chaos.egress import HostAllowList
from chaos.experiment_format import (
    JOURNAL_FORMAT,
    Experiment,
    InvalidExperiment,
    Journal,
    check_python_modules,
    iter_activities,
    load_experiment,
    new_journal,
    now_iso,
    num_activities,
    plan,
    refuse_environment_lookups,
    refuse_process_providers,
    resolve_activity,
    validate_experiment,
    within_tolerance,
)
from chaos.experiment_providers import (
    MAX_HTTP_BODY_BYTES,
    PROVIDERS,
    ActivityFailed,
    Context,
    InterruptExecution,
    redact,
    resolve_secrets,
    resolve_values,
    run_http,
    run_process,
    run_python,
    substitute,
)
from chaos.stop_conditions import StopCondition, StopMonitor, StopTrip

__all__ = [
    "JOURNAL_FORMAT", "MAX_HTTP_BODY_BYTES", "ActivityFailed", "Context", "Experiment", "ExperimentRunner",
    "InterruptExecution", "InvalidExperiment", "Journal", "check_python_modules", "load_experiment", "plan",
    "redact", "resolve_secrets", "resolve_values", "run_experiment", "run_http", "run_process", "run_python",
    "substitute", "validate_experiment", "within_tolerance",
]

logger = logging.getLogger(__name__)

RollbackStrategy = Literal["always", "never", "deviated", "default"]
ROLLBACK_STRATEGIES = ("always", "never", "deviated", "default")
ABORT_DRAIN_S = 30.0  # how long an aborted run waits for the activities in flight (their fault ids)

Progress = Callable[[int, int, str], None]
FaultReverter = Callable[[Sequence[int]], Awaitable[Sequence[object]]]
Record = dict[str, Any]


# ---- the runner ----------------------------------------------------------------------------------
@dataclass(slots=True)
class _State:
    journal: Journal
    ctx: Context
    fault_ids: list[int] = field(default_factory=list)
    in_flight: dict[asyncio.Future[Record], Record] = field(default_factory=dict)  # -> its journal record
    done: int = 0
    total: int = 0


class ExperimentRunner:
    """Runs experiments natively. Time (pauses, stop-condition checks) is on ``clock``; ``revert_faults``
    undoes fault ids when a stop condition aborts (default: through :mod:`chaos.ctk`)."""

    def __init__(self, *, clock: Clock | None = None, http_transport: httpx.BaseTransport | None = None,
                 revert_faults: FaultReverter | None = None, progress: Progress | None = None,
                 base_configuration: Mapping[str, Any] | None = None,
                 base_secrets: Mapping[str, Any] | None = None, allow_env: bool = True,
                 egress: HostAllowList | None = None, allow_process: bool | None = None) -> None:
        self._clock: Clock = clock or MonotonicClock()
        self._transport = http_transport
        self._revert_faults = revert_faults
        self._progress = progress
        self._base_configuration = dict(base_configuration or {})
        self._base_secrets = dict(base_secrets or {})
        self._allow_env = allow_env
        self._egress = egress
        self._allow_process = allow_env if allow_process is None else allow_process

    async def run(self, experiment: Experiment, *, dry_run: bool = False,
                  stop_conditions: Iterable[StopCondition] = (), check_interval_s: float = 1.0,
                  rollback_strategy: RollbackStrategy = "always") -> Journal:
        """Run (or with ``dry_run`` only walk) ``experiment``; InvalidExperiment before anything runs."""
        if rollback_strategy not in ROLLBACK_STRATEGIES:
            raise InvalidExperiment(f"rollback_strategy: one of {', '.join(ROLLBACK_STRATEGIES)}")
        ctx = self._context(experiment)
        conditions = tuple(stop_conditions)
        state = _State(new_journal(experiment, dry_run, conditions), ctx)
        state.total = num_activities(experiment)
        started = time.monotonic()
        logger.info("experiment %r: started%s", experiment["title"], " (dry run)" if dry_run else "")
        try:
            await self._phases(experiment, state, dry_run, conditions, check_interval_s, rollback_strategy)
        finally:  # also when cancelled (Ctrl-C): no command outlives the run, nor keeps asyncio.run waiting
            ctx.commands.stop("the run stopped")
            journal: Journal = redact(state.journal, ctx.secret_values)
            journal["end"] = now_iso()
            journal["duration"] = round(time.monotonic() - started, 3)
            journal["fault_ids"] = sorted(set(state.fault_ids))
            logger.info("experiment %r: %s (deviated=%s) in %.1fs", experiment["title"], journal["status"],
                        journal["deviated"], journal["duration"])
        return journal

    def _context(self, experiment: Experiment) -> Context:
        """What the activities run with, once the experiment is known to be valid and runnable here."""
        if not self._allow_env:
            refuse_environment_lookups(experiment)
        if not self._allow_process:
            refuse_process_providers(experiment)
        validate_experiment(experiment)
        configuration = {**resolve_values(experiment.get("configuration"), "configuration",
                                          allow_env=self._allow_env),
                         **self._base_configuration}  # the server's own values win, as its secrets do
        secrets = resolve_secrets(experiment.get("secrets"), allow_env=self._allow_env)
        ctx = Context(configuration, secrets, self._transport, dict(self._base_secrets), self._egress,
                      self._allow_process)
        _check_pauses(experiment, ctx.names)
        return ctx

    async def _phases(self, experiment: Experiment, state: _State, dry: bool,
                      conditions: tuple[StopCondition, ...], interval_s: float,
                      strategy: RollbackStrategy) -> None:
        journal = state.journal
        try:
            before = await self._hypothesis(experiment, state, dry, "before")
            if before is not None and not before["steady_state_met"]:
                journal["status"] = "failed"
            else:
                trip = await self._guarded_method(experiment, state, dry, conditions, interval_s)
                if trip is not None:
                    journal["status"] = "aborted"
                    journal["stop_condition"] = trip.to_json()
                    journal["abort_reverts"] = await self._abort(state)
                else:
                    after = await self._hypothesis(experiment, state, dry, "after")
                    if after is not None and not after["steady_state_met"]:
                        journal["status"], journal["deviated"] = "failed", True
        except InterruptExecution as exc:
            journal["status"] = "interrupted"
            journal["interruption"] = str(exc)
        if _play_rollbacks(strategy, journal):
            await self._play(experiment.get("rollbacks") or [], journal["rollbacks"], experiment, state, dry)

    async def _hypothesis(self, experiment: Experiment, state: _State, dry: bool,
                          when: str) -> dict[str, Any] | None:
        probes = (experiment.get("steady-state-hypothesis") or {}).get("probes") or []
        if not probes:
            return None  # as Chaos Toolkit: a hypothesis without probes is not checked
        result: dict[str, Any] = {"steady_state_met": True, "probes": []}
        state.journal["steady_states"][when] = result
        for probe in probes:
            record = await self._activity(probe, experiment, state, dry, result["probes"])
            met = dry or (record["status"] == "succeeded"
                          and await _judge(probe["tolerance"], record, state.ctx))
            record["tolerance_met"] = met
            if not met:
                result["steady_state_met"] = False
                name = probe.get("name", probe.get("ref"))
                logger.warning("experiment %r: steady state %s not met: probe %r gave %r",
                               experiment["title"], when, name, record["output"])
                break
        return result

    async def _guarded_method(self, experiment: Experiment, state: _State, dry: bool,
                              conditions: tuple[StopCondition, ...], interval_s: float) -> StopTrip | None:
        method = self._play(experiment["method"], state.journal["run"], experiment, state, dry)
        if dry or not conditions:
            await method
            return None
        monitor = StopMonitor(conditions, interval_s=interval_s, clock=self._clock)
        work, watcher = asyncio.ensure_future(method), asyncio.ensure_future(monitor.watch())
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            work.result()  # re-raises InterruptExecution
            return None
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return watcher.result()

    async def _play(self, activities: Sequence[Mapping[str, Any]], records: list[Record],
                    experiment: Experiment, state: _State, dry: bool) -> None:
        """One phase's activities in order; background ones run concurrently and are joined at its end
        (cancelled with it: an abort settles what they started, see :meth:`_abort`)."""
        background: list[asyncio.Task[Record]] = []
        try:
            for activity in activities:
                run = self._activity(activity, experiment, state, dry, records)
                if resolve_activity(activity, experiment).get("background"):
                    background.append(asyncio.ensure_future(run))
                    await asyncio.sleep(0)  # let it start (and take its place in the journal) first
                else:
                    await run
        except asyncio.CancelledError:
            for task in background:
                task.cancel()
            raise
        except InterruptExecution:
            await asyncio.gather(*background, return_exceptions=True)
            raise
        outcomes = await asyncio.gather(*background, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _abort(self, state: _State) -> list[dict[str, Any]]:
        """After a trip: kill the commands running (local commands inject no fault the run tracks), let the
        other activities in flight finish (their faults count), then revert every fault."""
        pending = dict(state.in_flight)
        state.ctx.commands.stop("the run was aborted by a stop condition")
        if pending:
            done, _ = await asyncio.wait(pending, timeout=ABORT_DRAIN_S)
            for future, record in pending.items():
                if future in done:
                    _settle(record, future.result(), state)  # it finished after the trip
                else:
                    record.update(status="failed", exception=[f"still running {ABORT_DRAIN_S:g}s after the "
                                                              "run was aborted\n"])
            state.in_flight.clear()
        state.ctx.commands.resume()  # the rollbacks' commands run
        ids = sorted(set(state.fault_ids))
        if not ids:
            return []
        reverter = self._revert_faults or _ctk_reverter(state.ctx)
        secrets = state.ctx.secret_values
        try:
            results = await reverter(ids)
        except Exception as exc:
            detail = redact(f"{type(exc).__name__}: {exc}", secrets)
            logger.error("abort: reverting faults %s failed: %s", ids, detail)
            return [{"fault_ids": ids, "ok": False, "detail": detail}]
        return [redact(_jsonable(r), secrets) for r in results]

    async def _activity(self, activity: Mapping[str, Any], experiment: Experiment, state: _State,
                        dry: bool, records: list[Record]) -> Record:
        """Run one activity (its pauses on the clock, its provider in a worker thread); its record joins
        ``records`` when it starts, as Chaos Toolkit's do, and is filled in when it ends."""
        resolved = resolve_activity(activity, experiment)
        pauses = _pauses(resolved, state.ctx.names)
        if not dry and pauses.get("before"):
            await self._clock.sleep(pauses["before"])
        record: Record = {"activity": dict(resolved), "output": None, "start": now_iso(), "status": "running"}
        records.append(record)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Record] = loop.run_in_executor(None, _execute, resolved, state.ctx, dry)
        state.in_flight[future] = record
        result = await asyncio.shield(future)
        del state.in_flight[future]
        _settle(record, result, state)
        if self._progress is not None:
            self._progress(state.done, state.total, str(resolved.get("name")))
        if record.get("interrupted"):
            raise InterruptExecution(record.get("exception", [""])[-1].strip())
        if not dry and pauses.get("after"):
            await self._clock.sleep(pauses["after"])
        return record


def run_experiment(experiment: Experiment, **kwargs: Any) -> Journal:
    """Synchronous wrapper: ``ExperimentRunner().run(experiment, **kwargs)`` on a fresh event loop."""
    runner_keys = {"clock", "http_transport", "revert_faults", "progress", "base_configuration",
                   "base_secrets", "allow_env", "egress", "allow_process"}
    runner = ExperimentRunner(**{k: v for k, v in kwargs.items() if k in runner_keys})
    return asyncio.run(runner.run(experiment, **{k: v for k, v in kwargs.items() if k not in runner_keys}))


async def _judge(tolerance: Any, record: Record, ctx: Context) -> bool:
    """Whether a probe's output meets its tolerance. A tolerance that is itself a probe is run with the
    output as its ``value``: a python or http one gets it as the ``value`` argument and is met when it
    succeeds with a truthy answer (Chaos Toolkit's rule); a process one gets it as its last argument (a
    string as it is, anything else as JSON) and is met when the command exits 0. A tolerance that cannot be
    judged fails the probe's record (status, exception), never the run."""
    try:
        if not (isinstance(tolerance, Mapping) and tolerance.get("type") == "probe"):
            return within_tolerance(tolerance, record["output"])
        judge = {**tolerance, "provider": _with_value(tolerance["provider"], record["output"])}
        verdict = await asyncio.get_running_loop().run_in_executor(None, _execute, judge, ctx, False)
    except Exception as exc:
        problem = "".join(traceback.format_exception_only(type(exc), exc))
        record["status"], record["exception"] = "failed", [redact(f"tolerance: {problem}", ctx.secret_values)]
        logger.error("probe %r: its tolerance cannot be judged: %s", record["activity"].get("name"),
                     redact(f"{type(exc).__name__}: {exc}", ctx.secret_values))
        return False
    if verdict["status"] != "succeeded":
        return False
    if tolerance["provider"].get("type") == "process":
        return isinstance(verdict["output"], Mapping) and verdict["output"].get("status") == 0
    return bool(verdict["output"])


def _with_value(provider: Mapping[str, Any], value: Any) -> dict[str, Any]:
    """A tolerance probe's provider given the probe's output (see :func:`_judge`)."""
    if provider.get("type") == "process":
        arg = value if isinstance(value, str) else json.dumps(value, default=str)
        return {**provider, "arguments": [*(provider.get("arguments") or []), arg]}
    return {**provider, "arguments": {**(provider.get("arguments") or {}), "value": value}}


def _check_pauses(experiment: Experiment, names: Mapping[str, Any]) -> None:
    """Every pause, its ``${name}`` resolved, is a number of seconds >= 0 (refused before anything runs)."""
    for where, activity in iter_activities(experiment):
        for key, value in substitute(dict(activity.get("pauses") or {}), names).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidExperiment(f"{where}.pauses.{key}: {value!r} is not a number of seconds >= 0")


def _pauses(activity: Mapping[str, Any], names: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in substitute(dict(activity.get("pauses") or {}), names).items()}


def _settle(record: Record, result: Record, state: _State) -> None:
    """An activity's outcome into its journal record (and its fault ids into the run's)."""
    record.update(result)
    state.fault_ids += _fault_ids(result.get("output"))
    state.done += 1


# ---- helpers -------------------------------------------------------------------------------------
def _execute(activity: Mapping[str, Any], ctx: Context, dry: bool) -> dict[str, Any]:
    """Run one activity in a worker thread; its failure becomes the record's status, never an exception."""
    start = datetime.now(UTC)
    record: dict[str, Any] = {"activity": dict(activity), "output": None, "start": start.isoformat()}
    try:
        if not dry:
            record["output"] = PROVIDERS[activity["provider"]["type"]](activity["provider"], ctx)
        record["status"] = "succeeded"
    except InterruptExecution as exc:
        record["status"], record["interrupted"] = "failed", True
        record["exception"] = traceback.format_exception_only(type(exc), exc)
    except Exception as exc:
        record["status"] = "failed"
        record["exception"] = traceback.format_exception_only(type(exc), exc)
        logger.error("activity %r failed: %s", activity.get("name"), redact(str(exc), ctx.secret_values))
    end = datetime.now(UTC)
    record["end"], record["duration"] = end.isoformat(), (end - start).total_seconds()
    redacted: dict[str, Any] = redact(record, ctx.secret_values)
    return redacted


def _fault_ids(output: Any) -> list[int]:
    if not isinstance(output, Mapping):
        return []
    faults = output.get("faults")
    if not isinstance(faults, list):
        return []
    return [int(f["id"]) for f in faults if isinstance(f, Mapping) and isinstance(f.get("id"), int)]


def _ctk_reverter(ctx: Context) -> FaultReverter:
    async def revert(ids: Sequence[int]) -> Sequence[object]:
        from chaos import ctk

        secrets: dict[str, Any] = {}
        for block in ctx.secrets.values():
            secrets.update(block)
        secrets.update(ctx.base_secrets)

        def one(fault_id: int) -> object:
            try:
                return ctk.revert_fault(fault_id, ctx.configuration, secrets)
            except ctk.ControlPlaneError as exc:
                return {"fault_id": fault_id, "ok": False, "detail": str(exc)}

        return [await asyncio.to_thread(one, fid) for fid in ids]

    return revert


def _jsonable(value: object) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return {"result": repr(value)}


def _play_rollbacks(strategy: RollbackStrategy, journal: Journal) -> bool:
    if strategy == "never":
        return False
    if strategy == "deviated":
        return bool(journal["deviated"])
    if strategy == "default":  # Chaos Toolkit's default: not after a failed or interrupted run
        return journal["status"] not in ("failed", "interrupted")
    return True
