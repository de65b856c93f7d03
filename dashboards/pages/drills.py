"""Drills: pick a scenario, what it hits (a replica or a zone of the fleet; default: the busiest at t0), its
load (Poisson at a rate, or an Azure LLM trace replayed) and its RTO/RPO targets; preview it (the API's dry
run: the resolved aim and fault targets, the load and the predicted RTO); run it and follow its progress;
read its report (RTO and RPO against the targets, predicted against measured, the verdict) over its
timeline; compare past runs; manage schedules (each may be aimed at a replica and replay the Azure trace,
as a run can).

A drill runs in the control plane (``POST /api/v1/drills/run`` answers its id at once); the page keeps the
id in a ``dcc.Store`` and polls the drill on the refresh clock, so a closed browser loses nothing.
Viewers see everything with every control disabled; the API refuses their calls anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from controlplane.client import (
    Aim,
    ApiError,
    DrillComparison,
    DrillPlan,
    DrillReport,
    DrillSummary,
    Scenario,
)
from dashboards import figures, live_rows, session
from dashboards.drill_schedules import TRACE_DEFAULT, schedule_form
from dashboards.figures import drill_timeline, number, number_input, progress, scenario_options, when
from dashboards.shell import REFRESH

HISTORY = 30
LOAD_KINDS = (("rate", "Poisson at a rate"), ("trace", "Azure LLM trace replay"))
# (field, label, default) of the load; None: the scenario's own value
LOAD = (
    ("rate", "Rate (req/s)", None),
    ("duration_s", "Load duration (s)", None),
    ("fault_at_s", "Fault at (s into the load)", None),
    ("max_tokens", "Max tokens", None),
    ("capacity_deadline_s", "Capacity deadline (s)", None),
)
# (target name, label) of the verdict; RTO in seconds, RPO in counts
TARGETS = (
    ("rto_service_s", "RTO service (s)"),
    ("rto_slo_s", "RTO SLO (s)"),
    ("rto_capacity_s", "RTO capacity (s)"),
    ("max_failed_requests", "RPO: failed requests"),
    ("max_tokens_lost", "RPO: tokens lost"),
    ("max_tokens_duplicated", "RPO: tokens duplicated"),
    ("max_writes_lost", "RPO: writes lost"),
)
RTO = ("rto_service_s", "rto_service_p99_s", "rto_slo_s", "rto_capacity_s")
RPO = ("requests_failed", "tokens_lost", "tokens_duplicated", "writes_lost")
MARKS = ("t_detect", "t_switch", "t_first_ok", "t_service", "t_slo", "t_capacity")


def layout(**_: Any) -> html.Div:
    operate = session.can_operate()
    scenarios: list[Scenario] = []
    fleet: list[tuple[str, str]] = []  # (replica id, zone)
    current: int | None = None
    error = ""
    try:
        api = session.client()
        scenarios = api.drill_scenarios()
        fleet = sorted((r.replica_id, r.zone) for r in api.fleet().replicas)
        latest = api.drills(limit=1)
        current = latest[0].id if latest else None
    except ApiError as exc:
        error = f"drills: {exc}"
    return html.Div(
        [
            html.H2("Drills"),
            html.Div(error, className="notice"),
            html.Div(
                "" if operate
                else "Your role may not run drills or change schedules: the controls are disabled.",
                className="notice",
                id="drills-role-note",
            ),
            html.Div(
                className="grid2",
                children=[
                    html.Div(className="panel", children=[html.H3("Run a drill"),
                                                          _form(scenarios, fleet, operate),
                                                          html.Div(id="drills-plan"),
                                                          html.Div(id="drills-run-result")]),
                    html.Div(className="panel", children=[html.H3("Drill"), html.Div(id="drills-progress"),
                                                          html.Div(id="drills-report")]),
                ],
            ),
            html.Div(dcc.Graph(id="drills-timeline", config={"displaylogo": False},
                               figure=drill_timeline(None)), className="panel"),
            html.Div(className="panel", children=[
                html.H3("History"),
                html.Table(id="drills-history", className="data"),
                html.Div(className="form-row", children=[
                    html.Div([html.Label("Compare drills"),
                              dcc.Dropdown(id="drills-compare-ids", options=[], multi=True,
                                           style={"minWidth": "20rem"})]),
                    html.Button("Compare", id="drills-compare", n_clicks=0, className="btn"),
                ]),
                html.Div(id="drills-comparison"),
            ]),
            html.Div(className="panel", children=[html.H3("Schedules"),
                                                  schedule_form(scenarios, fleet, operate),
                                                  html.Div(id="drills-sched-result", className="muted"),
                                                  html.Table(id="drills-schedules", className="data"),
                                                  dcc.Store(id="drills-schedules-key"),
                                                  dcc.Store(id="drills-schedules-live")]),
            dcc.Store(id="drills-history-key"),
            dcc.Store(id="drills-current", data=current),
            dcc.Store(id="drills-shown", data=None),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/drills", name="Drills", order=2, title="Drills · LLM SRE console", layout=layout
)



def _form(scenarios: list[Scenario], fleet: list[tuple[str, str]], operate: bool) -> html.Div:
    first = scenarios[0].id if scenarios else None
    zones = sorted({zone for _, zone in fleet})
    return html.Div(
        [
            html.Div(className="form-row", children=[
                html.Div([html.Label("Scenario"), dcc.Dropdown(
                    id="drills-scenario", options=scenario_options(scenarios), value=first,
                    clearable=False, disabled=not operate, style={"minWidth": "22rem"})]),
            ]),
            html.Div(id="drills-scenario-info", className="muted"),
            html.Div("Aim (empty: the busiest replica at t0, or its zone)", className="muted"),
            html.Div(className="form-row", children=[
                html.Div([html.Label("Zone"), dcc.Dropdown(
                    id="drills-aim-zone", options=[{"label": z, "value": z} for z in zones], value=None,
                    placeholder="busiest", disabled=not operate, style={"minWidth": "10rem"})]),
                html.Div([html.Label("Replica"), dcc.Dropdown(
                    id="drills-aim-replica", value=None, placeholder="busiest", disabled=not operate,
                    options=[{"label": f"{rid} ({zone})", "value": rid} for rid, zone in fleet],
                    style={"minWidth": "14rem"})]),
            ]),
            html.Div("Load (empty: the scenario's value)", className="muted"),
            html.Div(className="form-row", children=[
                html.Div([html.Label("Load kind"), dcc.RadioItems(
                    id="drills-load-kind", options=[{"label": label, "value": kind, "disabled": not operate}
                                                    for kind, label in LOAD_KINDS],
                    value="rate", inline=True)]),
                html.Div([html.Label("Trace ('azure' or a path on the control plane)"), dcc.Input(
                    id="drills-trace", type="text", value=TRACE_DEFAULT, disabled=not operate,
                    style={"width": "14rem"})]),
                number_input("drills-compress", "Compress (x faster)", None, operate),
                number_input("drills-token-scale", "Token scale", None, operate),
            ]),
            html.Div([number_input(f"drills-{name}", label, default, operate)
                      for name, label, default in LOAD], className="form-row"),
            html.Div("Targets (empty: the scenario's value)", className="muted"),
            html.Div([number_input(f"drills-target-{name}", label, None, operate, "6rem")
                      for name, label in TARGETS], className="form-row"),
            html.Div(className="form-row", children=[
                html.Button("Preview (dry run)", id="drills-preview", n_clicks=0, className="btn",
                            disabled=not operate),
                html.Button("Run drill", id="drills-run", n_clicks=0, className="btn btn-danger",
                            disabled=not operate),
                html.Button("Abort", id="drills-abort", n_clicks=0, className="btn btn-small",
                            disabled=not operate),
            ]),
        ]
    )


@dash.callback(Output("drills-scenario-info", "children"),
               *[Output(f"drills-{name}", "placeholder") for name, _, _ in LOAD],
               *[Output(f"drills-target-{name}", "placeholder") for name, _ in TARGETS],
               Input("drills-scenario", "value"))
def scenario_info(scenario_id: str | None) -> tuple[Any, ...]:
    blank = ("",) * (1 + len(LOAD) + len(TARGETS))
    if not scenario_id:
        return blank
    try:
        found = [s for s in session.client().drill_scenarios() if s.id == scenario_id]
    except ApiError as exc:
        return (f"scenarios: {exc}", *blank[1:])
    if not found:
        return blank
    s = found[0]
    faults = ", ".join(f"{f.kind} ({f.selector}{', zone ' + f.zone if f.zone else ''})"
                       for f in s.faults) or s.action
    info = (f"{s.description} Fault: {faults}; detection: {s.detection}. "
            "Unless aimed below, the fault goes to the busiest replica at t0 (or its zone).")
    return (info, *[_placeholder(getattr(s, name)) for name, _, _ in LOAD],
            *[_placeholder(s.targets.get(name)) for name, _ in TARGETS])


@dash.callback(
    Output("drills-current", "data", allow_duplicate=True),
    Input({"type": "drills-show", "index": ALL}, "n_clicks"),
    prevent_initial_call=True,
)
def show_row(shows: list[int | None]) -> Any:
    """A history row's "Show". Its own callback: every redraw of the history table fires it (nobody
    clicked), and Dash keeps only the newest answer of a callback, so a redraw shared with the buttons'
    callback would drop the answer to an abort clicked just before (the page never said "aborting")."""
    trigger = ctx.triggered_id
    return int(trigger["index"]) if isinstance(trigger, dict) and any(shows) else dash.no_update


def _placeholder(value: Any) -> str:
    return "not judged" if value is None else f"{value:g}" if isinstance(value, int | float) else str(value)


@dash.callback(
    Output("drills-plan", "children"),
    Output("drills-run-result", "children"),
    Output("drills-current", "data"),
    Input("drills-preview", "n_clicks"),
    Input("drills-run", "n_clicks"),
    Input("drills-abort", "n_clicks"),
    State("drills-scenario", "value"),
    State("drills-current", "data"),
    State("drills-aim-zone", "value"),
    State("drills-aim-replica", "value"),
    State("drills-load-kind", "value"),
    State("drills-trace", "value"),
    State("drills-compress", "value"),
    State("drills-token-scale", "value"),
    *[State(f"drills-{name}", "value") for name, _, _ in LOAD],
    *[State(f"drills-target-{name}", "value") for name, _ in TARGETS],
    prevent_initial_call=True,
)
def act(_preview: int, _run: int, _abort: int, scenario_id: str | None, current: int | None,
        zone: str | None, replica: str | None, kind: str | None, trace: str | None, compress: float | None,
        token_scale: float | None, *values: Any) -> tuple[Any, Any, Any]:
    trigger = ctx.triggered_id
    try:
        api = session.client()
        if trigger == "drills-abort":
            if current is None:
                return dash.no_update, "no drill to abort", dash.no_update
            api.drill_abort(int(current))
            aborting = html.Div(f"drill {current}: aborting", id="drills-aborting")
            return dash.no_update, aborting, dash.no_update
        if not scenario_id:
            return "", "choose a scenario", dash.no_update
        load = {name: float(v) for (name, _, _), v in zip(LOAD, values[:len(LOAD)], strict=True) if v}
        targets = {name: float(v) for (name, _), v in zip(TARGETS, values[len(LOAD):], strict=True)
                   if v is not None}
        profile = _load_profile(kind, trace, compress, token_scale)
        request: dict[str, Any] = {
            "rate": None if profile else load.get("rate"), "duration_s": load.get("duration_s"),
            "fault_at_s": load.get("fault_at_s"),
            "max_tokens": int(load["max_tokens"]) if "max_tokens" in load else None,
            "capacity_deadline_s": load.get("capacity_deadline_s"), "targets": targets,
            "replicas": [replica] if replica else None, "zones": [zone] if zone else None, "load": profile}
        if trigger == "drills-preview":
            return _plan(api.drill_plan(scenario_id, **request)), "", dash.no_update
        drill_id = api.drill_run(scenario_id, **request).id
    except ApiError as exc:
        refused = html.Div(f"refused: {exc}", className="notice", id="drills-refused")
        return dash.no_update, refused, dash.no_update
    return dash.no_update, html.Div(f"drill {drill_id} started: {scenario_id}", id="drills-started"), drill_id


def _load_profile(kind: str | None, trace: str | None, compress: float | None,
                  token_scale: float | None) -> dict[str, Any] | None:
    """The request's ``load`` for a trace replay; None for a rate load (the rate field goes as is)."""
    if kind != "trace":
        return None
    profile: dict[str, Any] = {"kind": "trace", "trace": (trace or "").strip() or TRACE_DEFAULT}
    if compress:
        profile["compress"] = float(compress)
    if token_scale:
        profile["token_scale"] = float(token_scale)
    return profile


def _describe_load(load: Mapping[str, Any]) -> str:
    if load.get("kind") != "trace":
        return f"Load: Poisson at {load.get('rate')} req/s"
    return (f"Load: trace {load.get('trace')} ({load.get('path')}), {load.get('requests')} requests from "
            f"{load.get('trace_start_s')} s of the trace, {load.get('trace_window_s')} s of it compressed "
            f"{load.get('compress')}x (about {number(load.get('mean_rate'), 2)} req/s), token scale "
            f"{load.get('token_scale')}")


def _describe_aim(requested: Aim, resolved: Aim | None) -> str:
    asked = ", ".join([*requested.replicas, *requested.zones]) or "nothing named"
    hit = (resolved.how or ", ".join(resolved.replicas)) if resolved else ""
    return f"Aim: {asked} -> {hit or '–'}"


def _plan(plan: DrillPlan) -> html.Div:
    sc, pred = plan.scenario, plan.prediction
    faults = [
        html.Li(f"{f.kind} ({f.selector}, {f.duration_s} s) on {', '.join(f.targets) or 'nothing'}: "
                f"{'allowed' if f.allowed else 'refused by the safety limits'}"
                + (f" ({'; '.join(f.reasons)})" if f.reasons else ""))
        for f in plan.faults
    ]
    parts = ", ".join(f"{k} {number(v, 2)}" for k, v in (pred.get("parts") or {}).items())
    return html.Div(
        [
            html.Strong(f"Dry run of {sc.id}: {sc.rate} req/s for {sc.duration_s} s, "
                        f"fault at {sc.fault_at_s} s"),
            html.Ul(faults or [html.Li(f"action: {sc.action}")]),
            html.Div(_describe_aim(plan.targets_requested, plan.targets_resolved), id="drills-plan-aim"),
            html.Div(_describe_load(plan.load), id="drills-plan-load"),
            html.Div(f"Predicted RTO service {number(pred.get('rto_service_s'), 2)} s, RTO capacity "
                     f"{number(pred.get('rto_capacity_s'), 2)} s ({parts})"),
        ],
        id="drills-plan-body",
    )


@dash.callback(
    Output("drills-progress", "children"),
    Output("drills-report", "children"),
    Output("drills-timeline", "figure"),
    Output("drills-shown", "data"),
    Input(REFRESH, "n_intervals"),
    Input("drills-current", "data"),
    State("drills-shown", "data"),
)
def show(_: int, current: int | None, shown: list[Any] | None) -> tuple[Any, Any, Any, Any]:
    if current is None:
        return "no drill yet", "", dash.no_update, None
    try:
        report = session.client().drill(int(current))
    except ApiError as exc:
        return f"drill {current}: {exc}", "", dash.no_update, None
    status = report.status
    if shown == [current, status] and status != "running":
        return dash.no_update, dash.no_update, dash.no_update, dash.no_update  # finished and drawn
    if status == "running":
        phase = report.progress.phase if report.progress else "starting"
        fraction = report.progress.fraction if report.progress else None
        bar = html.Div([html.Strong(f"Drill {current} ({report.scenario}): running, {phase}"),
                        progress(fraction, phase)], id="drills-running")
        return bar, "", drill_timeline(report), [current, status]
    line = html.Div(f"Drill {current} ({report.scenario}): {status}", id="drills-done",
                    **figures.data_attrs(status=status))
    try:
        markdown = session.client().drill_markdown(int(current))
    except ApiError as exc:
        markdown = f"report.md: {exc}"
    return line, _report(report, markdown), drill_timeline(report), [current, status]


def _report(report: DrillReport, markdown: str) -> html.Div:
    fig, pred = report.figures, report.prediction
    checks = {c.name: c for c in report.checks}
    status = report.status
    verdict = {"passed": "PASS", "failed": "FAIL"}.get(status, status.upper())
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("figure", "measured", "predicted", "target", "result")])]
    for name in (*RTO, *RPO):
        check = checks.get(name)
        unit = " s" if name.startswith("rto") else ""
        predicted = pred.get(name)
        rows.append(html.Tr(
            [
                html.Td(name),
                html.Td("–" if fig.get(name) is None else f"{_fmt(fig.get(name))}{unit}"),
                html.Td("–" if predicted is None else f"{_fmt(predicted)}{unit}"),
                html.Td("–" if check is None else f"<= {_fmt(check.target)}{unit}"),
                html.Td("–" if check is None else ("pass" if check.ok else "FAIL"),
                        className="" if check is None else "outcome-ok" if check.ok else "outcome-error"),
            ],
            className="figure-row",
            **figures.data_attrs(figure=name, measured=fig.get(name), predicted=predicted),
        ))
    marks = ", ".join(f"{m} {_fmt(fig.get(m))} s" for m in MARKS if fig.get(m) is not None)
    aim = _describe_aim(report.targets_requested, report.targets_resolved)
    return html.Div(
        [
            html.H4(f"Verdict: {verdict}", id="drills-verdict", **figures.data_attrs(status=status)),
            html.Div(report.error or "", className="notice"),
            html.Div(aim, className="muted", id="drills-report-aim"),
            html.Div(_describe_load(report.load) if report.load else "", className="muted",
                     id="drills-report-load"),
            html.Div(f"Fault targets: {', '.join(report.fault_targets) or '–'} · "
                     f"requests sent {fig.get('requests_total', '–')}, affected "
                     f"{fig.get('requests_affected', '–')}, resumed {fig.get('requests_resumed', '–')}",
                     className="muted"),
            html.Div(f"Clock after t0: {marks or '–'}", className="muted"),
            html.Table(rows, id="drills-figures", className="data"),
            html.Details([html.Summary("Report as Markdown"),
                          html.Pre(markdown, id="drills-markdown", style={"whiteSpace": "pre-wrap"})]),
        ],
        id="drills-report-body",
    )


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


@dash.callback(
    Output("drills-history", "children"),
    Output("drills-compare-ids", "options"),
    Output("drills-history-key", "data"),
    Input(REFRESH, "n_intervals"),
    Input("drills-run-result", "children"),
    State("drills-history-key", "data"),
)
def history(_tick: int, _run: Any, drawn: str | None) -> tuple[Any, Any, Any]:
    """The history, drawn again (with the comparison's options) only when a drill starts or its record
    changes: the rows' Show buttons stay put (:mod:`dashboards.live_rows`; nothing in a row moves by
    itself)."""
    try:
        drills = session.client().drills(limit=HISTORY)
    except ApiError as exc:
        return [html.Tr(html.Td(f"drills: {exc}"))], [], None
    identity = [(d.id, d.scenario, d.status, d.started_at, d.rto_service_s, d.rto_capacity_s,
                 d.requests_failed, d.tokens_lost) for d in drills]
    rows, key = live_rows.redraw(identity, drawn, lambda: _history_rows(drills))
    options = (dash.no_update if key is dash.no_update
               else [{"label": f"#{d.id} {d.scenario} ({d.status})", "value": d.id} for d in drills])
    return rows, options, key


def _history_rows(drills: list[DrillSummary]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("id", "scenario", "status", "started (UTC)",
                                                     "RTO service", "RTO capacity", "failed requests",
                                                     "tokens lost", "")])]
    rows += [_history_row(d) for d in drills]
    if not drills:
        rows.append(html.Tr(html.Td("no drill has run yet")))
    return rows


def _history_row(d: DrillSummary) -> html.Tr:
    return html.Tr(
        [
            html.Td(str(d.id)), html.Td(d.scenario), html.Td(d.status), html.Td(when(d.started_at)),
            html.Td(_seconds(d.rto_service_s)), html.Td(_seconds(d.rto_capacity_s)),
            html.Td(_count(d.requests_failed)), html.Td(_count(d.tokens_lost)),
            html.Td(html.Button("Show", id={"type": "drills-show", "index": d.id}, n_clicks=0,
                                className="btn btn-small")),
        ],
        className="drill-row", **figures.data_attrs(drill=d.id, status=d.status),
    )


def _seconds(value: Any) -> str:
    return "–" if value is None else f"{value:.2f} s"


def _count(value: Any) -> str:
    return "–" if value is None else str(value)


@dash.callback(
    Output("drills-comparison", "children"),
    Input("drills-compare", "n_clicks"),
    State("drills-compare-ids", "value"),
    prevent_initial_call=True,
)
def compare(_: int, ids: list[int] | None) -> Any:
    if not ids or len(ids) < 2:
        return html.Div("pick at least two drills", className="notice")
    try:
        table = session.client().drill_compare([int(i) for i in ids])
    except ApiError as exc:
        return html.Div(f"compare: {exc}", className="notice")
    return _comparison(table)


def _comparison(table: DrillComparison) -> html.Table:
    head = [html.Th("figure")] + [html.Th(f"#{c.id} {c.scenario} ({c.status})") for c in table.columns]
    rows: list[Any] = [html.Tr(head)]
    for row in table.rows:
        unit = f" {row.unit}" if row.unit else ""
        rows.append(html.Tr([html.Td(row.label)] + [
            html.Td("–" if v is None else f"{_fmt(v)}{unit}") for v in row.values]))
    return html.Table(rows, id="drills-compare-table", className="data")
