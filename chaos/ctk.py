"""A Chaos Toolkit extension: actions and probes that drive this control plane over its REST API.

Use it from an experiment with a python provider (``"module": "chaos.ctk"``), under Chaos Toolkit's own
``chaos run`` or under our native runner (:mod:`chaos.experiment`). Every function talks HTTP with httpx
(chaos never imports the control plane's client). Where to go, and with what token:

- ``controlplane_url``: the experiment's ``configuration`` (else ``$CONTROLPLANE_URL``, else
  ``http://127.0.0.1:8080``);
- ``controlplane_token``: a ``secrets`` block the provider names (``"secrets": ["controlplane"]``), else
  the configuration, else ``$CONTROLPLANE_TOKEN``. The token is never logged or put in an output, and
  goes only to the control plane's URL: every call is a path on it, checked before anything is sent.

A refused or failed call raises :class:`ControlPlaneError` with the server's message (Chaos Toolkit turns
it into a failed activity with that message).

Actions: :func:`inject_fault`, :func:`revert_fault`, :func:`revert_active_faults`, :func:`halt_all`,
:func:`release`, :func:`scale`. Probes: :func:`ready_replicas`, :func:`wait_for_ready_replicas`,
:func:`fleet_summary`, :func:`error_rate`, :func:`p99_ttft`, :func:`active_faults`. These, listed in
:data:`PROVIDERS`, are the only functions an experiment may call here (the runner refuses any other).
:func:`discover` lists them for ``chaos discover --no-install chaos.ctk`` (built with chaoslib's own
discovery helpers, so it needs chaostoolkit installed; nothing else here does).
"""

from __future__ import annotations

import logging
import os
import time
import types
import typing
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import httpx

from chaos.errors import ChaosError

__all__ = [
    "ControlPlaneError", "active_faults", "error_rate", "fleet_summary", "halt_all", "inject_fault",
    "p99_ttft", "ready_replicas", "release", "revert_active_faults", "revert_fault", "scale",
    "wait_for_ready_replicas",
]

ACTIONS = ("inject_fault", "revert_fault", "revert_active_faults", "halt_all", "release", "scale")
PROBES = ("ready_replicas", "wait_for_ready_replicas", "fleet_summary", "error_rate", "p99_ttft",
          "active_faults")
PROVIDERS = ACTIONS + PROBES  # what an experiment may call in this module (chaos.experiment enforces it)

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-sre-controlplane"  # the package this extension ships in (its version is discovered)
DEFAULT_URL = "http://127.0.0.1:8080"
URL_KEY, TOKEN_KEY = "controlplane_url", "controlplane_token"
URL_ENV, TOKEN_ENV = "CONTROLPLANE_URL", "CONTROLPLANE_TOKEN"
TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.5

Configuration = Mapping[str, Any] | None
Secrets = Mapping[str, Any] | None


class ControlPlaneError(ChaosError):
    """A refused or failed API call; ``status`` is None when the control plane could not be reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# ---- actions -------------------------------------------------------------------------------------
def inject_fault(kind: str, duration_s: float = 30.0, selector: str = "COUNT(1)",
                 zones: list[str] | None = None, replicas: list[str] | None = None,
                 params: dict[str, Any] | None = None, allow_all: bool = False, dry_run: bool = False,
                 configuration: Configuration = None, secrets: Secrets = None) -> dict[str, Any]:
    """Inject a fault; returns the API's answer (``plan`` and ``faults`` with their ids).

    Raises when the plan was refused or when any target could not be faulted.
    """
    body = {"kind": kind, "duration_s": duration_s, "selector": selector, "zones": list(zones or []),
            "replicas": list(replicas or []), "params": dict(params or {}), "allow_all": allow_all,
            "dry_run": dry_run}
    result = dict(_call("POST", "/api/v1/chaos/faults", configuration, secrets, json=body))
    failed = [f for f in result.get("faults", []) if f.get("error")]
    if failed:
        raise ControlPlaneError(f"{kind}: {len(failed)} target(s) not faulted: "
                                + "; ".join(f"{f['target']}: {f['error']}" for f in failed))
    return result


def revert_fault(fault_id: int, configuration: Configuration = None,
                 secrets: Secrets = None) -> dict[str, Any]:
    """Revert one fault by its id; raises when the revert failed."""
    result = dict(_call("DELETE", f"/api/v1/chaos/faults/{int(fault_id)}", configuration, secrets))
    if not result.get("ok", False):
        raise ControlPlaneError(f"fault {fault_id}: revert failed: {result.get('detail')}")
    return result


def revert_active_faults(kind: str | None = None, configuration: Configuration = None,
                         secrets: Secrets = None) -> list[int]:
    """Revert every active fault (of ``kind`` when given): the usual rollback. Returns the ids reverted."""
    ids = [int(f["id"]) for f in active_faults(configuration, secrets)
           if f.get("id") is not None and (kind is None or f.get("kind") == kind)]
    for fault_id in ids:
        revert_fault(fault_id, configuration, secrets)
    return ids


def halt_all(release_after: bool = False, configuration: Configuration = None,
             secrets: Secrets = None) -> dict[str, Any]:
    """Revert every active fault and refuse new ones (until :func:`release`, or at once with
    ``release_after``)."""
    result = dict(_call("POST", "/api/v1/chaos/halt", configuration, secrets))
    if release_after:
        result["halted"] = release(configuration, secrets)["halted"]
    if result.get("failed"):
        raise ControlPlaneError(f"halt: reverts failed: {result['failed']}")
    return result


def release(configuration: Configuration = None, secrets: Secrets = None) -> dict[str, Any]:
    """Accept new faults again after a halt."""
    return dict(_call("POST", "/api/v1/chaos/release", configuration, secrets))


def scale(replicas: int, configuration: Configuration = None, secrets: Secrets = None) -> dict[str, Any]:
    """Set the desired number of replicas."""
    body = {"replicas": int(replicas)}
    return dict(_call("POST", "/api/v1/fleet/scale", configuration, secrets, json=body))


# ---- probes --------------------------------------------------------------------------------------
def ready_replicas(configuration: Configuration = None, secrets: Secrets = None) -> int:
    """How many replicas are ready now."""
    return int(_call("GET", "/api/v1/fleet", configuration, secrets)["ready_replicas"])


def wait_for_ready_replicas(at_least: int, timeout_s: float = 60.0, configuration: Configuration = None,
                            secrets: Secrets = None) -> int:
    """The number of ready replicas once it reaches ``at_least``, or the last count after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = ready_replicas(configuration, secrets)
        if count >= at_least or time.monotonic() >= deadline:
            return count
        time.sleep(POLL_INTERVAL_S)


def fleet_summary(scope: str = "fleet", configuration: Configuration = None,
                  secrets: Secrets = None) -> dict[str, Any]:
    """The metric summary (qps, error rate, TTFT/TPOT/E2E quantiles, ...) of ``fleet``, ``zone:X`` or
    ``replica:ID``."""
    return dict(_call("GET", "/api/v1/metrics/summary", configuration, secrets, params={"scope": scope}))


def error_rate(scope: str = "fleet", configuration: Configuration = None,
               secrets: Secrets = None) -> float | None:
    """The share of inference requests answered 5xx (None: no data)."""
    value = fleet_summary(scope, configuration, secrets).get("error_rate")
    return None if value is None else float(value)


def p99_ttft(scope: str = "fleet", configuration: Configuration = None,
             secrets: Secrets = None) -> float | None:
    """P99 time to first token in seconds (None: no data)."""
    value = (fleet_summary(scope, configuration, secrets).get("ttft") or {}).get("p99")
    return None if value is None else float(value)


def active_faults(configuration: Configuration = None, secrets: Secrets = None) -> list[dict[str, Any]]:
    """The faults active now (id, kind, target, remaining_s)."""
    return list(_call("GET", "/api/v1/chaos/faults", configuration, secrets))


# ---- discovery -----------------------------------------------------------------------------------
def discover(discover_system: bool = True) -> dict[str, Any]:
    """What ``chaos discover chaos.ctk`` writes: this extension's actions and probes with their arguments,
    types and docs, from chaoslib's discovery helpers. There is no system to discover (the control plane
    is reached at run time), so ``system`` stays None either way."""
    from chaoslib.discovery.discover import (  # type: ignore[import-untyped]
        discover_actions,
        discover_probes,
        initialize_discovery_result,
        portable_type_name,
    )

    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = "unknown"
    discovery: dict[str, Any] = initialize_discovery_result(__name__, version, "llm-sre")
    found = [*discover_actions(__name__), *discover_probes(__name__)]
    listed = {"action": ACTIONS, "probe": PROBES}
    activities = [a for a in found if a["name"] in listed[a["type"]]]  # chaoslib lists every function twice
    for activity in activities:
        _resolve_types(activity, portable_type_name)
    discovery["activities"] = sorted(activities, key=lambda a: (a["type"], PROVIDERS.index(a["name"])))
    logger.debug("discovered %d activities (system: %s)", len(activities), discover_system)
    return discovery


def _resolve_types(activity: dict[str, Any], portable: Callable[[Any], str]) -> None:
    """Argument and return types from the evaluated annotations (this module's are strings, which chaoslib
    reads as ``object``): ``X | None`` is X, ``dict[...]`` a mapping, ``list[...]`` a list."""
    hints = typing.get_type_hints(globals()[activity["name"]])
    for argument in activity["arguments"]:
        if argument["name"] in hints:
            argument["type"] = portable(_plain(hints[argument["name"]]))
    if "return" in hints:
        activity["return_type"] = portable(_plain(hints["return"]))


def _plain(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return _plain(args[0]) if len(args) == 1 else hint
    origin = typing.get_origin(hint)
    return {Mapping: dict}.get(origin, origin) if origin is not None else hint


# ---- transport -----------------------------------------------------------------------------------
def _settings(configuration: Configuration = None, secrets: Secrets = None) -> tuple[str, str | None]:
    """The control plane's URL and token from the experiment's configuration and secrets, else the env."""
    config, flat = dict(configuration or {}), _flatten(secrets)
    url = str(config.get(URL_KEY) or os.environ.get(URL_ENV) or DEFAULT_URL)
    token = flat.get(TOKEN_KEY) or config.get(TOKEN_KEY) or os.environ.get(TOKEN_ENV)
    return url.rstrip("/"), None if token is None else str(token)


def _flatten(secrets: Secrets) -> dict[str, Any]:
    """Chaos Toolkit passes the named secret blocks merged; a whole secrets mapping nests them by block."""
    flat: dict[str, Any] = {}
    for key, value in (secrets or {}).items():
        if isinstance(value, Mapping):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _call(method: str, path: str, configuration: Configuration, secrets: Secrets, **kwargs: Any) -> Any:
    url, token = _settings(configuration, secrets)
    target = _on_control_plane(url, path)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(timeout=TIMEOUT_S, trust_env=False, follow_redirects=False) as http:
            response = http.request(method, target, headers=headers, **kwargs)
    except httpx.HTTPError as exc:
        raise ControlPlaneError(f"cannot reach the control plane at {url}: {exc}") from exc
    if response.status_code >= 400:
        raise ControlPlaneError(f"{method} {path}: HTTP {response.status_code}: {_message(response)}",
                                status=response.status_code)
    logger.debug("%s %s -> %d", method, path, response.status_code)
    return response.json()


def _on_control_plane(base: str, path: str) -> httpx.URL:
    """``path`` on the control plane at ``base``: an absolute URL, a scheme-relative ``//host`` or anything
    that would leave ``base``'s scheme, host and port is refused (the token goes with every call)."""
    if not path.startswith("/") or path.startswith("//") or "\\" in path:
        raise ControlPlaneError(f"{path!r}: not a path on the control plane")
    try:
        root, target = httpx.URL(base), httpx.URL(base + path)
    except httpx.InvalidURL as exc:
        raise ControlPlaneError(f"{base}{path}: not a valid URL: {exc}") from exc
    if (target.scheme, target.host, target.port) != (root.scheme, root.host, root.port) \
            or root.scheme not in ("http", "https"):
        raise ControlPlaneError(f"{path!r}: would leave the control plane at {base}")
    return target


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or response.text[:200])
