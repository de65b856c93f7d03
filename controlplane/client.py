"""A typed client of the control plane's REST API, used by the CLI and the console.

HTTP and transport errors become :class:`ApiError` here, in one place, with the server's message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"
TOKEN_ENV = "CONTROLPLANE_TOKEN"


class ApiError(Exception):
    """A refused or failed API call; ``status`` is None when the server could not be reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True, frozen=True)
class ReplicaView:
    replica_id: str
    zone: str
    url: str
    state: str
    model: str
    pid: int | None
    generation: int


@dataclass(slots=True, frozen=True)
class FleetView:
    desired_replicas: int
    ready_replicas: int
    model: str
    generation: int
    zones: list[str]
    rollout: dict[str, Any] | None
    replicas: list[ReplicaView]


class ControlPlaneClient:
    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        token = token or os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout, trust_env=False,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- fleet ---------------------------------------------------------------------------------
    def fleet(self) -> FleetView:
        raw = self._call("GET", "/api/v1/fleet")
        replicas = [ReplicaView(**r) for r in raw.pop("replicas")]
        return FleetView(replicas=replicas, **raw)

    def scale(self, replicas: int) -> None:
        self._call("POST", "/api/v1/fleet/scale", json={"replicas": replicas})

    def restart(self, replica_id: str) -> None:
        self._call("POST", f"/api/v1/fleet/replicas/{replica_id}/restart")

    def rollout(self, model: str) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/fleet/rollout", json={"model": model}))

    # ---- observability -------------------------------------------------------------------------
    def events(self, *, since_id: int = 0, kind: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"since_id": since_id, "limit": limit}
        if kind:
            params["kind"] = kind
        return list(self._call("GET", "/api/v1/events", params=params))

    def summary(self, scope: str = "fleet") -> dict[str, Any]:
        return dict(self._call("GET", "/api/v1/metrics/summary", params={"scope": scope}))

    def slow_traces(self, limit: int = 50) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/traces/slow", params={"limit": limit}))

    def audit(self, limit: int = 200) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/audit", params={"limit": limit}))

    def issue_token(self, name: str, role: str, ttl_s: float | None = None) -> str:
        raw = self._call("POST", "/api/v1/tokens", json={"name": name, "role": role, "ttl_s": ttl_s})
        return str(raw["token"])

    # ---- chaos ---------------------------------------------------------------------------------
    def chaos_catalogue(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/chaos/catalogue"))

    def chaos_faults(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/chaos/faults"))

    def chaos_inject(self, kind: str, *, duration_s: float, selector: str = "COUNT(1)",
                     params: dict[str, Any] | None = None, replicas: list[str] | None = None,
                     zones: list[str] | None = None, allow_all: bool = False,
                     dry_run: bool = False) -> dict[str, Any]:
        body = {"kind": kind, "duration_s": duration_s, "selector": selector, "params": params or {},
                "replicas": replicas or [], "zones": zones or [], "allow_all": allow_all,
                "dry_run": dry_run}
        return dict(self._call("POST", "/api/v1/chaos/faults", json=body))

    def chaos_revert(self, fault_id: int) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/api/v1/chaos/faults/{fault_id}"))

    def chaos_halt(self) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/chaos/halt"))

    def chaos_release(self) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/chaos/release"))

    def chaos_run_experiment(self, experiment: dict[str, Any], *, dry_run: bool = False,
                             min_ready: int | None = None, max_error_rate: float | None = None,
                             max_p99_ttft_s: float | None = None, check_interval_s: float = 1.0,
                             rollback_strategy: str = "always") -> dict[str, Any]:
        """Start an experiment in the control plane: ``{"id", "status"}`` (and ``journal`` for a dry run);
        follow it with :meth:`chaos_experiment`."""
        body = {"experiment": experiment, "dry_run": dry_run, "min_ready": min_ready,
                "max_error_rate": max_error_rate, "max_p99_ttft_s": max_p99_ttft_s,
                "check_interval_s": check_interval_s, "rollback_strategy": rollback_strategy}
        return dict(self._call("POST", "/api/v1/chaos/experiments", json=body))

    def chaos_experiments(self, limit: int = 50) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/chaos/experiments", params={"limit": limit}))

    def chaos_experiment(self, experiment_id: int) -> dict[str, Any]:
        """One experiment's journal (``status`` is "running" until it ends)."""
        return dict(self._call("GET", f"/api/v1/chaos/experiments/{experiment_id}"))

    # ---- autoscaler ----------------------------------------------------------------------------
    def autoscaler_status(self) -> dict[str, Any]:
        """Mode (active, observe_only, paused), the last decision record and the configuration."""
        return dict(self._call("GET", "/api/v1/autoscaler/status"))

    def autoscaler_decisions(self, *, since: float | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Decision records, newest first; ``since`` in POSIX seconds."""
        params: dict[str, Any] = {"limit": limit}
        if since is not None:
            params["since"] = since
        return list(self._call("GET", "/api/v1/autoscaler/decisions", params=params))

    def autoscaler_configure(self, **changes: Any) -> dict[str, Any]:
        """Change run-time settings: observe_only, min_replicas, max_replicas, tolerance,
        scale_down_stabilization_s, targets={metric: value}; answers the new status."""
        return dict(self._call("PUT", "/api/v1/autoscaler/config", json=changes))

    def autoscaler_pause(self) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/autoscaler/pause"))

    def autoscaler_resume(self) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/autoscaler/resume"))

    def autoscaler_windows(self) -> dict[str, Any]:
        """The cron windows: ``{"now", "source", "active", "windows": [{name, cron, ..., next_start,
        next_end, active}]}`` (times in POSIX seconds)."""
        return dict(self._call("GET", "/api/v1/autoscaler/windows"))

    def autoscaler_set_windows(self, windows: list[dict[str, Any]]) -> dict[str, Any]:
        """Replace every cron window (operator); answers as :meth:`autoscaler_windows`."""
        return dict(self._call("PUT", "/api/v1/autoscaler/windows", json={"windows": windows}))

    # ---- console: login, latency attribution, charts ---------------------------------------------
    def login(self, user: str, password: str, ttl_s: float | None = None) -> dict[str, Any]:
        """A short-lived token of the user's role: ``{"user", "role", "token", "ttl_s"}``."""
        body: dict[str, Any] = {"user": user, "password": password}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return dict(self._call("POST", "/api/v1/auth/login", json=body))

    def logout(self) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/auth/logout"))

    def latency_breakdown(self, *, window_s: float = 300.0, scope: str = "fleet", quantile: float = 0.99,
                          slowest: int = 20) -> dict[str, Any]:
        params = {"window_s": window_s, "scope": scope, "quantile": quantile, "slowest": slowest}
        return dict(self._call("GET", "/api/v1/latency/breakdown", params=params))

    def metrics_range(self, metric: str, *, kind: str = "quantile", q: float | None = None,
                      scope: str = "fleet", by: str = "", minutes: float = 10.0,
                      step_s: float = 5.0) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"metric": metric, "kind": kind, "scope": scope, "by": by,
                                  "minutes": minutes, "step_s": step_s}
        if q is not None:
            params["q"] = q
        return list(self._call("GET", "/api/v1/metrics/range", params=params))

    def replica_activity(self) -> dict[str, dict[str, float | None]]:
        return dict(self._call("GET", "/api/v1/metrics/replicas"))

    def active_alerts(self) -> list[dict[str, Any]]:
        """Alerts (pending and firing); ApiError 404 when the control plane has no alerts API."""
        raw = self._call("GET", "/api/v1/alerts")
        return list(raw.get("alerts", []) if isinstance(raw, dict) else raw)

    # ---- alerts --------------------------------------------------------------------------------
    def alert_rules(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/alerts/rules"))

    def alert_rules_yml(self) -> str:
        """The rules as a Prometheus rule file."""
        return self._text("GET", "/api/v1/alerts/rules.yml")

    def alert_history(self, *, limit: int = 200, rule: str | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if rule:
            params["rule"] = rule
        return list(self._call("GET", "/api/v1/alerts/history", params=params))

    def set_alert_rule(self, name: str, *, enabled: bool) -> dict[str, Any]:
        return dict(self._call("PUT", f"/api/v1/alerts/rules/{name}", json={"enabled": enabled}))

    # ---- drill schedules -----------------------------------------------------------------------
    def drill_schedules(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/drills/schedules"))

    def drill_schedule(self, schedule_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/v1/drills/schedules/{schedule_id}"))

    def add_drill_schedule(self, *, name: str, scenario_id: str, cron: str, timezone: str | None = None,
                           overrides: dict[str, float] | None = None, overlap: str | None = None,
                           max_wait_s: float | None = None, misfire_grace_s: float | None = None,
                           coalesce: bool = True, paused: bool = False, replicas: list[str] | None = None,
                           zones: list[str] | None = None,
                           load: dict[str, Any] | None = None) -> dict[str, Any]:
        """Schedule a drill; ``replicas`` / ``zones`` / ``load`` aim and load it as :meth:`drill_run` does."""
        body: dict[str, Any] = {"name": name, "scenario_id": scenario_id, "cron": cron, "timezone": timezone,
                                "overrides": overrides or {}, "overlap": overlap, "max_wait_s": max_wait_s,
                                "misfire_grace_s": misfire_grace_s, "coalesce": coalesce, "paused": paused}
        return dict(self._call("POST", "/api/v1/drills/schedules", json=_aimed(body, replicas, zones, load)))

    def edit_drill_schedule(self, schedule_id: str, **changes: Any) -> dict[str, Any]:
        """Change only the given fields (name, scenario_id, cron, timezone, overrides, overlap, replicas,
        zones, load, ...); ``replicas=[]`` removes the aim, ``load={"kind": "rate"}`` the trace."""
        return dict(self._call("PATCH", f"/api/v1/drills/schedules/{schedule_id}", json=changes))

    def pause_drill_schedule(self, schedule_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/v1/drills/schedules/{schedule_id}/pause"))

    def resume_drill_schedule(self, schedule_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/v1/drills/schedules/{schedule_id}/resume"))

    def run_drill_schedule(self, schedule_id: str) -> dict[str, Any]:
        """Fire a schedule now (its cron continues afterwards)."""
        return dict(self._call("POST", f"/api/v1/drills/schedules/{schedule_id}/run"))

    def delete_drill_schedule(self, schedule_id: str) -> None:
        self._call("DELETE", f"/api/v1/drills/schedules/{schedule_id}")

    def drill_schedule_runs(self, schedule_id: str, *, limit: int = 100) -> list[dict[str, Any]]:
        return list(self._call("GET", f"/api/v1/drills/schedules/{schedule_id}/runs",
                               params={"limit": limit}))

    # ---- drills --------------------------------------------------------------------------------
    def drill_scenarios(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/drills/scenarios"))

    def drill_run(self, scenario: str, *, rate: float | None = None, duration_s: float | None = None,
                  fault_at_s: float | None = None, max_tokens: int | None = None,
                  targets: dict[str, float] | None = None, dry_run: bool = False,
                  capacity_deadline_s: float | None = None, replicas: list[str] | None = None,
                  zones: list[str] | None = None, load: dict[str, Any] | None = None) -> dict[str, Any]:
        """Start a drill (its id comes back at once) or, with ``dry_run``, get its plan. ``replicas`` /
        ``zones`` aim it; ``load`` is ``{"kind": "rate", "rate": R}`` or ``{"kind": "trace", "trace":
        "azure" | PATH, "compress": X, "token_scale": Y}``."""
        body: dict[str, Any] = {"scenario": scenario, "rate": rate, "duration_s": duration_s,
                                "fault_at_s": fault_at_s, "max_tokens": max_tokens, "targets": targets or {},
                                "dry_run": dry_run}
        if capacity_deadline_s is not None:
            body["capacity_deadline_s"] = capacity_deadline_s
        return dict(self._call("POST", "/api/v1/drills/run", json=_aimed(body, replicas, zones, load)))

    def drills(self, limit: int = 50) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/drills", params={"limit": limit}))

    def drill(self, drill_id: int) -> dict[str, Any]:
        """The report (with ``progress`` while it runs)."""
        return dict(self._call("GET", f"/api/v1/drills/{drill_id}"))

    def drill_markdown(self, drill_id: int) -> str:
        return self._text("GET", f"/api/v1/drills/{drill_id}/report.md")

    def drill_compare(self, ids: list[int]) -> dict[str, Any]:
        return dict(self._call("GET", "/api/v1/drills/compare", params={"ids": ",".join(map(str, ids))}))

    def drill_abort(self, drill_id: int) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/v1/drills/{drill_id}/abort"))

    # ---- what-if simulator ---------------------------------------------------------------------
    def simulate(self, *, trace: str = "synthetic-bursty", policies: list[str] | None = None,
                 requests: list[dict[str, Any]] | None = None, timeout: float = 120.0,
                 **options: Any) -> dict[str, Any]:
        """Run policies on a trace in the fleet simulator (operator); options as in ``POST /api/v1/simulate``
        (compress, token_scale, duration_s, seed, ttft_slo_s, tpot_slo_s, max_replicas, crashes)."""
        body = _simulation(trace, policies, requests, options)
        return dict(self._call("POST", "/api/v1/simulate", json=body, timeout=timeout))

    def start_simulation(self, *, trace: str = "synthetic-bursty", policies: list[str] | None = None,
                         requests: list[dict[str, Any]] | None = None, **options: Any) -> dict[str, Any]:
        """Start the same run as ``simulate`` as a background job (operator); returns the job (``id``,
        ``status``, ``progress``) at once; follow it with ``simulation(id)``."""
        body = _simulation(trace, policies, requests, options)
        return dict(self._call("POST", "/api/v1/simulations", json=body))

    def simulation(self, simulation_id: int) -> dict[str, Any]:
        """A job: status running | done | error | interrupted, progress, ``result`` when done."""
        return dict(self._call("GET", f"/api/v1/simulations/{simulation_id}"))

    def simulations(self, limit: int = 20) -> list[dict[str, Any]]:
        """The recent jobs, newest first, without their results."""
        return list(self._call("GET", "/api/v1/simulations", params={"limit": limit}))

    # ---- transport -----------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach the control plane at {self._http.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError(_message(response), status=response.status_code)
        return response.json()

    def _text(self, method: str, path: str, **kwargs: Any) -> str:
        """Like ``_call`` for endpoints that answer plain text (the Prometheus rule file)."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach the control plane at {self._http.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError(_message(response), status=response.status_code)
        return response.text


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else None
    except ValueError:
        message = None
    return f"HTTP {response.status_code}: {message or response.text[:200]}"


def _aimed(body: dict[str, Any], replicas: list[str] | None, zones: list[str] | None,
           load: dict[str, Any] | None) -> dict[str, Any]:
    """A drill run's or schedule's body with its aim and load, where given."""
    return {**body, **{k: v for k, v in (("replicas", replicas), ("zones", zones), ("load", load)) if v}}


def _simulation(trace: str, policies: list[str] | None, requests: list[dict[str, Any]] | None,
                options: dict[str, Any]) -> dict[str, Any]:
    """The body of a what-if run, synchronous or as a job."""
    return {"trace": trace, "policies": policies or ["ours", "hpa"], "requests": requests or [], **options}


def schedule_aim_and_load(overrides: dict[str, Any]) -> str:
    """A drill schedule's aim and load (from its ``overrides``) in a few words, for the CLI and the console:
    ``az-b-1; trace azure x2``, ``busiest; rate 2/s``."""
    aim = ", ".join([*overrides.get("replicas", []), *overrides.get("zones", [])]) or "busiest at t0"
    load = overrides.get("load") or {}
    if load.get("kind") == "trace":
        text = f"trace {load.get('trace')} x{load.get('compress', 1):g}"
    else:
        rate = load.get("rate", overrides.get("rate"))
        text = "scenario's rate" if rate is None else f"rate {rate:g}/s"
    return f"{aim}; {text}"
