"""The experiment format (Chaos Toolkit's): loading, validation, tolerances, the plan and the journal.

Where it sits: :mod:`chaos.experiment` (the runner) validates an experiment here before anything runs,
judges steady-state probes with :func:`within_tolerance` and starts its journal with :func:`new_journal`.
The CLI and the REST API load and check experiments through the same functions; ``chaos.experiment``
re-exports them, so ``from chaos.experiment import load_experiment`` keeps working. Nothing here runs an
activity (validation imports python providers' modules to check their functions and arguments).

Validation has three layers. :func:`validate_experiment`: Chaos Toolkit's own rules
(:mod:`chaos.experiment_rules`, with chaoslib's validator too where it is installed, so ``chaos run`` and
we agree), then :func:`check_runnable`: what this runner refuses although Chaos Toolkit runs it (controls,
dynamic configuration, Vault secrets, shell command lines, functions a module does not list as
providers), each with the reason. :func:`check_python_modules`: what a server refuses to run for
a caller, checked first (python providers outside its own extension, process providers, controls, and
anything read from its environment).

Format (Chaos Toolkit's): ``title``, ``description``, ``configuration`` (values, or ``{"type": "env",
"key": K, "default": D, "env_var_type": T}``), ``secrets`` (blocks of the same), ``steady-state-hypothesis``
(a ``title`` and ``probes``, each with a ``tolerance``: a value, a list (two numbers: a range; else
membership), ``{"type": "range", "range": [a, b]}`` or ``{"type": "regex", "pattern": P}``, both with an
optional ``target`` key, or a probe run with the output as its ``value`` argument; a process one gets it
as its last argument and is met when it exits 0), ``method`` (actions,
probes and ``{"ref": name}``; it may be empty: the steady state is checked alone; ``pauses``
``before``/``after`` in seconds; ``background: true`` runs an activity concurrently) and ``rollbacks``.
Providers: ``python`` (``module``, ``func``, ``arguments``; ``configuration`` and the named ``secrets``
are passed when the function takes them), ``http`` (``url``, ``method``, ``headers``, ``arguments``,
``timeout``, and our ``expected_status``) and ``process`` (``path``, ``arguments`` as a list,
``timeout``). ``${name}`` in a string argument is replaced by the configuration or secret value of that
name.

The journal has Chaos Toolkit's keys (``status`` completed/failed/aborted/interrupted, ``deviated``,
``steady_states`` before/after/during, ``run``, ``rollbacks``, ``start``, ``end``, ``duration``) plus
ours: ``dry``, ``fault_ids`` (ids found in activity outputs such as :func:`chaos.ctk.inject_fault`'s),
``stop_condition`` (the trip, or None), ``abort_reverts`` and ``plan``; secret values are never written.
"""

from __future__ import annotations

import importlib
import json
import platform
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from chaos.experiment_rules import InvalidExperiment as InvalidExperiment  # re-exported: its home before
from chaos.experiment_rules import chaoslib_problem, check_format
from chaos.stop_conditions import StopCondition

JOURNAL_FORMAT = "llm-sre-chaos/1 (superset of chaostoolkit journal)"

Experiment = Mapping[str, Any]
Journal = dict[str, Any]
PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_.-]+)\}")  # ${name}: a configuration or secret value


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
    """Raise InvalidExperiment naming the first problem: Chaos Toolkit's rules (ours, and chaoslib's own
    where it is installed, whose message is reported too), then what this runner refuses on top. A python
    function this runner would never call is named first: that, not its arguments, is what to fix."""
    _check_python_providers(experiment)
    try:
        check_format(experiment)
    except InvalidExperiment as exc:
        theirs = chaoslib_problem(experiment)
        raise InvalidExperiment(f"{exc} (chaoslib: {theirs})" if theirs else str(exc)) from exc
    theirs = chaoslib_problem(experiment)
    if theirs is not None:
        raise InvalidExperiment(f"experiment: refused by chaoslib: {theirs}")
    check_runnable(experiment)


def check_runnable(experiment: Experiment) -> None:
    """What Chaos Toolkit runs but this runner refuses, with the reason (the experiment is valid)."""
    for where, _ in _controls(experiment):
        raise InvalidExperiment(f"{where}: not run by this runner (Chaos Toolkit's `chaos run` runs "
                                "controls)")
    for where, kind in _dynamic_values(experiment):
        raise InvalidExperiment(f"{where}: {_DYNAMIC[kind]} are not supported by this runner")
    names = _named_activities(experiment)
    for where, activity in iter_activities(experiment):
        if "ref" in activity:
            if activity["ref"] not in names:
                raise InvalidExperiment(f"{where}.ref: no activity named {activity['ref']!r}")
            continue
        _check_runnable_activity(activity, where)


def _check_runnable_activity(activity: Mapping[str, Any], where: str) -> None:
    for key, value in (activity.get("pauses") or {}).items():
        placeholder = isinstance(value, str) and PLACEHOLDER.fullmatch(value)
        if not placeholder and (not _is_number(value) or value < 0):
            raise InvalidExperiment(f"{where}.pauses.{key}: a number of seconds >= 0 or a ${{name}}")
    provider = activity["provider"]
    if provider["type"] == "process":
        _check_process_provider(provider, f"{where}.provider")
    elif provider["type"] == "http":
        expected = provider.get("expected_status")
        if expected is not None and not isinstance(expected, (int, list)):
            raise InvalidExperiment(f"{where}.provider.expected_status: an integer or a list of them")


def _check_python_providers(experiment: Experiment) -> None:
    """Every python provider names a function this runner may call (:func:`provider_function`)."""
    for where, activity in iter_activities(experiment):
        provider = activity.get("provider")
        if isinstance(provider, Mapping) and provider.get("type") == "python" \
                and isinstance(provider.get("module"), str) and isinstance(provider.get("func"), str):
            provider_function(provider["module"], provider["func"], f"{where}.provider")


def _check_process_provider(provider: Mapping[str, Any], where: str) -> None:
    arguments = provider.get("arguments", [])
    if isinstance(arguments, str):
        raise InvalidExperiment(f"{where}.arguments: a command line would run through a shell; give the "
                                "arguments as a list")
    if not isinstance(arguments, list) or not all(
            isinstance(a, (str, int, float)) or a is None for a in arguments):
        raise InvalidExperiment(f"{where}.arguments: a list of strings or numbers")
    timeout = provider.get("timeout")
    if timeout is not None and (not _is_number(timeout) or timeout <= 0):
        raise InvalidExperiment(f"{where}.timeout: a number of seconds > 0")


def check_python_modules(experiment: Experiment, allowed: Iterable[str], *,
                         allow_process: bool = False) -> None:
    """What a server refuses to run for a caller, checked before anything else (validation imports modules
    and reads the environment): python providers outside ``allowed`` or not listed there (a server runs
    only its own extension, never any importable function a request names), process providers (local
    commands; unless ``allow_process``), controls, and secrets or configuration read from the server's
    environment or from Vault."""
    allowed = tuple(allowed)
    for where, activity in iter_activities(experiment):
        provider = activity.get("provider")
        if not isinstance(provider, Mapping):
            continue
        if provider.get("type") == "python":
            if provider.get("module") not in allowed:
                raise InvalidExperiment(f"{where}.provider.module: only {', '.join(allowed)} may run "
                                        f"here, got {provider.get('module')!r}")
            provider_function(str(provider["module"]), str(provider.get("func")), f"{where}.provider")
        elif provider.get("type") == "process" and not allow_process:
            raise InvalidExperiment(f"{where}.provider.type: process providers (local commands) do not run "
                                    "here")
    for where, _ in _controls(experiment):
        raise InvalidExperiment(f"{where}: controls do not run here")
    refuse_environment_lookups(experiment)


def refuse_environment_lookups(experiment: Experiment) -> None:
    """Refuse configuration or secrets read from this process's environment (or from Vault, or a probe):
    a server never hands its environment to a request."""
    for where, kind in _dynamic_values(experiment, include_env=True):
        raise InvalidExperiment(f"{where}: {_DYNAMIC[kind]} are not allowed here")


def refuse_process_providers(experiment: Experiment) -> None:
    for where, activity in iter_activities(experiment):
        provider = activity.get("provider")
        if isinstance(provider, Mapping) and provider.get("type") == "process":
            raise InvalidExperiment(f"{where}.provider.type: process providers (local commands) are not "
                                    "allowed here")


def iter_activities(experiment: Experiment) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every activity object with its place: hypothesis probes (and probe tolerances), method, rollbacks."""
    hypothesis = experiment.get("steady-state-hypothesis")
    probes = hypothesis.get("probes") if isinstance(hypothesis, Mapping) else None
    for phase, pool in (("steady-state-hypothesis.probes", probes), ("method", experiment.get("method")),
                        ("rollbacks", experiment.get("rollbacks"))):
        for i, activity in enumerate(pool if isinstance(pool, list) else []):
            if isinstance(activity, Mapping):
                yield f"{phase}[{i}]", activity
                tolerance = activity.get("tolerance")
                if isinstance(tolerance, Mapping) and tolerance.get("type") == "probe":
                    yield f"{phase}[{i}].tolerance", tolerance


def _controls(experiment: Experiment) -> Iterator[tuple[str, Any]]:
    hypothesis = experiment.get("steady-state-hypothesis")
    places: list[tuple[str, Any]] = [("controls", experiment.get("controls"))]
    if isinstance(hypothesis, Mapping):
        places.append(("steady-state-hypothesis.controls", hypothesis.get("controls")))
    places += [(f"{where}.controls", a.get("controls")) for where, a in iter_activities(experiment)]
    for where, controls in places:
        if controls:
            yield where, controls


_DYNAMIC = {"probe": "probes in the configuration (dynamic configuration)", "vault": "Vault secrets",
            "env-block": "secrets blocks read whole from one environment variable",
            "env": "environment lookups"}


def _dynamic_values(experiment: Experiment, *, include_env: bool = False) -> Iterator[tuple[str, str]]:
    """Configuration and secrets read from elsewhere, as (place, kind of ``_DYNAMIC``): a probe, Vault, a
    whole secrets block from one environment variable, and with ``include_env`` every environment lookup,
    at any depth (chaoslib loads secrets nested at any depth, and validation reads their variables)."""
    configuration = experiment.get("configuration")
    for name, value in (configuration.items() if isinstance(configuration, Mapping) else ()):
        kind = value.get("type") if isinstance(value, Mapping) else None
        if kind == "probe" or (include_env and kind == "env"):
            yield f"configuration.{name}", str(kind)
        elif include_env:
            yield from _nested_lookups(value, f"configuration.{name}", frozenset({"env"}))
    secrets = experiment.get("secrets")
    for block, values in (secrets.items() if isinstance(secrets, Mapping) else ()):
        kind = values.get("type") if isinstance(values, Mapping) else None
        if kind in ("env", "vault"):
            yield f"secrets.{block}", "env-block" if kind == "env" else "vault"
            continue
        yield from _nested_lookups(values, f"secrets.{block}",
                                   frozenset({"vault", "env"} if include_env else {"vault"}))


def _nested_lookups(value: Any, where: str, kinds: frozenset[str]) -> Iterator[tuple[str, str]]:
    """The references of ``kinds`` inside ``value`` (an object), at any depth, with their places."""
    for name, inner in (value.items() if isinstance(value, Mapping) else ()):
        kind = inner.get("type") if isinstance(inner, Mapping) else None
        if kind in kinds:
            yield f"{where}.{name}", str(kind)
        elif kind not in ("env", "vault"):  # another kind of reference is read whole, never looked into
            yield from _nested_lookups(inner, f"{where}.{name}", kinds)


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


def provider_function(module_name: str, func_name: str, where: str = "provider") -> Callable[..., Any]:
    """The function a python provider names, if an experiment may call it: never a private one
    (``_name``), and for a module that lists its providers in ``PROVIDERS`` (as :mod:`chaos.ctk` does),
    only a listed one. InvalidExperiment names the place otherwise."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # not installed, or its own code failed at import
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
            steps.append({"phase": phase, "name": a.get("name"), "type": a.get("type"),
                          "provider": f"{provider.get('type')}: {_target(provider)}",
                          "arguments": provider.get("arguments") or {}, "pauses": a.get("pauses") or {},
                          "background": bool(a.get("background"))})
    steps += [{"phase": "stop-condition", "name": c.name, "type": "check", "provider": c.describe(),
               "arguments": {}, "pauses": {}} for c in stop_conditions]
    return steps


def _target(provider: Mapping[str, Any]) -> str:
    if provider.get("type") == "python":
        return f"{provider.get('module')}.{provider.get('func')}"
    if provider.get("type") == "process":
        return str(provider.get("path"))
    return f"{provider.get('method', 'GET')} {provider.get('url')}"


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
