"""The experiment format (Chaos Toolkit's): loading, validation, tolerances, the plan and the journal.

Where it sits: :mod:`chaos.experiment` (the runner) validates an experiment here before anything runs,
judges steady-state probes with :func:`within_tolerance` and starts its journal with :func:`new_journal`.
The CLI and the REST API load and check experiments through the same functions; ``chaos.experiment``
re-exports them, so ``from chaos.experiment import load_experiment`` keeps working. Nothing here runs an
activity (validation imports python providers' modules to check their functions and arguments).

Format (Chaos Toolkit's): ``title``, ``description``, ``configuration`` (values, or ``{"type": "env",
"key": K, "default": D}``), ``secrets`` (blocks of the same), ``steady-state-hypothesis`` (``probes``, each
with a ``tolerance``: a value, a list (two numbers: a range; else membership), ``{"type": "range",
"range": [a, b]}`` or ``{"type": "regex", "pattern": P}``, both with an optional ``target`` key),
``method`` (actions, probes and ``{"ref": name}``; ``pauses`` ``before``/``after`` in seconds) and
``rollbacks``. Providers: ``python`` (``module``, ``func``, ``arguments``; ``configuration`` and the named
``secrets`` are passed when the function takes them) and ``http`` (``url``, ``method``, ``headers``,
``arguments``, ``timeout``, and our ``expected_status``). ``${name}`` in a string argument is replaced by
the configuration or secret value of that name.

The journal has Chaos Toolkit's keys (``status`` completed/failed/aborted/interrupted, ``deviated``,
``steady_states`` before/after/during, ``run``, ``rollbacks``, ``start``, ``end``, ``duration``) plus
ours: ``dry``, ``fault_ids`` (ids found in activity outputs such as :func:`chaos.ctk.inject_fault`'s),
``stop_condition`` (the trip, or None), ``abort_reverts`` and ``plan``; secret values are never written.
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from numbers import Number
from pathlib import Path
from typing import Any

from chaos.errors import Refused
from chaos.stop_conditions import StopCondition

JOURNAL_FORMAT = "llm-sre-chaos/1 (superset of chaostoolkit journal)"

Experiment = Mapping[str, Any]
Journal = dict[str, Any]


class InvalidExperiment(Refused, ValueError):
    """The experiment is malformed; the message names the offending place (``method[1].provider``)."""


# ---- loading and validating ----------------------------------------------------------------------
def load_experiment(path: str | Path) -> dict[str, Any]:
    """An experiment from a JSON or YAML file; InvalidExperiment when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidExperiment(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml  # type: ignore[import-untyped]

            body = yaml.safe_load(text)
        else:
            body = json.loads(text)
    except Exception as exc:  # json and yaml raise their own error trees
        kind = path.suffix.lstrip(".").upper() or "JSON"
        raise InvalidExperiment(f"{path}: not valid {kind}: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidExperiment(f"{path}: an experiment is an object, got {type(body).__name__}")
    return body


def validate_experiment(experiment: Experiment) -> None:
    """Raise InvalidExperiment naming the first problem; imports python providers to check them."""
    if not isinstance(experiment, Mapping):
        raise InvalidExperiment("experiment: must be an object")
    if not isinstance(experiment.get("title"), str) or not experiment["title"].strip():
        raise InvalidExperiment("title: required")
    method = experiment.get("method")
    if not isinstance(method, list) or not method:
        raise InvalidExperiment("method: required, a non-empty list of activities")
    names = _named_activities(experiment)
    hypothesis = experiment.get("steady-state-hypothesis")
    if hypothesis is not None:
        if not isinstance(hypothesis, Mapping):
            raise InvalidExperiment("steady-state-hypothesis: must be an object")
        for i, probe in enumerate(hypothesis.get("probes") or []):
            where = f"steady-state-hypothesis.probes[{i}]"
            _validate_activity(probe, where, names)
            if probe.get("type") != "probe":
                raise InvalidExperiment(f"{where}.type: must be probe")
            if "tolerance" not in probe:
                raise InvalidExperiment(f"{where}.tolerance: required")
            _validate_tolerance(probe["tolerance"], f"{where}.tolerance")
    for i, activity in enumerate(method):
        _validate_activity(activity, f"method[{i}]", names)
    rollbacks = experiment.get("rollbacks") or []
    if not isinstance(rollbacks, list):
        raise InvalidExperiment("rollbacks: must be a list")
    for i, activity in enumerate(rollbacks):
        _validate_activity(activity, f"rollbacks[{i}]", names)


def check_python_modules(experiment: Experiment, allowed: Iterable[str]) -> None:
    """Refuse python providers outside ``allowed`` (a server runs only its own extension, never any
    importable function a request names)."""
    allowed = tuple(allowed)
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    phases = {"steady-state-hypothesis.probes": hypothesis.get("probes") if isinstance(hypothesis, Mapping)
              else None, "method": experiment.get("method"), "rollbacks": experiment.get("rollbacks")}
    for phase, activities in phases.items():
        for i, activity in enumerate(activities if isinstance(activities, list) else []):
            provider = activity.get("provider") if isinstance(activity, Mapping) else None
            if isinstance(provider, Mapping) and provider.get("type") == "python" \
                    and provider.get("module") not in allowed:
                raise InvalidExperiment(f"{phase}[{i}].provider.module: only {', '.join(allowed)} may run "
                                        f"here, got {provider.get('module')!r}")


def _named_activities(experiment: Experiment) -> dict[str, Mapping[str, Any]]:
    found: dict[str, Mapping[str, Any]] = {}
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    pools = [hypothesis.get("probes") or [] if isinstance(hypothesis, Mapping) else [],
             experiment.get("method") or [], experiment.get("rollbacks") or []]
    for pool in pools:
        for activity in pool if isinstance(pool, list) else []:
            named = isinstance(activity, Mapping) and isinstance(activity.get("name"), str)
            if named and "ref" not in activity:
                found.setdefault(activity["name"], activity)
    return found


def _validate_activity(activity: Any, where: str, names: Mapping[str, Mapping[str, Any]]) -> None:
    if not isinstance(activity, Mapping):
        raise InvalidExperiment(f"{where}: an activity is an object")
    if "ref" in activity:
        if activity["ref"] not in names:
            raise InvalidExperiment(f"{where}.ref: no activity named {activity['ref']!r}")
        return
    if activity.get("type") not in ("action", "probe"):
        raise InvalidExperiment(f"{where}.type: must be action or probe, got {activity.get('type')!r}")
    if not isinstance(activity.get("name"), str) or not activity["name"]:
        raise InvalidExperiment(f"{where}.name: required")
    if activity.get("background"):
        raise InvalidExperiment(f"{where}.background: background activities are not supported here")
    for key, value in (activity.get("pauses") or {}).items():
        if key not in ("before", "after") or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value < 0:
            raise InvalidExperiment(f"{where}.pauses.{key}: must be before/after, a number of seconds >= 0")
    provider = activity.get("provider")
    if not isinstance(provider, Mapping):
        raise InvalidExperiment(f"{where}.provider: required")
    kind = provider.get("type")
    if kind == "python":
        _validate_python(provider, f"{where}.provider")
    elif kind == "http":
        if not isinstance(provider.get("url"), str) or not provider["url"]:
            raise InvalidExperiment(f"{where}.provider.url: required")
        expected = provider.get("expected_status")
        if expected is not None and not isinstance(expected, (int, list)):
            raise InvalidExperiment(f"{where}.provider.expected_status: an integer or a list of them")
    else:
        raise InvalidExperiment(f"{where}.provider.type: must be python or http, got {kind!r}")


def _validate_python(provider: Mapping[str, Any], where: str) -> None:
    module_name, func_name = provider.get("module"), provider.get("func")
    if not isinstance(module_name, str) or not module_name:
        raise InvalidExperiment(f"{where}.module: required")
    if not isinstance(func_name, str) or not func_name:
        raise InvalidExperiment(f"{where}.func: required")
    func = provider_function(module_name, func_name, where)
    arguments = dict(provider.get("arguments") or {})
    sig = inspect.signature(func)
    for injected in ("configuration", "secrets"):
        if injected in sig.parameters:
            arguments[injected] = None
    try:
        sig.bind(**arguments)
    except TypeError as exc:
        raise InvalidExperiment(f"{where}.arguments: do not fit {module_name}.{func_name}: {exc}") from exc


def provider_function(module_name: str, func_name: str, where: str = "provider") -> Callable[..., Any]:
    """The function a python provider names, if an experiment may call it: never a private one
    (``_name``), and for a module that lists its providers in ``PROVIDERS`` (as :mod:`chaos.ctk` does),
    only a listed one. InvalidExperiment names the place otherwise."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidExperiment(f"{where}.module: cannot import {module_name!r}: {exc}") from exc
    listed = getattr(module, "PROVIDERS", None)
    if func_name.startswith("_") or (listed is not None and func_name not in listed):
        offered = f" (it offers {', '.join(listed)})" if listed is not None else ""
        raise InvalidExperiment(f"{where}.func: {module_name}.{func_name} is not a provider function"
                                f"{offered}")
    func: object = getattr(module, func_name, None)
    if not callable(func):
        raise InvalidExperiment(f"{where}.func: {module_name} has no function {func_name!r}")
    return func


def _validate_tolerance(tolerance: Any, where: str) -> None:
    if isinstance(tolerance, (bool, int, float, str)):
        return
    if isinstance(tolerance, list):
        return
    if not isinstance(tolerance, Mapping):
        raise InvalidExperiment(f"{where}: a value, a list, or a range/regex object")
    kind = tolerance.get("type")
    if kind == "range":
        bounds = tolerance.get("range")
        if not isinstance(bounds, list) or len(bounds) != 2 or not all(
                isinstance(b, Number) and not isinstance(b, bool) for b in bounds):
            raise InvalidExperiment(f"{where}.range: two numbers [low, high]")
    elif kind == "regex":
        try:
            re.compile(str(tolerance.get("pattern")))
        except re.error as exc:
            raise InvalidExperiment(f"{where}.pattern: not a regular expression: {exc}") from exc
        if not isinstance(tolerance.get("pattern"), str):
            raise InvalidExperiment(f"{where}.pattern: required")
    else:
        raise InvalidExperiment(f"{where}.type: range or regex supported here, got {kind!r}")


# ---- tolerances ----------------------------------------------------------------------------------
def within_tolerance(tolerance: Any, value: Any) -> bool:
    """Chaos Toolkit's rules: exact values, lists (a two-number range, else membership; an HTTP output is
    judged by its status), and ``range`` / ``regex`` objects with an optional ``target`` key."""
    if isinstance(tolerance, bool):
        return isinstance(value, bool) and value == tolerance
    if isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool):
        if isinstance(value, Mapping) and "status" in value:
            return bool(value["status"] == tolerance)
        return _is_number(value) and float(value) == float(tolerance)
    if isinstance(tolerance, str):
        return bool(value == tolerance)
    if isinstance(tolerance, list):
        if isinstance(value, Mapping) and "status" in value:
            return value["status"] in tolerance
        if len(tolerance) == 2 and all(_is_number(b) for b in tolerance):
            return _is_number(value) and float(tolerance[0]) <= float(value) <= float(tolerance[1])
        return value in tolerance
    if isinstance(tolerance, Mapping):
        target = tolerance.get("target")
        if target and isinstance(value, Mapping):
            value = value.get(target, value)
        if tolerance.get("type") == "range":
            try:
                number = Decimal(str(value)) if _is_number(value) else None
            except InvalidOperation:
                number = None
            low, high = tolerance["range"]
            return number is not None and Decimal(str(low)) <= number <= Decimal(str(high))
        if tolerance.get("type") == "regex":
            text = value if isinstance(value, str) else json.dumps(value)
            return re.search(str(tolerance["pattern"]), text) is not None
    return False


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- the plan and the journal --------------------------------------------------------------------
def plan(experiment: Experiment, stop_conditions: Iterable[StopCondition] = ()) -> list[dict[str, Any]]:
    """What a run would do, in order (phase, name, type, provider, arguments before substitution)."""
    steps = []
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    phases = [("steady-state-before", hypothesis.get("probes") or []),
              ("method", experiment.get("method", [])),
              ("steady-state-after", hypothesis.get("probes") or []),
              ("rollbacks", experiment.get("rollbacks") or [])]
    for phase, activities in phases:
        for activity in activities:
            a = resolve_activity(activity, experiment)
            provider = a.get("provider", {})
            target = f"{provider.get('module')}.{provider.get('func')}" if provider.get("type") == "python" \
                else f"{provider.get('method', 'GET')} {provider.get('url')}"
            steps.append({"phase": phase, "name": a.get("name"), "type": a.get("type"),
                          "provider": f"{provider.get('type')}: {target}",
                          "arguments": provider.get("arguments") or {}, "pauses": a.get("pauses") or {}})
    steps += [{"phase": "stop-condition", "name": c.name, "type": "check", "provider": c.describe(),
               "arguments": {}, "pauses": {}} for c in stop_conditions]
    return steps


def resolve_activity(activity: Mapping[str, Any], experiment: Experiment) -> Mapping[str, Any]:
    """The activity itself, or the one its ``ref`` names."""
    if "ref" in activity:
        return _named_activities(experiment)[activity["ref"]]
    return activity


def num_activities(experiment: Experiment) -> int:
    """How many activities a full run plays (the probes twice: before and after), for progress."""
    probes = len((experiment.get("steady-state-hypothesis") or {}).get("probes") or [])
    return 2 * probes + len(experiment.get("method") or []) + len(experiment.get("rollbacks") or [])


def new_journal(experiment: Experiment, dry: bool, conditions: tuple[StopCondition, ...]) -> Journal:
    """A run's journal before anything ran: status ``completed`` until a phase says otherwise."""
    return {
        "chaoslib-version": None, "format": JOURNAL_FORMAT, "platform": platform.platform(),
        "node": platform.node(), "experiment": _redacted(experiment), "start": now_iso(), "end": None,
        "duration": None, "status": "completed", "deviated": False,
        "steady_states": {"before": None, "after": None, "during": []}, "run": [], "rollbacks": [],
        "dry": dry, "fault_ids": [], "stop_condition": None, "abort_reverts": [],
        "stop_conditions": [c.describe() for c in conditions], "plan": plan(experiment, conditions),
    }


def _redacted(experiment: Experiment) -> dict[str, Any]:
    """The experiment as the journal keeps it: secret values never written, only their names."""
    copy = dict(experiment)
    if isinstance(copy.get("secrets"), Mapping):
        copy["secrets"] = {block: {name: "***" for name in values} if isinstance(values, Mapping) else "***"
                           for block, values in copy["secrets"].items()}
    return copy


def now_iso() -> str:
    return datetime.now(UTC).isoformat()
