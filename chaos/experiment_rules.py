"""Chaos Toolkit's validation rules, rule for rule: what ``chaos run`` accepts, checked without chaoslib.

Where it sits: :func:`chaos.experiment_format.validate_experiment` calls :func:`check_format` (ours, always)
and :func:`chaoslib_problem` (chaostoolkit-lib's own ``ensure_experiment_is_valid``, where it is installed:
it is a dev dependency only), then what our runner refuses on top. The two verdicts agree on the corpus in
``tests/chaos/corpus`` (valid and invalid experiments, each with its reason), which a test runs through
both. Our messages are one line and name the field (``method[2].provider.path``).

The rules (chaostoolkit-lib 1.44): a non-empty object with a ``title`` and a ``description``; ``tags`` and
``extensions`` well formed; ``configuration`` and ``secrets`` loadable (an ``env`` value needs its variable
set, or for configuration a ``default``, and converts to its ``env_var_type``); a ``steady-state-hypothesis``,
when present, has a ``title`` and every probe a valid ``tolerance``; ``method`` is required (it may be
empty); every activity has a type (action or probe), a name and a provider (``python``: an importable
module exposing the function, the arguments fitting its signature; ``process``: an executable ``path``;
``http``: a ``url``), optional ``timeout`` (a number), ``pauses`` (numbers or ``${name}``) and
``background`` (a boolean); a ``ref`` in the method names an activity of the method or the hypothesis;
``controls`` have a name and a provider. Where chaoslib accepts a value only by accident of Python (an
empty string where a list goes) ours refuses it, and a ``jsonpath`` tolerance is refused as chaoslib
refuses it without the optional jsonpath2 package.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from numbers import Number
from typing import Any

from chaos.errors import Refused

__all__ = ["InvalidExperiment", "chaoslib_problem", "check_format", "convert_env_value"]

ACTIVITY_TYPES = ("probe", "action")
PROVIDER_TYPES = ("python", "process", "http")
TOLERANCE_TYPES = ("probe", "regex", "range")  # and "jsonpath", which needs jsonpath2 (see the docstring)
_CHAOSLIB_LOCK = threading.Lock()  # its validator keeps a module-global cache of the activities


class InvalidExperiment(Refused, ValueError):
    """The experiment is malformed; the message names the offending place (``method[1].provider``)."""


# ---- the experiment ------------------------------------------------------------------------------
def check_format(experiment: Any) -> None:
    """Raise InvalidExperiment, naming the field, where chaoslib's ``ensure_experiment_is_valid`` would
    refuse ``experiment``. Imports python providers' modules (and controls') to check them, as it does."""
    if not experiment:
        raise InvalidExperiment("experiment: empty")
    if not isinstance(experiment, Mapping):
        raise InvalidExperiment(f"experiment: must be an object, got {type(experiment).__name__}")
    hypothesis = _check_shapes(experiment)
    for key in ("title", "description"):
        if not experiment.get(key):
            raise InvalidExperiment(f"{key}: required")
    _check_tags(experiment.get("tags"))
    _check_extensions(experiment.get("extensions"))
    _check_configuration(experiment.get("configuration", {}))
    _check_secrets(experiment.get("secrets", {}))
    if hypothesis is not None:
        _check_hypothesis(hypothesis)
    names = _cached_names(experiment)
    for i, activity in enumerate(experiment["method"]):
        check_activity(activity, f"method[{i}]")
        ref = activity.get("ref")
        if ref and ref not in names:
            raise InvalidExperiment(f"method[{i}].ref: no activity named {ref!r} in the method or hypothesis")
    for i, activity in enumerate(_members(experiment.get("rollbacks", []), "rollbacks")):
        check_activity(activity, f"rollbacks[{i}]")
    _check_controls(experiment)


def _check_shapes(experiment: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The shapes chaoslib relies on before its rules (its cache of named activities): ``method`` a list,
    the hypothesis an object, its ``probes`` a list, their items objects with a hashable name."""
    if experiment.get("method") is None:
        raise InvalidExperiment("method: required (an empty list checks the steady state only)")
    if not isinstance(experiment["method"], list):
        raise InvalidExperiment("method: must be a list of activities")
    hypothesis: Mapping[str, Any] | None = experiment.get("steady-state-hypothesis", None)
    if "steady-state-hypothesis" in experiment and not isinstance(hypothesis, Mapping):
        raise InvalidExperiment("steady-state-hypothesis: must be an object")
    pools = [("method", experiment["method"])]
    if hypothesis is not None:
        probes = hypothesis.get("probes", [])
        if not isinstance(probes, list):
            raise InvalidExperiment("steady-state-hypothesis.probes: must be a list of activities")
        pools.append(("steady-state-hypothesis.probes", probes))
    for where, pool in pools:
        for i, activity in enumerate(pool):
            if not isinstance(activity, Mapping):
                raise InvalidExperiment(f"{where}[{i}]: an activity is an object")
            name = activity.get("name")
            if name and not _hashable(name):
                raise InvalidExperiment(f"{where}[{i}].name: must be a string")
    return hypothesis


def _cached_names(experiment: Mapping[str, Any]) -> set[Any]:
    """What a method's ``ref`` may name: activities of the method and the hypothesis (not rollbacks)."""
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    pool = [*experiment["method"], *hypothesis.get("probes", [])]
    return {a.get("name") for a in pool if a.get("name")}


def _check_tags(tags: Any) -> None:
    if tags and any(t == "" or not isinstance(t, str) for t in _members(tags, "tags")):
        raise InvalidExperiment("tags: every tag is a non-empty string")


def _check_extensions(extensions: Any) -> None:
    if not extensions:
        return
    for i, extension in enumerate(_members(extensions, "extensions")):
        name = extension.get("name") if isinstance(extension, Mapping) else None
        if not isinstance(name, str) or not name.strip():
            raise InvalidExperiment(f"extensions[{i}].name: required, a non-empty string")


# ---- configuration and secrets -------------------------------------------------------------------
def _check_configuration(configuration: Any) -> None:
    if not isinstance(configuration, Mapping):
        raise InvalidExperiment("configuration: must be an object")
    for name, value in configuration.items():
        if not (isinstance(value, Mapping) and "type" in value and value["type"] == "env"):
            continue
        where = f"configuration.{name}"
        key = _env_key(value, where)
        if key not in os.environ and "default" not in value:
            raise InvalidExperiment(f"{where}: environment variable {key!r} is not set and has no default")
        try:
            convert_env_value(value.get("env_var_type"), os.environ.get(key, value.get("default")))
        except (TypeError, ValueError, AttributeError) as exc:
            raise InvalidExperiment(f"{where}.env_var_type: {exc}") from exc


def _check_secrets(secrets: Any, where: str = "secrets") -> None:
    """Secrets load as chaoslib loads them: an ``env`` reference (at any depth) needs its variable set (no
    default here); a ``vault`` one is not read at validation. Top-level entries are blocks (objects)."""
    if not isinstance(secrets, Mapping):
        raise InvalidExperiment(f"{where}: must be an object")
    for name, value in secrets.items():
        inner = f"{where}.{name}"
        if where == "secrets" and not isinstance(value, Mapping):
            raise InvalidExperiment(f"{inner}: a block of secrets is an object")
        if not isinstance(value, Mapping) or value.get("type") == "vault":
            continue
        if value.get("type") == "env":
            key = _env_key(value, inner)
            if key not in os.environ:
                raise InvalidExperiment(f"{inner}: environment variable {key!r} is not set")
        else:
            _check_secrets(value, inner)


def _env_key(reference: Mapping[str, Any], where: str) -> str:
    key = reference.get("key")
    if not isinstance(key, str):
        raise InvalidExperiment(f"{where}.key: required, the name of an environment variable")
    return key


def convert_env_value(kind: Any, raw: Any) -> Any:
    """An environment value converted to ``env_var_type`` as chaoslib does (str, int, float, bytes, bool,
    json); TypeError, ValueError or AttributeError when it does not convert."""
    if kind is None or kind in ("str", "string"):
        return raw
    if kind in ("int", "integer"):
        return int(raw)
    if kind in ("float", "number"):
        return float(raw)
    if kind == "bytes":
        return raw.encode("utf-8")
    if kind == "bool":
        return raw if isinstance(raw, bool) else raw.lower() not in ("false", "0", "no")
    if kind == "json":
        return json.loads(raw) if isinstance(raw, str) and raw else raw
    raise ValueError(f"{kind!r} is not one of bool, str, int, float, bytes, json")


# ---- the hypothesis and its tolerances -----------------------------------------------------------
def _check_hypothesis(hypothesis: Mapping[str, Any]) -> None:
    if not hypothesis.get("title"):
        raise InvalidExperiment("steady-state-hypothesis.title: required")
    for i, probe in enumerate(hypothesis.get("probes") or []):
        where = f"steady-state-hypothesis.probes[{i}]"
        check_activity(probe, where)
        if "tolerance" not in probe:
            raise InvalidExperiment(f"{where}.tolerance: required")
        _check_tolerance(probe["tolerance"], f"{where}.tolerance")


def _check_tolerance(tolerance: Any, where: str) -> None:
    if not isinstance(tolerance, (bool, int, list, str, dict)):
        raise InvalidExperiment(f"{where}: an integer, a string, a boolean, a list or an object, "
                                f"got {type(tolerance).__name__}")
    if not isinstance(tolerance, dict):
        return
    kind = tolerance.get("type")
    if kind == "probe":
        check_activity(tolerance, where)
    elif kind == "regex":
        if "pattern" not in tolerance:
            raise InvalidExperiment(f"{where}.pattern: required")
        try:
            re.compile(tolerance["pattern"])
        except (TypeError, re.error) as exc:
            raise InvalidExperiment(f"{where}.pattern: not a regular expression: {exc}") from exc
    elif kind == "range":
        bounds = tolerance.get("range")
        if not isinstance(bounds, list) or len(bounds) != 2 or not all(isinstance(b, Number) for b in bounds):
            raise InvalidExperiment(f"{where}.range: two numbers [low, high]")
    elif kind == "jsonpath":
        raise InvalidExperiment(f"{where}.type: jsonpath tolerances are not supported (chaoslib needs the "
                                "optional jsonpath2 package for them)")
    else:
        raise InvalidExperiment(f"{where}.type: one of {', '.join(TOLERANCE_TYPES)}, got {kind!r}")


# ---- activities ----------------------------------------------------------------------------------
def check_activity(activity: Any, where: str) -> None:
    """chaoslib's ``ensure_activity_is_valid``: a ref, or an action or probe with a valid provider."""
    if not activity or not isinstance(activity, Mapping):
        raise InvalidExperiment(f"{where}: an activity is a non-empty object")
    ref = activity.get("ref")
    if ref is not None:
        if not isinstance(ref, str) or not ref:
            raise InvalidExperiment(f"{where}.ref: a non-empty string")
        return
    if activity.get("type") not in ACTIVITY_TYPES:
        raise InvalidExperiment(f"{where}.type: must be action or probe, got {activity.get('type')!r}")
    if not activity.get("name"):
        raise InvalidExperiment(f"{where}.name: required")
    provider = activity.get("provider")
    if not provider or not isinstance(provider, Mapping):
        raise InvalidExperiment(f"{where}.provider: required, an object")
    if provider.get("type") not in PROVIDER_TYPES:
        raise InvalidExperiment(f"{where}.provider.type: one of {', '.join(PROVIDER_TYPES)}, "
                                f"got {provider.get('type')!r}")
    timeout = activity.get("timeout")
    if timeout is not None and not isinstance(timeout, Number):
        raise InvalidExperiment(f"{where}.timeout: must be a number")
    _check_pauses(activity.get("pauses"), f"{where}.pauses")
    if "background" in activity and not isinstance(activity["background"], bool):
        raise InvalidExperiment(f"{where}.background: must be true or false")
    _PROVIDER_CHECKS[provider["type"]](provider, f"{where}.provider")


def _check_pauses(pauses: Any, where: str) -> None:
    if pauses is None:
        return
    if not isinstance(pauses, Mapping):
        raise InvalidExperiment(f"{where}: must be an object with before/after")
    for key in ("before", "after"):
        value = pauses.get(key)
        if isinstance(value, str) and not (value.startswith("${") and value.endswith("}")):
            raise InvalidExperiment(f"{where}.{key}: a number of seconds or a ${{name}} placeholder")


def _check_python(provider: Mapping[str, Any], where: str) -> None:
    module_name, func_name = provider.get("module"), provider.get("func")
    if not module_name:
        raise InvalidExperiment(f"{where}.module: required")
    if not func_name:
        raise InvalidExperiment(f"{where}.func: required")
    module = _import(module_name, f"{where}.module")
    if module is None:
        raise InvalidExperiment(f"{where}.module: cannot import {module_name!r}")
    members = dict(inspect.getmembers(module, lambda m: inspect.isfunction(m) or inspect.isbuiltin(m)))
    if not isinstance(func_name, str) or func_name not in members:
        raise InvalidExperiment(f"{where}.func: {module_name} has no function {func_name!r}")
    arguments = provider.get("arguments", {})
    if not isinstance(arguments, Mapping):
        raise InvalidExperiment(f"{where}.arguments: must be an object")
    try:
        signature = inspect.signature(members[func_name])
        injected = {k: None for k in ("configuration", "secrets") if k in signature.parameters}
        signature.bind(**{**arguments, **injected})
    except (TypeError, ValueError) as exc:
        raise InvalidExperiment(f"{where}.arguments: do not fit {module_name}.{func_name}: {exc}") from exc


def _check_process(provider: Mapping[str, Any], where: str) -> None:
    path = provider.get("path")
    if not path:
        raise InvalidExperiment(f"{where}.path: required")
    found = shutil.which(path) if isinstance(path, str) else None  # as the runner finds it: no ~ expanded
    if not found:
        tilde = isinstance(path, str) and path.startswith("~")
        hint = " (~ is not expanded: Chaos Toolkit's validation refuses it too)" if tilde else ""
        raise InvalidExperiment(f"{where}.path: {path!r} is not an executable on the PATH{hint}")
    if not os.access(found, os.X_OK):
        raise InvalidExperiment(f"{where}.path: {path!r} is not executable by this user")


def _check_http(provider: Mapping[str, Any], where: str) -> None:
    if not provider.get("url"):
        raise InvalidExperiment(f"{where}.url: required")
    headers = provider.get("headers")
    if headers and not isinstance(headers, dict):
        raise InvalidExperiment(f"{where}.headers: must be an object of names to values")


_PROVIDER_CHECKS: dict[str, Callable[[Mapping[str, Any], str], None]] = {
    "python": _check_python, "process": _check_process, "http": _check_http}


# ---- controls ------------------------------------------------------------------------------------
def _controls(experiment: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every control declared (experiment, hypothesis, each activity), with its place."""
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    places = [("controls", experiment.get("controls", [])),
              ("steady-state-hypothesis.controls", hypothesis.get("controls", []))]
    phases = [("steady-state-hypothesis.probes", hypothesis.get("probes", [])),
              ("method", experiment["method"]), ("rollbacks", experiment.get("rollbacks", []))]
    places += [(f"{phase}[{i}].controls", a.get("controls", []))
               for phase, pool in phases for i, a in enumerate(_members(pool, phase))]
    for where, controls in places:
        for i, control in enumerate(_members(controls, where)):
            yield f"{where}[{i}]", control


def _check_controls(experiment: Mapping[str, Any]) -> None:
    controls = list(_controls(experiment))
    for where, control in controls:
        if not isinstance(control, Mapping):
            raise InvalidExperiment(f"{where}: a control is an object")
    names = [c["name"] for _, c in controls if "ref" not in c and "name" in c]
    for where, control in controls:
        if "ref" in control and control["ref"] not in names:
            raise InvalidExperiment(f"{where}.ref: no control named {control['ref']!r}")
        for key in ("name", "provider"):
            if key not in control:
                raise InvalidExperiment(f"{where}.{key}: required")
        if control.get("scope") and control["scope"] not in ("before", "after"):
            raise InvalidExperiment(f"{where}.scope: before or after")
        provider = control["provider"]
        if not isinstance(provider, Mapping):
            raise InvalidExperiment(f"{where}.provider: must be an object")
        if provider.get("type") == "python":
            _check_python_control(control, provider, f"{where}.provider")


def _check_python_control(control: Mapping[str, Any], provider: Mapping[str, Any], where: str) -> None:
    """A python control's module is imported (a missing one is only a warning to chaoslib) and its own
    ``validate_control``, when it has one, is called, as chaoslib does."""
    if not provider.get("module"):
        raise InvalidExperiment(f"{where}.module: required")
    module = _import(provider["module"], f"{where}.module")
    validate = getattr(module, "validate_control", None) if module is not None else None
    if validate:
        try:
            validate(control)
        except Exception as exc:  # the control's own verdict, whatever it raises
            raise InvalidExperiment(f"{where}: {type(exc).__name__}: {exc}") from exc


# ---- helpers -------------------------------------------------------------------------------------
def _members(value: Any, where: str) -> list[Any]:
    """What iterating ``value`` gives, as chaoslib iterates it (a mapping: its keys); a value that is not
    a collection is refused."""
    if isinstance(value, (list, str, Mapping)):
        return list(value)
    raise InvalidExperiment(f"{where}: must be a list")


def _import(module_name: Any, where: str) -> Any:
    """The module, or None when it is not installed; any other failure to import refuses the experiment."""
    if not isinstance(module_name, str):
        raise InvalidExperiment(f"{where}: must be a module name")
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None
    except Exception as exc:  # the module's own code failed at import
        raise InvalidExperiment(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") \
            from exc


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# ---- chaoslib's own verdict ----------------------------------------------------------------------
def chaoslib_problem(experiment: Any) -> str | None:
    """What chaostoolkit-lib's ``ensure_experiment_is_valid`` says is wrong with ``experiment``, or None
    when it accepts it or is not installed. Its log lines and deprecation warnings are kept out of ours."""
    try:
        from chaoslib.experiment import ensure_experiment_is_valid  # type: ignore[import-untyped]
    except ImportError:
        return None
    with _CHAOSLIB_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chaoslib_log = logging.getLogger("chaostoolkit")
        was_disabled, chaoslib_log.disabled = chaoslib_log.disabled, True
        try:
            ensure_experiment_is_valid(experiment)
        except Exception as exc:  # its own tree (ChaosException) and whatever Python raises on bad shapes
            name = type(exc).__name__
            return str(exc) if name.startswith("Invalid") else f"{name}: {exc}"
        finally:
            chaoslib_log.disabled = was_disabled
    return None
