"""Autoscaler: replicas against load with the decision markers, the decision log with every record's reasons,
the policy editor (``PUT /api/v1/autoscaler/config``), pause and resume, the schedule (cron windows with
their next start and end, and a JSON editor that replaces them through ``PUT /api/v1/autoscaler/windows``,
which validates them as the config file's) and the what-if simulator.

The simulator runs in the control plane as a background job (``POST /api/v1/simulations`` answers its id at
once; a long trace takes tens of seconds to minutes): the page keeps the id in a ``dcc.Store`` and polls the
job on its own interval, enabled only while the job runs, with a progress bar naming the policy simulated
now, then draws the comparison. A job already running when the page opens (started from another browser)
is followed too. Viewers see everything with every control disabled; the API refuses their calls anyway.
"""

from __future__ import annotations

import json
from typing import Any

import dash
from dash import Input, Output, State, ctx, dcc, html

from controlplane.client import (
    AUTOSCALER_TARGETS,
    AZURE_TRACE,
    DEFAULT_POLICIES,
    HPA,
    OURS,
    STATIC,
    SYNTHETIC_BURSTY,
    ApiError,
    AutoscalerPolicy,
    AutoscalerStatus,
    Decision,
    PolicyOutcome,
    ScheduleWindow,
    SimulationJob,
    static_policy,
)
from dashboards import figures, session
from dashboards.figures import (
    autoscaler_timeline,
    decision_reason,
    empty,
    number,
    progress,
    share,
    simulation_timeline,
    when,
)
from dashboards.shell import REFRESH

DECISIONS = 200  # decision records drawn and listed
LOG_ROWS = 50
SIM_POLL_MS = 300  # how often a running simulation job is polled (a run takes a second or two)
# The policy editor's numbers: (form field, label, step); a target's field is its metric, whose setting is
# AUTOSCALER_TARGETS[metric], every other field is the setting itself.
NUMBERS = (
    ("min_replicas", "Min replicas", 1),
    ("max_replicas", "Max replicas", 1),
    ("waiting_per_replica", "Target waiting / replica", 0.1),
    ("kv_cache_usage", "Target KV usage (0-1)", 0.01),
    ("ttft_p95_s", "Target P95 TTFT (s)", 0.1),
    ("tokens_per_s_per_replica", "Target tokens/s / replica", 1),
    ("tolerance", "Tolerance", 0.01),
    ("scale_down_stabilization_s", "Scale-down window (s)", 1),
)
TARGETS = tuple(name for name, *_ in NUMBERS if name in AUTOSCALER_TARGETS)
# The fields of a window the editor shows (the API's answer adds next_start, next_end, active, schedule).
WINDOW_FIELDS = ("name", "cron", "duration_s", "end_cron", "timezone", "weekdays", "min_replicas",
                 "max_replicas")
WINDOW_EXAMPLE = [{"name": "business-hours", "cron": "0 8 * * 1-5", "duration_s": 36000,
                   "timezone": "Europe/Berlin", "min_replicas": 4}]


def layout(**_: Any) -> html.Div:
    operate = session.can_operate()
    config: AutoscalerPolicy | None = None
    error = ""
    try:
        config = session.client().autoscaler_status().config
    except ApiError as exc:
        error = f"autoscaler: {exc}"
    following = _running_simulation()
    windows: tuple[ScheduleWindow, ...] = ()
    try:
        windows = session.client().autoscaler_windows().windows
    except ApiError as exc:
        error = error or f"autoscaler windows: {exc}"
    return html.Div(
        [
            html.H2("Autoscaler"),
            html.Div(error, className="notice"),
            html.Div(
                "" if operate else "Your role may not change the autoscaler: the controls are disabled.",
                className="notice",
                id="as-role-note",
            ),
            html.Div(id="as-status", className="cards"),
            html.Div(
                dcc.Graph(id="as-timeline", config={"displaylogo": False}, figure=empty("Replicas vs load")),
                className="panel",
            ),
            html.Div(
                className="panel",
                children=[
                    html.H3("Decision log (newest first): proposals with reasons, clamps, result"),
                    html.Div(html.Table(id="as-decisions", className="data"),
                             style={"maxHeight": "24rem", "overflowY": "auto"}),
                ],
            ),
            html.Div(className="panel",
                     children=[html.H3("Schedule: cron windows that set the replica bounds"),
                               _schedule(windows, operate)]),
            html.Div(
                className="grid2",
                children=[
                    html.Div(className="panel", children=[html.H3("Policy"), _editor(config, operate)]),
                    html.Div(className="panel", children=[html.H3("What-if simulator"),
                                                          _simulator(operate, following)]),
                ],
            ),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/autoscaler", name="Autoscaler", order=4, title="Autoscaler · LLM SRE console",
    layout=layout,
)



def _setting(config: AutoscalerPolicy | None, field: str) -> Any:
    """The policy's current value of an editor field (None while the autoscaler cannot be read)."""
    return None if config is None else getattr(config, AUTOSCALER_TARGETS.get(field, field))


def _editor(config: AutoscalerPolicy | None, operate: bool) -> html.Div:
    fields = [
        html.Div([html.Label(label), dcc.Input(id=f"as-{name}", type="number", value=_setting(config, name),
                                               step=step, min=0, disabled=not operate,
                                               style={"width": "8rem"})])
        for name, label, step in NUMBERS
    ]
    return html.Div(
        [
            dcc.Checklist(
                id="as-observe-only",
                options=[{"label": " observe only (record decisions, do not apply them)", "value": "yes",
                          "disabled": not operate}],
                value=["yes"] if config is not None and config.observe_only else [],
            ),
            html.Div(fields[:4], className="form-row"),
            html.Div(fields[4:], className="form-row"),
            html.Div(
                className="form-row",
                children=[
                    html.Button("Save policy", id="as-save", n_clicks=0, className="btn",
                                disabled=not operate),
                    html.Button("Pause", id="as-pause", n_clicks=0, className="btn btn-small",
                                disabled=not operate),
                    html.Button("Resume", id="as-resume", n_clicks=0, className="btn btn-small",
                                disabled=not operate),
                ],
            ),
            html.Div(id="as-save-result", className="muted"),
        ]
    )


def _schedule(windows: tuple[ScheduleWindow, ...], operate: bool) -> html.Div:
    """The windows' table (refreshed) and a JSON editor of the whole list, saved in one PUT."""
    text = json.dumps([w.settings() for w in windows], indent=2)
    return html.Div(
        [
            html.Div(id="as-windows-source", className="muted"),
            html.Table(id="as-windows", className="data"),
            html.Label("Windows (JSON list; fields: " + ", ".join(WINDOW_FIELDS) + "; give duration_s or "
                       "end_cron; [] removes every window). Example: " + json.dumps(WINDOW_EXAMPLE)),
            dcc.Textarea(id="as-windows-json", value=text, disabled=not operate,
                         style={"width": "100%", "height": "12rem", "fontFamily": "monospace"}),
            html.Div(
                className="form-row",
                children=[html.Button("Save schedule", id="as-windows-save", n_clicks=0, className="btn",
                                      disabled=not operate)],
            ),
            html.Div(id="as-windows-result", className="muted"),
        ]
    )


@dash.callback(
    Output("as-windows", "children"),
    Output("as-windows-source", "children"),
    Input(REFRESH, "n_intervals"),
    Input("as-windows-result", "children"),
)
def refresh_windows(*_: Any) -> tuple[Any, Any]:
    try:
        view = session.client().autoscaler_windows()
    except ApiError as exc:
        return [], html.Span(f"autoscaler windows: {exc}", className="notice")
    source = "set through the console or API" if view.source == "api" else "from the config file"
    note = f"{len(view.windows)} window(s), {source}; active now: {view.active or 'none'}"
    return _window_rows(view.windows), note


def _window_rows(windows: tuple[ScheduleWindow, ...]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("window", "schedule", "min..max", "active now",
                                                     "next start (UTC)", "next end (UTC)")])]
    for w in windows:
        low = "–" if w.min_replicas is None else w.min_replicas
        high = "–" if w.max_replicas is None else w.max_replicas
        rows.append(html.Tr(
            [
                html.Td(w.name),
                html.Td(w.schedule),
                html.Td(f"{low}..{high}"),
                html.Td("active" if w.active else "no"),
                html.Td(when(w.next_start)),
                html.Td(when(w.next_end)),
            ],
            className="window-row",
            **figures.data_attrs(name=w.name, active=str(w.active).lower(), next_start=w.next_start,
                                 next_end=w.next_end),
        ))
    if len(rows) == 1:
        rows.append(html.Tr(html.Td("no schedule window: the autoscaler's own bounds apply all the time",
                                    id="as-no-windows")))
    return rows


@dash.callback(
    Output("as-windows-result", "children"),
    Input("as-windows-save", "n_clicks"),
    State("as-windows-json", "value"),
    prevent_initial_call=True,
)
def save_windows(_: int, text: str | None) -> Any:
    try:
        windows = json.loads(text or "[]")
    except json.JSONDecodeError as exc:
        return html.Span(f"not saved: the windows are not JSON: {exc}", className="notice",
                         id="as-windows-refused")
    if isinstance(windows, dict) and set(windows) == {"windows"}:
        windows = windows["windows"]
    if not isinstance(windows, list) or not all(isinstance(w, dict) for w in windows):
        return html.Span('not saved: give a JSON list of windows, e.g. [{"name": ..., "cron": ...}]',
                         className="notice", id="as-windows-refused")
    try:
        view = session.client().autoscaler_set_windows(windows)
    except ApiError as exc:
        return html.Span(f"refused: {exc}", className="notice", id="as-windows-refused")
    names = ", ".join(w.name for w in view.windows) or "none"
    return html.Span(f"saved {len(view.windows)} window(s): {names}", id="as-windows-saved")


def _running_simulation() -> int | None:
    """The newest simulation job when it still runs (whoever started it), for the page to follow."""
    try:
        jobs = session.client().simulations(limit=1)
    except ApiError:
        return None
    return jobs[0].id if jobs and jobs[0].status == "running" else None


def _simulator(operate: bool, following: int | None) -> html.Div:
    return html.Div(
        [
            html.Div(
                className="form-row",
                children=[
                    html.Div([html.Label("Trace"), dcc.Dropdown(
                        id="as-sim-trace",
                        options=[{"label": "synthetic bursty (seeded)", "value": SYNTHETIC_BURSTY},
                                 {"label": "Azure LLM inference trace", "value": AZURE_TRACE}],
                        value=SYNTHETIC_BURSTY, clearable=False, disabled=not operate,
                        style={"minWidth": "14rem"})]),
                    html.Div([html.Label("Compression (x)"), dcc.Input(
                        id="as-sim-compress", type="number", value=4, min=0.1, max=1000, step=0.1,
                        disabled=not operate, style={"width": "6rem"})]),
                    html.Div([html.Label("Trace seconds kept (empty: all)"), dcc.Input(
                        id="as-sim-duration", type="number", value=None, min=1, max=14400,
                        disabled=not operate, style={"width": "8rem"})]),
                ],
            ),
            html.Div(
                className="form-row",
                children=[
                    html.Div([html.Label("Policies to compare"), dcc.Checklist(
                        id="as-sim-policies",
                        options=[{"label": " ours", "value": OURS, "disabled": not operate},
                                 {"label": " HPA", "value": HPA, "disabled": not operate},
                                 {"label": " static", "value": STATIC, "disabled": not operate}],
                        value=list(DEFAULT_POLICIES), inline=True)]),
                    html.Div([html.Label("Static replicas"), dcc.Input(
                        id="as-sim-static", type="number", value=3, min=1, max=64, step=1,
                        disabled=not operate, style={"width": "5rem"})]),
                    html.Button("Simulate", id="as-sim-run", n_clicks=0, className="btn",
                                disabled=not operate),
                ],
            ),
            html.Div(id="as-sim-progress"),
            html.Div(id="as-sim-note", className="muted"),
            html.Table(id="as-sim-table", className="data"),
            dcc.Graph(id="as-sim-graph", config={"displaylogo": False}, figure=simulation_timeline(None)),
            dcc.Store(id="as-sim-job", data=following),
            dcc.Interval(id="as-sim-poll", interval=SIM_POLL_MS, n_intervals=0, disabled=following is None),
        ]
    )


@dash.callback(
    Output("as-status", "children"),
    Output("as-timeline", "figure"),
    Output("as-decisions", "children"),
    Input(REFRESH, "n_intervals"),
    Input("as-save-result", "children"),
    Input("as-windows-result", "children"),  # a saved schedule changes the active window at once
)
def refresh(*_: Any) -> tuple[Any, Any, Any]:
    try:
        api = session.client()
        status = api.autoscaler_status()
        decisions = api.autoscaler_decisions(limit=DECISIONS)
    except ApiError as exc:
        return html.Div(f"autoscaler: {exc}", className="notice"), dash.no_update, []
    return _status_cards(status), autoscaler_timeline(decisions), _decision_rows(decisions[:LOG_ROWS])


def _status_cards(status: AutoscalerStatus) -> list[Any]:
    config, last = status.config, status.last_decision
    mode = "disabled" if not status.enabled else status.mode
    cards = (
        ("as-mode", "mode", mode),
        ("as-desired", "desired replicas", str(status.desired_replicas)),
        ("as-bounds", "min..max", f"{config.min_replicas}..{config.max_replicas}"),
        ("as-ticks", "ticks", str(status.ticks)),
        ("as-last", "last decision", f"{last.final} at {when(last.at)}" if last else "– at –"),
        ("as-window", "schedule window", status.window.name if status.window else "none"),
    )
    return [html.Div([html.Div(label, className="label"), html.Div(value, className="value")],
                     className="card", id=cid) for cid, label, value in cards]


def _decision_rows(decisions: list[Decision]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("time (UTC)", "mode", "current", "load (req/s)",
                                                     "proposals (reasons)", "clamps", "final", "applied")])]
    for d in decisions:
        proposals = [html.Li(f"{p.source} -> {p.replicas}: {p.reason}") for p in d.proposals]
        applied = "applied" if d.applied else (
            "observe only" if d.mode == "observe_only" else d.outcome or "not applied")
        rows.append(html.Tr(
            [
                html.Td(when(d.at)),
                html.Td(d.mode),
                html.Td(str(d.inputs.current)),
                html.Td(number(d.inputs.request_rate) + (
                    f" ({number(d.inputs.refused_rate)} refused at the gateways)"
                    if d.inputs.refused_rate else "")),
                html.Td(html.Ul(proposals) if proposals else "no proposal"),
                html.Td("; ".join(d.clamps) or "–"),
                html.Td(str(d.final)),
                html.Td(applied + (f": {d.error}" if d.error else "")),
            ],
            className="decision-row",
            title=decision_reason(d),
            **figures.data_attrs(id=d.id, final=d.final, applied=str(d.applied).lower(), mode=d.mode),
        ))
    if len(rows) == 1:
        rows.append(html.Tr(html.Td("no decision recorded yet (is the autoscaler enabled?)",
                                    id="as-no-decisions")))
    return rows


@dash.callback(
    Output("as-save-result", "children"),
    Input("as-save", "n_clicks"),
    Input("as-pause", "n_clicks"),
    Input("as-resume", "n_clicks"),
    State("as-observe-only", "value"),
    *[State(f"as-{name}", "value") for name, *_ in NUMBERS],
    prevent_initial_call=True,
)
def change(_save: int, _pause: int, _resume: int, observe_only: list[str] | None, *values: Any) -> str:
    try:
        api = session.client()
        if ctx.triggered_id == "as-pause":
            return f"paused: mode {api.autoscaler_pause()}"
        if ctx.triggered_id == "as-resume":
            return f"resumed: mode {api.autoscaler_resume()}"
        changes = _changes(observe_only, dict(zip((n for n, *_ in NUMBERS), values, strict=True)))
        status = api.autoscaler_configure(**changes)
    except ApiError as exc:
        return f"refused: {exc}"
    return f"saved: mode {status.mode}, replicas {status.config.min_replicas}..{status.config.max_replicas}"


def _changes(observe_only: list[str] | None, values: dict[str, Any]) -> dict[str, Any]:
    """The PUT body: every filled field; the targets nested as the API wants them."""
    body: dict[str, Any] = {"observe_only": bool(observe_only)}
    targets = {k: float(v) for k, v in values.items() if k in TARGETS and v is not None}
    for name, value in values.items():
        if name in TARGETS or value is None:
            continue
        body[name] = int(value) if name.endswith("_replicas") else float(value)
    if targets:
        body["targets"] = targets
    return body


@dash.callback(
    Output("as-sim-progress", "children"),
    Output("as-sim-note", "children"),
    Output("as-sim-table", "children"),
    Output("as-sim-graph", "figure"),
    Output("as-sim-job", "data"),
    Output("as-sim-poll", "disabled"),
    Input("as-sim-run", "n_clicks"),
    Input("as-sim-poll", "n_intervals"),
    State("as-sim-job", "data"),
    State("as-sim-trace", "value"),
    State("as-sim-compress", "value"),
    State("as-sim-duration", "value"),
    State("as-sim-policies", "value"),
    State("as-sim-static", "value"),
    prevent_initial_call=True,
)
def simulate(_run: int, _tick: int, job: int | None, trace: str | None, compress: float | None,
             duration: float | None, chosen: list[str] | None, static: int | None) -> tuple[Any, ...]:
    """The Simulate button starts a job; the poll interval follows it until it ends."""
    if ctx.triggered_id == "as-sim-run":
        return _start(trace, compress, duration, chosen, static)
    return _follow(job)


def _start(trace: str | None, compress: float | None, duration: float | None, chosen: list[str] | None,
           static: int | None) -> tuple[Any, ...]:
    keep = dash.no_update
    policies = [static_policy(int(static or 1)) if p == STATIC else p for p in chosen or []]
    if not policies:
        return keep, html.Span("choose at least one policy", className="notice"), [], keep, keep, keep
    options: dict[str, Any] = {"compress": float(compress or 4.0)}
    if duration:
        options["duration_s"] = float(duration)
    try:
        job = session.client().start_simulation(trace=trace or SYNTHETIC_BURSTY, policies=policies,
                                                **options)
    except ApiError as exc:
        refused = html.Span(f"refused: {exc}", className="notice", id="as-sim-refused")
        return keep, refused, [], keep, keep, keep
    return _running(job), "", [], simulation_timeline(None), job.id, False


def _follow(job_id: int | None) -> tuple[Any, ...]:
    keep = dash.no_update
    if job_id is None:
        return keep, keep, keep, keep, keep, True
    try:
        job = session.client().simulation(int(job_id))
    except ApiError as exc:  # a control plane that restarts comes back; a job that is gone does not
        notice = html.Span(f"simulation {job_id}: {exc}", className="notice", id="as-sim-refused")
        return keep, notice, keep, keep, keep, exc.status == 404
    if job.status == "running":
        return _running(job), keep, keep, keep, keep, False
    result = job.result
    if job.status != "done" or result is None:
        notice = html.Span(f"simulation {job_id} {job.status}: {job.error}", className="notice",
                           id="as-sim-refused" if job.status == "error" else "as-sim-interrupted")
        return "", notice, [], keep, keep, True
    note = (f"{result.num_requests} requests of the {result.trace} trace; SLO: TTFT <= "
            f"{result.slo.ttft_s} s, TPOT <= {result.slo.tpot_s} s; replica profile: {result.profile} "
            f"({result.profile_path}; fit error {result.profile_fit or 'unknown'})")
    return "", note, _comparison(result.policies), simulation_timeline(result), keep, True


def _running(job: SimulationJob) -> html.Div:
    """The progress bar of a running job: the fraction of all policies' runs done, the policy now."""
    policy = job.progress.policy if job.progress else ""
    fraction = job.progress.fraction if job.progress else None
    step = f" ({job.policies.index(policy) + 1} of {len(job.policies)})" if policy in job.policies else ""
    return html.Div(
        [html.Strong(f"Simulation {job.id} on the {job.trace} trace: running {policy}{step}"),
         progress(fraction, f"simulating {policy}")],
        id="as-sim-running",
        **figures.data_attrs(id=job.id, fraction=fraction, policy=policy),
    )


def _comparison(policies: tuple[PolicyOutcome, ...]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("policy", "SLO attainment", "replica-seconds",
                                                     "scale events", "reversals", "P95 TTFT", "P95 TPOT",
                                                     "unfinished")])]
    for p in policies:
        rows.append(html.Tr(
            [
                html.Td(p.policy),
                html.Td(share(p.slo_attainment)),
                html.Td(number(p.replica_seconds, 0)),
                html.Td(str(p.scale_events)),
                html.Td(str(p.reversals)),
                html.Td(number(p.ttft_p95_s, 3) + " s"),
                html.Td(number(p.tpot_p95_s, 3) + " s"),
                html.Td(str(p.unfinished)),
            ],
            className="sim-row",
            **figures.data_attrs(policy=p.policy, slo=p.slo_attainment),
        ))
    return rows
