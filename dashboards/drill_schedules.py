"""The drills page's schedules panel: cron schedules of drills (``/api/v1/drills/schedules``) listed with
their aim and load, created, edited (pick one to fill the form), paused, resumed and deleted. A schedule
takes what a run takes: numeric overrides, the replica a fault hits and the Azure trace replayed."""

from __future__ import annotations

from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from controlplane.client import AZURE_TRACE, ApiError, DrillSchedule, Scenario
from dashboards import figures, live_rows, session
from dashboards.figures import number_input, scenario_options
from dashboards.shell import REFRESH

TRACE_DEFAULT = AZURE_TRACE  # the trace shipped with the control plane (or its $CONTROLPLANE_AZURE_TRACE)
SCHEDULE_OVERRIDES = ("rate", "duration_s", "fault_at_s", "max_tokens")
SCHEDULE_AIM = ("drills-sched-replica", "drills-sched-trace", "drills-sched-compress")  # (replica, trace, x)


# ---- schedules ------------------------------------------------------------------------------------
def schedule_form(scenarios: list[Scenario], fleet: list[tuple[str, str]], operate: bool) -> html.Div:
    first = scenarios[0].id if scenarios else None
    return html.Div(
        [
            html.Div(className="form-row", children=[
                html.Div([html.Label("Edit (empty: create a new one)"), dcc.Dropdown(
                    id="drills-sched-pick", options=[], disabled=not operate, style={"minWidth": "14rem"})]),
                html.Div([html.Label("Name"), dcc.Input(id="drills-sched-name", type="text", value="",
                                                        disabled=not operate, style={"width": "12rem"})]),
                html.Div([html.Label("Scenario"), dcc.Dropdown(
                    id="drills-sched-scenario", options=scenario_options(scenarios), value=first,
                    clearable=False, disabled=not operate, style={"minWidth": "16rem"})]),
                html.Div([html.Label("Cron (min hour day month weekday)"), dcc.Input(
                    id="drills-sched-cron", type="text", value="0 3 * * 1", disabled=not operate)]),
            ]),
            html.Div(className="form-row", children=[
                *[number_input(f"drills-sched-{name}", f"{name} (empty: scenario's)", None, operate)
                  for name in SCHEDULE_OVERRIDES],
            ]),
            html.Div(className="form-row", children=[
                html.Div([html.Label("Replica (empty: the busiest at t0)"), dcc.Dropdown(
                    id="drills-sched-replica", value=None, placeholder="busiest at t0", disabled=not operate,
                    options=[{"label": f"{rid} ({zone})", "value": rid} for rid, zone in fleet],
                    style={"minWidth": "14rem"})]),
                html.Div([html.Label("Load"), dcc.Checklist(
                    id="drills-sched-trace", value=[], inline=True,
                    options=[{"label": "replay the Azure trace", "value": TRACE_DEFAULT,
                              "disabled": not operate}])]),
                number_input("drills-sched-compress", "Compress (x faster)", None, operate),
                html.Button("Create", id="drills-sched-create", n_clicks=0, className="btn",
                            disabled=not operate),
                html.Button("Save changes", id="drills-sched-save", n_clicks=0, className="btn",
                            disabled=not operate),
            ]),
        ]
    )


@dash.callback(
    Output("drills-schedules", "children"),
    Output("drills-sched-pick", "options"),
    Output("drills-schedules-key", "data"),
    Output("drills-schedules-live", "data"),
    Input(REFRESH, "n_intervals"),
    Input("drills-sched-result", "children"),
    State("drills-schedules-key", "data"),
)
def schedules(_tick: int, _result: Any, drawn: str | None) -> tuple[Any, Any, Any, Any]:
    """The schedules, drawn again (with the pick's options) only when a schedule or the role changes: the
    rows' buttons stay put (:mod:`dashboards.live_rows`); the next run, which moves at each firing, goes to
    its cell."""
    operate = session.can_operate()
    try:
        found = session.client().drill_schedules()
    except ApiError as exc:
        return [html.Tr(html.Td(f"schedules: {exc}"))], [], None, {}
    identity = (operate, [(s.id, s.name, s.scenario_id, s.cron, s.timezone, s.paused, s.overrides,
                           s.created_by) for s in found])
    rows, key = live_rows.redraw(identity, drawn, lambda: _schedule_rows(found, operate))
    options = dash.no_update if key is dash.no_update else [{"label": s.name, "value": s.id} for s in found]
    return rows, options, key, live_rows.live({"drills-sched-next": {s.id: _next_run(s) for s in found}})


def _schedule_rows(found: list[DrillSchedule], operate: bool) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("name", "scenario", "cron", "overrides", "aim; load",
                                                     "next run", "created by", "")])]
    for s in found:
        numbers = {k: v for k, v in s.overrides.items() if isinstance(v, int | float)}
        overrides = ", ".join(f"{k}={v:g}" for k, v in numbers.items()) or "–"
        buttons = [html.Button(label, id={"type": "drills-sched-act", "index": f"{verb}:{s.id}"},
                               n_clicks=0, className="btn btn-small", disabled=not operate)
                   for verb, label in (("resume", "Resume") if s.paused else ("pause", "Pause"),
                                       ("delete", "Delete"))]
        rows.append(html.Tr(
            [html.Td(s.name), html.Td(s.scenario_id), html.Td(f"{s.cron} ({s.timezone})"),
             html.Td(overrides), html.Td(s.aim_and_load, className="schedule-aim"),
             live_rows.cell("drills-sched-next", s.id, _next_run(s), className="schedule-next"),
             html.Td(s.created_by), html.Td(buttons)],
            className="schedule-row",
            **figures.data_attrs(name=s.name, paused=str(s.paused).lower(), aim=s.aim_and_load),
        ))
    if not found:
        rows.append(html.Tr(html.Td("no schedule", id="drills-no-schedule")))
    return rows


def _next_run(schedule: DrillSchedule) -> str:
    return "paused" if schedule.paused else str(schedule.next_run_time)


live_rows.fill_cells("drills-schedules-live", "drills-sched-next")


@dash.callback(
    Output("drills-sched-name", "value"),
    Output("drills-sched-scenario", "value"),
    Output("drills-sched-cron", "value"),
    *[Output(f"drills-sched-{name}", "value") for name in SCHEDULE_OVERRIDES],
    *[Output(cid, "value") for cid in SCHEDULE_AIM],
    Input("drills-sched-pick", "value"),
    prevent_initial_call=True,
)
def pick(schedule_id: str | None) -> tuple[Any, ...]:
    if not schedule_id:
        return (dash.no_update,) * (3 + len(SCHEDULE_OVERRIDES) + len(SCHEDULE_AIM))
    try:
        s = session.client().drill_schedule(schedule_id)
    except ApiError:
        return (dash.no_update,) * (3 + len(SCHEDULE_OVERRIDES) + len(SCHEDULE_AIM))
    overrides = s.overrides
    load = overrides.get("load") or {}
    trace = [load["trace"]] if load.get("kind") == "trace" else []
    return (s.name, s.scenario_id, s.cron, *[overrides.get(n) for n in SCHEDULE_OVERRIDES],
            (overrides.get("replicas") or [None])[0], trace, load.get("compress"))


@dash.callback(
    Output("drills-sched-result", "children"),
    Input("drills-sched-create", "n_clicks"),
    Input("drills-sched-save", "n_clicks"),
    State("drills-sched-pick", "value"),
    State("drills-sched-name", "value"),
    State("drills-sched-scenario", "value"),
    State("drills-sched-cron", "value"),
    *[State(f"drills-sched-{name}", "value") for name in SCHEDULE_OVERRIDES],
    *[State(cid, "value") for cid in SCHEDULE_AIM],
    prevent_initial_call=True,
)
def schedule_action(_create: int, _save: int, picked: str | None, name: str | None,
                    scenario_id: str | None, cron: str | None, *values: Any) -> Any:
    """Create, or save the schedule picked. The rows' buttons have their own callback: every redraw of the
    table fires theirs, and Dash keeps only a callback's newest answer, so a redraw sharing this one would
    drop the answer to a save clicked just before it."""
    trigger = ctx.triggered_id
    numbers, (replica, trace, compress) = values[:len(SCHEDULE_OVERRIDES)], values[len(SCHEDULE_OVERRIDES):]
    overrides = {n: float(v) for n, v in zip(SCHEDULE_OVERRIDES, numbers, strict=True) if v is not None}
    aim = _schedule_aim(replica, trace, compress)
    try:
        api = session.client()
        if not name or not scenario_id or not cron:
            return "give a name, a scenario and a cron expression"
        if trigger == "drills-sched-save":
            if not picked:
                return "pick the schedule to edit"
            edited = api.edit_drill_schedule(picked, name=name, scenario_id=scenario_id, cron=cron,
                                             overrides=overrides, **aim)
            return f"schedule {edited.name} saved; next run {edited.next_run_time or 'paused'}"
        created = api.add_drill_schedule(name=name, scenario_id=scenario_id, cron=cron, overrides=overrides,
                                         **aim)
    except ApiError as exc:
        return html.Span(f"refused: {exc}", className="notice")
    return f"schedule {created.name} created; next run {created.next_run_time}"


@dash.callback(
    Output("drills-sched-result", "children", allow_duplicate=True),
    Input({"type": "drills-sched-act", "index": ALL}, "n_clicks"),
    prevent_initial_call=True,
)
def schedule_row_action(acts: list[int | None]) -> Any:
    """A row's pause, resume or delete."""
    trigger = ctx.triggered_id
    if not isinstance(trigger, dict) or not any(acts):
        return dash.no_update  # the table was redrawn; nobody clicked
    verb, _, schedule_id = str(trigger["index"]).partition(":")
    try:
        api = session.client()
        if verb == "delete":
            api.delete_drill_schedule(schedule_id)
            return f"schedule {schedule_id} deleted"
        change = api.pause_drill_schedule if verb == "pause" else api.resume_drill_schedule
        changed = change(schedule_id)
    except ApiError as exc:
        return html.Span(f"refused: {exc}", className="notice")
    return f"schedule {changed.name}: {'paused' if changed.paused else 'resumed'}"


def _schedule_aim(replica: str | None, trace: list[str] | None, compress: float | None) -> dict[str, Any]:
    """The form's aim and load as the API takes them; empty fields go back to the scenario's own (an edit
    with no replica removes the aim, with the trace unticked goes back to Poisson arrivals)."""
    load: dict[str, Any] = {"kind": "rate"}
    if trace:
        load = {"kind": "trace", "trace": trace[0], **({} if compress is None else {"compress": compress})}
    return {"replicas": [replica] if replica else [], "load": load}
