"""A native runner for experiments in Chaos Toolkit's format, writing a superset of its journal.

Where it sits: the CLI (``controlplane chaos run``) and the REST API run experiments through it; the
actions and probes usually come from :mod:`chaos.ctk`, which drives the control plane over HTTP. The
format itself (loading, validation, tolerances, the plan and the journal's keys) is described and checked
in :mod:`chaos.experiment_format`; its public names are re-exported here. This module resolves the
configuration and secrets, runs the providers and plays the phases.

A run: steady state before (not met: ``failed``, method skipped) -> method, while the stop conditions are
checked every ``check_interval_s`` (a trip: ``aborted``, the faults the run injected so far are reverted
at once) -> steady state after (not met: ``failed`` and ``deviated``) -> rollbacks (by default always).
A failed activity is a record in the journal (status, exception), never an exception out of the run.

What a run may reach, when a server runs it for a caller: python providers only from the modules the
server allows and only the functions those modules list (:func:`~chaos.experiment_format.provider_function`);
``http`` providers only to the hosts of an ``egress`` allow-list (:class:`~chaos.egress.HostAllowList`),
without following redirects, keeping at most ``MAX_HTTP_BODY_BYTES`` of each answer. Secret values (the
experiment's and the caller's own token) are redacted as Chaos Toolkit does: any string equal to one, or
holding one, is written ``***`` in activity outputs, exceptions, the journal and the log.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import re
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
    load_experiment,
    new_journal,
    now_iso,
    num_activities,
    plan,
    provider_function,
    resolve_activity,
    validate_experiment,
    within_tolerance,
)
from chaos.stop_conditions import StopCondition, StopMonitor, StopTrip

__all__ = [
    "JOURNAL_FORMAT", "ActivityFailed", "Context", "Experiment", "ExperimentRunner", "InterruptExecution",
    "InvalidExperiment", "Journal", "check_python_modules", "load_experiment", "plan", "redact",
    "resolve_secrets", "resolve_values", "run_experiment", "run_http", "run_python", "substitute",
    "validate_experiment", "within_tolerance",
]

logger = logging.getLogger(__name__)

RollbackStrategy = Literal["always", "never", "deviated", "default"]
ROLLBACK_STRATEGIES = ("always", "never", "deviated", "default")
DEFAULT_HTTP_TIMEOUT_S = 30.0
MAX_HTTP_BODY_BYTES = 64 * 1024  # of an http provider's answer, kept in the journal (the rest is cut)
REDACTED = "***"
MIN_SECRET_CHARS = 4  # shorter secrets are redacted where a whole value equals them, not inside strings
ABORT_DRAIN_S = 30.0  # how long an aborted run waits for the activity in flight (its fault ids)
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_.-]+)\}")

Progress = Callable[[int, int, str], None]
FaultReverter = Callable[[Sequence[int]], Awaitable[Sequence[object]]]


class ActivityFailed(Exception):
    """An activity did not succeed (a provider error, an unexpected HTTP status)."""


class InterruptExecution(Exception):
    """Raised by an activity to stop the run at once (journal status ``interrupted``)."""


# ---- configuration and secrets -------------------------------------------------------------------
def resolve_values(block: Mapping[str, Any] | None, where: str, *, allow_env: bool = True) -> dict[str, Any]:
    """Configuration values, with ``{"type": "env", "key": K[, "default": D]}`` read from the environment
    (refused with ``allow_env=False``: a server never hands its environment to a request)."""
    out: dict[str, Any] = {}
    for name, value in (block or {}).items():
        if isinstance(value, Mapping) and value.get("type") == "env" and not allow_env:
            raise InvalidExperiment(f"{where}.{name}: environment lookups are not allowed here")
        if isinstance(value, Mapping) and value.get("type") == "env":
            key = str(value.get("key", ""))
            if key in os.environ:
                out[name] = os.environ[key]
            elif "default" in value:
                out[name] = value["default"]
            else:
                raise InvalidExperiment(f"{where}.{name}: environment variable {key!r} is not set")
        else:
            out[name] = value
    return out


def resolve_secrets(block: Mapping[str, Any] | None, *, allow_env: bool = True) -> dict[str, dict[str, Any]]:
    return {name: resolve_values(values, f"secrets.{name}", allow_env=allow_env)
            for name, values in (block or {}).items() if isinstance(values, Mapping)}


def substitute(value: Any, names: Mapping[str, Any]) -> Any:
    """``${name}`` placeholders replaced in strings, recursively; a string that is one placeholder keeps
    the value's type."""
    if isinstance(value, str):
        whole = _PLACEHOLDER.fullmatch(value)
        if whole and whole[1] in names:
            return names[whole[1]]
        return _PLACEHOLDER.sub(lambda m: str(names.get(m[1], m[0])), value)
    if isinstance(value, list):
        return [substitute(v, names) for v in value]
    if isinstance(value, Mapping):
        return {k: substitute(v, names) for k, v in value.items()}
    return value


def redact(value: Any, secrets: Iterable[str]) -> Any:
    """``value`` with every secret written ``***``: a string equal to one, and one inside a longer string
    (secrets of ``MIN_SECRET_CHARS`` or more); recursively through lists and mappings, keys included."""
    values = sorted({s for s in secrets if s}, key=len, reverse=True)
    if not values:
        return value
    return _redact(value, frozenset(values), [s for s in values if len(s) >= MIN_SECRET_CHARS])


def _redact(value: Any, whole: frozenset[str], inner: list[str]) -> Any:
    if isinstance(value, str):
        if value in whole:
            return REDACTED
        for secret in inner:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, Mapping):
        return {_redact(k, whole, inner): _redact(v, whole, inner) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v, whole, inner) for v in value]
    return value


# ---- providers -----------------------------------------------------------------------------------
@dataclass(slots=True)
class Context:
    """What activities run with; ``base_secrets`` go to every python function taking ``secrets`` and win
    over the experiment's (the caller's own credentials when a server runs it); never journaled.
    ``egress`` limits where http providers go (None: anywhere, for a run on the operator's own machine)."""

    configuration: dict[str, Any]
    secrets: dict[str, dict[str, Any]]
    transport: httpx.BaseTransport | None = None
    base_secrets: dict[str, Any] = field(default_factory=dict)
    egress: HostAllowList | None = None

    @property
    def names(self) -> dict[str, Any]:
        merged = dict(self.configuration)
        for block in self.secrets.values():
            merged.update(block)
        return merged

    @property
    def secret_values(self) -> list[str]:
        """Every secret value as text: what :func:`redact` hides."""
        values = [*self.base_secrets.values(), *(v for b in self.secrets.values() for v in b.values())]
        return [str(v) for v in values if isinstance(v, (str, int, float)) and not isinstance(v, bool)]


def run_python(provider: Mapping[str, Any], ctx: Context) -> Any:
    func = provider_function(str(provider["module"]), str(provider["func"]))
    arguments = substitute(dict(provider.get("arguments") or {}), ctx.names)
    params = inspect.signature(func).parameters
    if "configuration" in params:
        arguments["configuration"] = dict(ctx.configuration)
    if "secrets" in params:
        merged: dict[str, Any] = {}
        for block in provider.get("secrets") or []:
            merged.update(ctx.secrets.get(block, {}))
        arguments["secrets"] = {**merged, **ctx.base_secrets}
    return func(**arguments)


def run_http(provider: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    url = str(substitute(provider["url"], ctx.names))
    method = str(provider.get("method", "GET")).upper()
    headers = {str(k): str(v) for k, v in substitute(dict(provider.get("headers") or {}), ctx.names).items()}
    arguments = substitute(provider.get("arguments"), ctx.names)
    timeout = provider.get("timeout", DEFAULT_HTTP_TIMEOUT_S)
    timeout = httpx.Timeout(timeout[1], connect=timeout[0]) if isinstance(timeout, list) else float(timeout)
    kwargs: dict[str, Any] = {"headers": headers}
    if arguments is not None:
        kwargs["params" if method == "GET" else "json"] = arguments
    refusal = ctx.egress.refusal(url) if ctx.egress is not None else None
    if refusal is not None:
        raise ActivityFailed(f"{method} {url}: refused: {refusal}")
    try:
        with httpx.Client(timeout=timeout, trust_env=False, transport=ctx.transport, follow_redirects=False,
                          verify=bool(provider.get("verify_tls", True))) as http, \
                http.stream(method, url, **kwargs) as response:
            raw, truncated = _read_bounded(response, MAX_HTTP_BODY_BYTES)
    except httpx.HTTPError as exc:
        raise ActivityFailed(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
    output = {"status": response.status_code, "headers": dict(response.headers),
              "body": _body(raw, truncated, response.encoding or "utf-8")}
    if truncated:
        output["truncated"] = True  # the body holds the first MAX_HTTP_BODY_BYTES bytes only
    expected = provider.get("expected_status")
    if expected is not None:
        allowed = expected if isinstance(expected, list) else [expected]
        if response.status_code not in allowed:
            raise ActivityFailed(f"{method} {url}: HTTP {response.status_code}, expected {allowed}")
    return output


def _read_bounded(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of the body (and whether there was more): a huge answer is never held."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks)[:limit], True
    return b"".join(chunks), False


def _body(raw: bytes, truncated: bool, encoding: str) -> Any:
    text = raw.decode(encoding, errors="replace")
    if truncated:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


PROVIDERS: dict[str, Callable[[Mapping[str, Any], Context], Any]] = {"python": run_python, "http": run_http}


# ---- the runner ----------------------------------------------------------------------------------
@dataclass(slots=True)
class _State:
    journal: Journal
    ctx: Context
    fault_ids: list[int] = field(default_factory=list)
    in_flight: asyncio.Future[dict[str, Any]] | None = None
    done: int = 0
    total: int = 0


class ExperimentRunner:
    """Runs experiments natively. Time (pauses, stop-condition checks) is on ``clock``; ``revert_faults``
    undoes fault ids when a stop condition aborts (default: through :mod:`chaos.ctk`)."""

    def __init__(self, *, clock: Clock | None = None, http_transport: httpx.BaseTransport | None = None,
                 revert_faults: FaultReverter | None = None, progress: Progress | None = None,
                 base_configuration: Mapping[str, Any] | None = None,
                 base_secrets: Mapping[str, Any] | None = None, allow_env: bool = True,
                 egress: HostAllowList | None = None) -> None:
        self._clock: Clock = clock or MonotonicClock()
        self._transport = http_transport
        self._revert_faults = revert_faults
        self._progress = progress
        self._base_configuration = dict(base_configuration or {})
        self._base_secrets = dict(base_secrets or {})
        self._allow_env = allow_env
        self._egress = egress

    async def run(self, experiment: Experiment, *, dry_run: bool = False,
                  stop_conditions: Iterable[StopCondition] = (), check_interval_s: float = 1.0,
                  rollback_strategy: RollbackStrategy = "always") -> Journal:
        """Run (or with ``dry_run`` only walk) ``experiment``; InvalidExperiment before anything runs."""
        if rollback_strategy not in ROLLBACK_STRATEGIES:
            raise InvalidExperiment(f"rollback_strategy: one of {', '.join(ROLLBACK_STRATEGIES)}")
        validate_experiment(experiment)
        conditions = tuple(stop_conditions)
        configuration = {**resolve_values(experiment.get("configuration"), "configuration",
                                          allow_env=self._allow_env),
                         **self._base_configuration}  # the server's own values win, as its secrets do
        secrets = resolve_secrets(experiment.get("secrets"), allow_env=self._allow_env)
        ctx = Context(configuration, secrets, self._transport, dict(self._base_secrets), self._egress)
        state = _State(new_journal(experiment, dry_run, conditions), ctx)
        state.total = num_activities(experiment)
        started = time.monotonic()
        logger.info("experiment %r: started%s", experiment["title"], " (dry run)" if dry_run else "")
        try:
            await self._phases(experiment, state, dry_run, conditions, check_interval_s, rollback_strategy)
        finally:
            journal: Journal = redact(state.journal, ctx.secret_values)
            journal["end"] = now_iso()
            journal["duration"] = round(time.monotonic() - started, 3)
            journal["fault_ids"] = sorted(set(state.fault_ids))
            logger.info("experiment %r: %s (deviated=%s) in %.1fs", experiment["title"], journal["status"],
                        journal["deviated"], journal["duration"])
        return journal

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
            for activity in experiment.get("rollbacks") or []:
                journal["rollbacks"].append(await self._activity(activity, experiment, state, dry))

    async def _hypothesis(self, experiment: Experiment, state: _State, dry: bool,
                          when: str) -> dict[str, Any] | None:
        hypothesis = experiment.get("steady-state-hypothesis")
        if not hypothesis:
            return None
        result: dict[str, Any] = {"steady_state_met": True, "probes": []}
        state.journal["steady_states"][when] = result
        for probe in hypothesis.get("probes") or []:
            record = await self._activity(probe, experiment, state, dry)
            met = dry or (record["status"] == "succeeded"
                          and within_tolerance(resolve_activity(probe, experiment)["tolerance"],
                                               record["output"]))
            record["tolerance_met"] = met
            result["probes"].append(record)
            if not met:
                result["steady_state_met"] = False
                name = probe.get("name", probe.get("ref"))
                logger.warning("experiment %r: steady state %s not met: probe %r gave %r",
                               experiment["title"], when, name, record["output"])
                break
        return result

    async def _guarded_method(self, experiment: Experiment, state: _State, dry: bool,
                              conditions: tuple[StopCondition, ...], interval_s: float) -> StopTrip | None:
        method = self._method(experiment, state, dry)
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

    async def _method(self, experiment: Experiment, state: _State, dry: bool) -> None:
        for activity in experiment["method"]:
            state.journal["run"].append(await self._activity(activity, experiment, state, dry))

    async def _abort(self, state: _State) -> list[dict[str, Any]]:
        """After a trip: let the activity in flight finish (its faults count), then revert every fault."""
        if state.in_flight is not None and not state.in_flight.done():
            done, _ = await asyncio.wait({state.in_flight}, timeout=ABORT_DRAIN_S)
            if done:
                record = state.in_flight.result()
                state.journal["run"].append(record)
                state.fault_ids += _fault_ids(record.get("output"))  # it finished after the trip
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
                        dry: bool) -> dict[str, Any]:
        resolved = resolve_activity(activity, experiment)
        pauses = resolved.get("pauses") or {}
        if not dry and pauses.get("before"):
            await self._clock.sleep(float(pauses["before"]))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.run_in_executor(
            None, _execute, resolved, state.ctx, dry)
        state.in_flight = future
        record = await asyncio.shield(future)
        state.in_flight = None
        state.fault_ids += _fault_ids(record.get("output"))
        state.done += 1
        if self._progress is not None:
            self._progress(state.done, state.total, str(resolved.get("name")))
        if record.get("interrupted"):
            raise InterruptExecution(record.get("exception", [""])[-1].strip())
        if not dry and pauses.get("after"):
            await self._clock.sleep(float(pauses["after"]))
        return record


def run_experiment(experiment: Experiment, **kwargs: Any) -> Journal:
    """Synchronous wrapper: ``ExperimentRunner().run(experiment, **kwargs)`` on a fresh event loop."""
    runner_keys = {"clock", "http_transport", "revert_faults", "progress", "base_configuration",
                   "base_secrets", "allow_env", "egress"}
    runner = ExperimentRunner(**{k: v for k, v in kwargs.items() if k in runner_keys})
    return asyncio.run(runner.run(experiment, **{k: v for k, v in kwargs.items() if k not in runner_keys}))


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
