"""A typed client of the control plane's REST API, used by the CLI and the console.

:class:`ControlPlaneClient` has one method per API call, and every read returns typed records
(``controlplane.views``, re-exported here), never raw JSON. The plumbing under it (the HTTP connection,
:class:`ApiError` and :class:`Unreachable`, the one place where transport and HTTP errors become
ApiError, the decoding of answers) is :mod:`controlplane.connection`, re-exported here too. The console
imports nothing of the control plane but this module: the records, the errors and the shared vocabulary
(``controlplane.vocabulary``) all come through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from controlplane.connection import DEFAULT_URL, TOKEN_ENV, ApiError, Availability, Connection, Unreachable
from controlplane.views import (
    ActiveAlert,
    ActiveFault,
    ActiveWindow,
    Aim,
    AlertAction,
    AlertRule,
    AlertTransition,
    AuditEntry,
    AutoscalerPolicy,
    AutoscalerStatus,
    BlastRadius,
    ComparedDrill,
    ComparedFigure,
    Decision,
    DecisionInputs,
    DrillAbort,
    DrillCheck,
    DrillComparison,
    DrillPlan,
    DrillProgress,
    DrillReport,
    DrillSchedule,
    DrillStarted,
    DrillSummary,
    Event,
    Experiment,
    ExperimentStarted,
    ExperimentSummary,
    ExpertLoad,
    FaultKind,
    FaultParam,
    FleetView,
    GatewayView,
    Halt,
    HaltState,
    Injection,
    LatencyBreakdown,
    Login,
    MetricSummary,
    PlannedFault,
    PolicyOutcome,
    Proposal,
    Quantiles,
    ReplicaActivity,
    ReplicaExpertLoad,
    ReplicaTail,
    ReplicaView,
    Revert,
    RolloutView,
    RuleSwitch,
    Scenario,
    ScenarioFault,
    ScheduleRun,
    ScheduleWindow,
    Series,
    SimSlo,
    SimTimeline,
    SimulationJob,
    SimulationProgress,
    SimulationResult,
    SliceBounds,
    SliceCheck,
    SliceCounts,
    SliceDifference,
    SliceExperiment,
    SliceExperimentAbort,
    SliceExperimentStarted,
    SliceExperimentSummary,
    SliceMetricFigures,
    SliceReport,
    SliceRevert,
    SliceSide,
    SliceSpec,
    SliceStop,
    StageMeans,
    Trace,
    UnexpectedAnswer,
    Windows,
    as_json,
    schedule_aim_and_load,
)
from controlplane.views.rollouts import ModelVersionView, ReleaseView, RolloutsView, VersionsView
from controlplane.vocabulary import (
    AUTOSCALER_METRICS,
    AUTOSCALER_TARGETS,
    AZURE_TRACE,
    DEFAULT_POLICIES,
    HPA,
    OURS,
    STATIC,
    SYNTHETIC_BURSTY,
    static_policy,
)


class ControlPlaneClient(Connection):
    """The control plane's REST API, one typed method per call (the connection: see
    :class:`~controlplane.connection.Connection`)."""

    # ---- fleet ---------------------------------------------------------------------------------
    def fleet(self) -> FleetView:
        return self._one(FleetView, "GET", "/api/v1/fleet")

    def gateways(self) -> list[GatewayView]:
        return self._many(GatewayView, "GET", "/api/v1/gateways")

    def scale(self, replicas: int) -> None:
        self._call("POST", "/api/v1/fleet/scale", json={"replicas": replicas})

    def restart(self, replica_id: str) -> None:
        self._call("POST", f"/api/v1/fleet/replicas/{replica_id}/restart")

    def rollout(self, model: str) -> RolloutView:
        return self._one(RolloutView, "POST", "/api/v1/fleet/rollout", json={"model": model})

    # ---- model versions and canary releases ---------------------------------------------------
    def versions(self) -> VersionsView:
        return self._one(VersionsView, "GET", "/api/v1/versions")

    def add_version(self, name: str, model: str, notes: str = "") -> ModelVersionView:
        return self._one(ModelVersionView, "POST", "/api/v1/versions",
                         json={"name": name, "model": model, "notes": notes})

    def rollouts(self, limit: int = 20) -> RolloutsView:
        return self._one(RolloutsView, "GET", "/api/v1/rollouts", params={"limit": limit})

    def start_canary(self, version: str, **policy: Any) -> ReleaseView:
        """``policy``: steps (percent), interval_s, max_extensions, replicas, alpha, max_error_increase,
        max_latency_ratio, min_samples (see ``POST /api/v1/rollouts/canary``)."""
        return self._one(ReleaseView, "POST", "/api/v1/rollouts/canary", json={"version": version, **policy})

    def release_action(self, release_id: int, action: str, reason: str = "") -> ReleaseView:
        """promote, abort, pause or resume a running release."""
        return self._one(ReleaseView, "POST", f"/api/v1/rollouts/{release_id}/{action}",
                         json={"reason": reason})

    # ---- observability -------------------------------------------------------------------------
    def events(self, *, since_id: int = 0, kind: str | None = None, limit: int = 200) -> list[Event]:
        params: dict[str, Any] = {"since_id": since_id, "limit": limit}
        if kind:
            params["kind"] = kind
        return self._many(Event, "GET", "/api/v1/events", params=params)

    def summary(self, scope: str = "fleet") -> MetricSummary:
        return self._one(MetricSummary, "GET", "/api/v1/metrics/summary", params={"scope": scope})

    def slow_traces(self, limit: int = 50) -> list[Trace]:
        return self._many(Trace, "GET", "/api/v1/traces/slow", params={"limit": limit})

    def audit(self, limit: int = 200) -> list[AuditEntry]:
        return self._many(AuditEntry, "GET", "/api/v1/audit", params={"limit": limit})

    def issue_token(self, name: str, role: str, ttl_s: float | None = None) -> str:
        raw = self._call("POST", "/api/v1/tokens", json={"name": name, "role": role, "ttl_s": ttl_s})
        return str(raw["token"])

    # ---- chaos ---------------------------------------------------------------------------------
    def chaos_catalogue(self) -> list[FaultKind]:
        return self._many(FaultKind, "GET", "/api/v1/chaos/catalogue")

    def chaos_faults(self) -> list[ActiveFault]:
        return self._many(ActiveFault, "GET", "/api/v1/chaos/faults")

    def chaos_inject(self, kind: str, *, duration_s: float, selector: str = "COUNT(1)",
                     params: Mapping[str, Any] | None = None, replicas: Sequence[str] | None = None,
                     zones: Sequence[str] | None = None, allow_all: bool = False,
                     dry_run: bool = False) -> Injection:
        body = {"kind": kind, "duration_s": duration_s, "selector": selector, "params": dict(params or {}),
                "replicas": list(replicas or []), "zones": list(zones or []), "allow_all": allow_all,
                "dry_run": dry_run}
        return self._one(Injection, "POST", "/api/v1/chaos/faults", json=body)

    def chaos_revert(self, fault_id: int) -> Revert:
        return self._one(Revert, "DELETE", f"/api/v1/chaos/faults/{fault_id}")

    def chaos_halt(self) -> Halt:
        return self._one(Halt, "POST", "/api/v1/chaos/halt")

    def chaos_release(self) -> HaltState:
        return self._one(HaltState, "POST", "/api/v1/chaos/release")

    def chaos_run_experiment(self, experiment: Mapping[str, Any], *, dry_run: bool = False,
                             min_ready: int | None = None, max_error_rate: float | None = None,
                             max_p99_ttft_s: float | None = None, check_interval_s: float = 1.0,
                             rollback_strategy: str = "always") -> ExperimentStarted:
        """Start an experiment in the control plane (a dry run answers its journal at once); follow it
        with :meth:`chaos_experiment`."""
        body = {"experiment": dict(experiment), "dry_run": dry_run, "min_ready": min_ready,
                "max_error_rate": max_error_rate, "max_p99_ttft_s": max_p99_ttft_s,
                "check_interval_s": check_interval_s, "rollback_strategy": rollback_strategy}
        return self._one(ExperimentStarted, "POST", "/api/v1/chaos/experiments", json=body)

    def chaos_experiments(self, limit: int = 50) -> list[ExperimentSummary]:
        return self._many(ExperimentSummary, "GET", "/api/v1/chaos/experiments", params={"limit": limit})

    def chaos_experiment(self, experiment_id: int) -> Experiment:
        """One experiment with its journal (``status`` is "running" until it ends)."""
        return self._one(Experiment, "GET", f"/api/v1/chaos/experiments/{experiment_id}")

    # ---- slice experiments ---------------------------------------------------------------------
    def slice_experiment_start(self, *, share: float, fault: str, params: Mapping[str, Any] | None = None,
                               duration_s: float = 60.0, check_interval_s: float = 1.0,
                               bounds: Mapping[str, float] | None = None, colour: str = "chaos",
                               control: str = "control") -> SliceExperimentStarted:
        """Chaos on a ``share`` colour of traffic against a control colour of the same share; it stops
        itself on a deviation beyond ``bounds`` (max_error_increase, max_latency_ratio, alpha,
        min_samples) or after ``duration_s``. Its id comes back at once."""
        body = {"share": share, "fault": fault, "params": dict(params or {}), "duration_s": duration_s,
                "check_interval_s": check_interval_s, "bounds": dict(bounds or {}), "colour": colour,
                "control": control}
        return self._one(SliceExperimentStarted, "POST", "/api/v1/experiments/slices", json=body)

    def slice_experiments(self, limit: int = 50) -> list[SliceExperimentSummary]:
        return self._many(SliceExperimentSummary, "GET", "/api/v1/experiments/slices",
                          params={"limit": limit})

    def slice_experiment(self, experiment_id: int) -> SliceExperiment:
        """One run: its checks so far while ``status`` is "running", then its report and why it stopped."""
        return self._one(SliceExperiment, "GET", f"/api/v1/experiments/slices/{experiment_id}")

    def slice_experiment_abort(self, experiment_id: int) -> SliceExperimentAbort:
        return self._one(SliceExperimentAbort, "POST", f"/api/v1/experiments/slices/{experiment_id}/abort")

    # ---- autoscaler ----------------------------------------------------------------------------
    def autoscaler_status(self) -> AutoscalerStatus:
        """Mode (active, observe_only, paused), the active window, the last decision and the settings."""
        return self._one(AutoscalerStatus, "GET", "/api/v1/autoscaler/status")

    def autoscaler_decisions(self, *, since: float | None = None, limit: int = 100) -> list[Decision]:
        """Decision records, newest first; ``since`` in POSIX seconds."""
        params: dict[str, Any] = {"limit": limit}
        if since is not None:
            params["since"] = since
        return self._many(Decision, "GET", "/api/v1/autoscaler/decisions", params=params)

    def autoscaler_configure(self, **changes: Any) -> AutoscalerStatus:
        """Change run-time settings: observe_only, min_replicas, max_replicas, tolerance,
        scale_down_stabilization_s, scale_down_period_s, targets={metric: value} (metrics:
        ``AUTOSCALER_TARGETS``); answers the new status."""
        return self._one(AutoscalerStatus, "PUT", "/api/v1/autoscaler/config", json=changes)

    def autoscaler_pause(self) -> str:
        """Stop deciding until resume; answers the mode."""
        return str(self._call("POST", "/api/v1/autoscaler/pause")["mode"])

    def autoscaler_resume(self) -> str:
        return str(self._call("POST", "/api/v1/autoscaler/resume")["mode"])

    def autoscaler_windows(self) -> Windows:
        """The cron windows with their next start and end (POSIX seconds)."""
        return self._one(Windows, "GET", "/api/v1/autoscaler/windows")

    def autoscaler_set_windows(self, windows: Sequence[Mapping[str, Any] | ScheduleWindow]) -> Windows:
        """Replace every cron window (operator): each as ``[[autoscaler.windows]]`` in the config (a
        mapping) or a window read before; answers as :meth:`autoscaler_windows`."""
        body = [w.settings() if isinstance(w, ScheduleWindow) else dict(w) for w in windows]
        return self._one(Windows, "PUT", "/api/v1/autoscaler/windows", json={"windows": body})

    # ---- console: login, latency attribution, charts ---------------------------------------------
    def login(self, user: str, password: str, ttl_s: float | None = None) -> Login:
        """A short-lived token of the user's role."""
        body: dict[str, Any] = {"user": user, "password": password}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return self._one(Login, "POST", "/api/v1/auth/login", json=body)

    def logout(self) -> bool:
        """Revoke the caller's token; whether it was live."""
        return bool(self._call("POST", "/api/v1/auth/logout")["revoked"])

    def latency_breakdown(self, *, window_s: float = 300.0, scope: str = "fleet", quantile: float = 0.99,
                          slowest: int = 20) -> LatencyBreakdown:
        params = {"window_s": window_s, "scope": scope, "quantile": quantile, "slowest": slowest}
        return self._one(LatencyBreakdown, "GET", "/api/v1/latency/breakdown", params=params)

    def metrics_range(self, metric: str, *, kind: str = "quantile", q: float | None = None,
                      scope: str = "fleet", by: str = "", minutes: float = 10.0,
                      step_s: float = 5.0) -> list[Series]:
        params: dict[str, Any] = {"metric": metric, "kind": kind, "scope": scope, "by": by,
                                  "minutes": minutes, "step_s": step_s}
        if q is not None:
            params["q"] = q
        return self._many(Series, "GET", "/api/v1/metrics/range", params=params)

    def replica_activity(self) -> dict[str, ReplicaActivity]:
        raw = self._call("GET", "/api/v1/metrics/replicas")
        if not isinstance(raw, dict):
            raise self._unexpected("/api/v1/metrics/replicas", UnexpectedAnswer("expected an object"))
        return {rid: self._decode(ReplicaActivity, load, f"replica {rid}") for rid, load in raw.items()}

    def expert_load(self, *, scope: str = "fleet", window_s: float | None = None) -> ExpertLoad:
        """Tokens/s and tokens per expert for each replica, with its imbalance; a dense model: no experts."""
        params: dict[str, Any] = {"scope": scope}
        if window_s is not None:
            params["window_s"] = window_s
        return self._one(ExpertLoad, "GET", "/api/v1/metrics/experts", params=params)

    # ---- alerts --------------------------------------------------------------------------------
    def active_alerts(self) -> list[ActiveAlert]:
        """Alerts (pending and firing); ApiError 404 when the control plane has no alerts API."""
        return self._many(ActiveAlert, "GET", "/api/v1/alerts/active")

    def alert_rules(self) -> list[AlertRule]:
        return self._many(AlertRule, "GET", "/api/v1/alerts/rules")

    def alert_rules_yml(self) -> str:
        """The rules as a Prometheus rule file."""
        return self._text("GET", "/api/v1/alerts/rules.yml")

    def alert_history(self, *, limit: int = 200, rule: str | None = None) -> list[AlertTransition]:
        params: dict[str, Any] = {"limit": limit}
        if rule:
            params["rule"] = rule
        return self._many(AlertTransition, "GET", "/api/v1/alerts/history", params=params)

    def set_alert_rule(self, name: str, *, enabled: bool) -> RuleSwitch:
        return self._one(RuleSwitch, "PUT", f"/api/v1/alerts/rules/{name}", json={"enabled": enabled})

    # ---- drill schedules -----------------------------------------------------------------------
    def drill_schedules(self) -> list[DrillSchedule]:
        return self._many(DrillSchedule, "GET", "/api/v1/drills/schedules")

    def drill_schedule(self, schedule_id: str) -> DrillSchedule:
        return self._one(DrillSchedule, "GET", f"/api/v1/drills/schedules/{schedule_id}")

    def add_drill_schedule(self, *, name: str, scenario_id: str, cron: str, timezone: str | None = None,
                           overrides: Mapping[str, float] | None = None, overlap: str | None = None,
                           max_wait_s: float | None = None, misfire_grace_s: float | None = None,
                           coalesce: bool = True, paused: bool = False, replicas: Sequence[str] | None = None,
                           zones: Sequence[str] | None = None,
                           load: Mapping[str, Any] | None = None) -> DrillSchedule:
        """Schedule a drill; ``replicas`` / ``zones`` / ``load`` aim and load it as :meth:`drill_run` does."""
        body: dict[str, Any] = {"name": name, "scenario_id": scenario_id, "cron": cron, "timezone": timezone,
                                "overrides": dict(overrides or {}), "overlap": overlap,
                                "max_wait_s": max_wait_s, "misfire_grace_s": misfire_grace_s,
                                "coalesce": coalesce, "paused": paused}
        return self._one(DrillSchedule, "POST", "/api/v1/drills/schedules",
                         json=_aimed(body, replicas, zones, load))

    def edit_drill_schedule(self, schedule_id: str, **changes: Any) -> DrillSchedule:
        """Change only the given fields (name, scenario_id, cron, timezone, overrides, overlap, replicas,
        zones, load, ...); ``replicas=[]`` removes the aim, ``load={"kind": "rate"}`` the trace."""
        return self._one(DrillSchedule, "PATCH", f"/api/v1/drills/schedules/{schedule_id}", json=changes)

    def pause_drill_schedule(self, schedule_id: str) -> DrillSchedule:
        return self._one(DrillSchedule, "POST", f"/api/v1/drills/schedules/{schedule_id}/pause")

    def resume_drill_schedule(self, schedule_id: str) -> DrillSchedule:
        return self._one(DrillSchedule, "POST", f"/api/v1/drills/schedules/{schedule_id}/resume")

    def run_drill_schedule(self, schedule_id: str) -> DrillSchedule:
        """Fire a schedule now (its cron continues afterwards)."""
        return self._one(DrillSchedule, "POST", f"/api/v1/drills/schedules/{schedule_id}/run")

    def delete_drill_schedule(self, schedule_id: str) -> None:
        self._call("DELETE", f"/api/v1/drills/schedules/{schedule_id}")

    def drill_schedule_runs(self, schedule_id: str, *, limit: int = 100) -> list[ScheduleRun]:
        return self._many(ScheduleRun, "GET", f"/api/v1/drills/schedules/{schedule_id}/runs",
                          params={"limit": limit})

    # ---- drills --------------------------------------------------------------------------------
    def drill_scenarios(self) -> list[Scenario]:
        return self._many(Scenario, "GET", "/api/v1/drills/scenarios")

    def drill_run(self, scenario: str, *, rate: float | None = None, duration_s: float | None = None,
                  fault_at_s: float | None = None, max_tokens: int | None = None,
                  targets: Mapping[str, float] | None = None, capacity_deadline_s: float | None = None,
                  replicas: Sequence[str] | None = None, zones: Sequence[str] | None = None,
                  load: Mapping[str, Any] | None = None,
                  steady_state_timeout_s: float | None = None) -> DrillStarted:
        """Start a drill; its id comes back at once. ``replicas`` / ``zones`` aim it; ``load`` is
        ``{"kind": "rate", "rate": R}`` or ``{"kind": "trace", "trace": "azure" | PATH, "compress": X,
        "token_scale": Y}``; ``steady_state_timeout_s``: how long it may wait for the steady state."""
        body = _drill_body(scenario, rate=rate, duration_s=duration_s, fault_at_s=fault_at_s,
                           max_tokens=max_tokens, targets=targets, capacity_deadline_s=capacity_deadline_s,
                           replicas=replicas, zones=zones, load=load)
        if steady_state_timeout_s is not None:
            body["steady_state_timeout_s"] = steady_state_timeout_s
        return self._one(DrillStarted, "POST", "/api/v1/drills/run", json=body)

    def drill_plan(self, scenario: str, *, rate: float | None = None, duration_s: float | None = None,
                   fault_at_s: float | None = None, max_tokens: int | None = None,
                   targets: Mapping[str, float] | None = None, capacity_deadline_s: float | None = None,
                   replicas: Sequence[str] | None = None, zones: Sequence[str] | None = None,
                   load: Mapping[str, Any] | None = None) -> DrillPlan:
        """The dry run of :meth:`drill_run` with the same arguments: what it would hit, and the RTO
        predicted; nothing changes."""
        body = _drill_body(scenario, rate=rate, duration_s=duration_s, fault_at_s=fault_at_s,
                           max_tokens=max_tokens, targets=targets, capacity_deadline_s=capacity_deadline_s,
                           replicas=replicas, zones=zones, load=load)
        raw = self._call("POST", "/api/v1/drills/run", json={**body, "dry_run": True})
        plan = raw.get("plan") if isinstance(raw, dict) else raw
        return self._decode(DrillPlan, plan, "/api/v1/drills/run")

    def drills(self, limit: int = 50) -> list[DrillSummary]:
        return self._many(DrillSummary, "GET", "/api/v1/drills", params={"limit": limit})

    def drill(self, drill_id: int) -> DrillReport:
        """The report (with ``progress`` while it runs)."""
        return self._one(DrillReport, "GET", f"/api/v1/drills/{drill_id}")

    def drill_markdown(self, drill_id: int) -> str:
        return self._text("GET", f"/api/v1/drills/{drill_id}/report.md")

    def drill_compare(self, ids: Sequence[int]) -> DrillComparison:
        return self._one(DrillComparison, "GET", "/api/v1/drills/compare",
                         params={"ids": ",".join(map(str, ids))})

    def drill_abort(self, drill_id: int) -> DrillAbort:
        return self._one(DrillAbort, "POST", f"/api/v1/drills/{drill_id}/abort")

    # ---- what-if simulator ---------------------------------------------------------------------
    def simulate(self, *, trace: str = SYNTHETIC_BURSTY, policies: Sequence[str] | None = None,
                 requests: Sequence[Mapping[str, Any]] | None = None, timeout: float = 120.0,
                 **options: Any) -> SimulationResult:
        """Run policies on a trace in the fleet simulator (operator); options as in ``POST /api/v1/simulate``
        (compress, token_scale, duration_s, seed, ttft_slo_s, tpot_slo_s, max_replicas, crashes)."""
        body = _simulation(trace, policies, requests, options)
        return self._one(SimulationResult, "POST", "/api/v1/simulate", json=body, timeout=timeout)

    def start_simulation(self, *, trace: str = SYNTHETIC_BURSTY, policies: Sequence[str] | None = None,
                         requests: Sequence[Mapping[str, Any]] | None = None,
                         **options: Any) -> SimulationJob:
        """Start the same run as ``simulate`` as a background job (operator); the job (``id``, ``status``,
        ``progress``) comes back at once; follow it with ``simulation(id)``."""
        body = _simulation(trace, policies, requests, options)
        return self._one(SimulationJob, "POST", "/api/v1/simulations", json=body)

    def simulation(self, simulation_id: int) -> SimulationJob:
        """A job: status running | done | error | interrupted, progress, ``result`` when done."""
        return self._one(SimulationJob, "GET", f"/api/v1/simulations/{simulation_id}")

    def simulations(self, limit: int = 20) -> list[SimulationJob]:
        """The recent jobs, newest first, without their results."""
        return self._many(SimulationJob, "GET", "/api/v1/simulations", params={"limit": limit})


def _aimed(body: dict[str, Any], replicas: Sequence[str] | None, zones: Sequence[str] | None,
           load: Mapping[str, Any] | None) -> dict[str, Any]:
    """A drill run's or schedule's body with its aim and load, where given."""
    given = (("replicas", list(replicas or [])), ("zones", list(zones or [])), ("load", dict(load or {})))
    return {**body, **{k: v for k, v in given if v}}


def _drill_body(scenario: str, *, rate: float | None, duration_s: float | None, fault_at_s: float | None,
                max_tokens: int | None, targets: Mapping[str, float] | None,
                capacity_deadline_s: float | None, replicas: Sequence[str] | None,
                zones: Sequence[str] | None, load: Mapping[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"scenario": scenario, "rate": rate, "duration_s": duration_s,
                            "fault_at_s": fault_at_s, "max_tokens": max_tokens,
                            "targets": dict(targets or {})}
    if capacity_deadline_s is not None:
        body["capacity_deadline_s"] = capacity_deadline_s
    return _aimed(body, replicas, zones, load)


def _simulation(trace: str, policies: Sequence[str] | None, requests: Sequence[Mapping[str, Any]] | None,
                options: dict[str, Any]) -> dict[str, Any]:
    """The body of a what-if run, synchronous or as a job."""
    return {"trace": trace, "policies": list(policies or DEFAULT_POLICIES),
            "requests": [dict(r) for r in requests or []], **options}


__all__ = [
    "AUTOSCALER_METRICS", "AUTOSCALER_TARGETS", "AZURE_TRACE", "DEFAULT_POLICIES", "DEFAULT_URL", "HPA",
    "OURS", "STATIC", "SYNTHETIC_BURSTY", "TOKEN_ENV", "ActiveAlert", "ActiveFault", "ActiveWindow", "Aim",
    "AlertAction", "AlertRule", "AlertTransition", "ApiError", "AuditEntry", "AutoscalerPolicy",
    "AutoscalerStatus", "Availability", "BlastRadius", "ComparedDrill", "ComparedFigure",
    "ControlPlaneClient", "Decision", "DecisionInputs", "DrillAbort", "DrillCheck", "DrillComparison",
    "DrillPlan", "DrillProgress", "DrillReport", "DrillSchedule", "DrillStarted", "DrillSummary", "Event",
    "Experiment", "ExperimentStarted", "ExperimentSummary", "ExpertLoad", "FaultKind", "FaultParam",
    "FleetView", "GatewayView", "Halt", "HaltState", "Injection", "LatencyBreakdown", "Login",
    "MetricSummary", "ModelVersionView", "PlannedFault", "PolicyOutcome", "Proposal", "Quantiles",
    "ReleaseView", "ReplicaActivity", "ReplicaExpertLoad", "ReplicaTail", "ReplicaView", "Revert",
    "RolloutView", "RolloutsView", "RuleSwitch", "Scenario", "ScenarioFault", "ScheduleRun", "ScheduleWindow",
    "Series", "SimSlo", "SimTimeline", "SimulationJob", "SimulationProgress", "SimulationResult",
    "SliceBounds", "SliceCheck", "SliceCounts", "SliceDifference", "SliceExperiment", "SliceExperimentAbort",
    "SliceExperimentStarted", "SliceExperimentSummary", "SliceMetricFigures", "SliceReport", "SliceRevert",
    "SliceSide", "SliceSpec", "SliceStop", "StageMeans", "Trace", "Unreachable", "VersionsView", "Windows",
    "as_json", "schedule_aim_and_load", "static_policy",
]
