"""The Chaos page's "Slice experiments" section: chaos on a coloured share of traffic against a same-size
control colour, measured live, stopping itself on a deviation (``/api/v1/experiments/slices``).

An operator's form starts one (share, fault and its parameter, duration, check interval, bounds); the
running or latest one shows its status, why and when it stopped, its checks over time and both sides'
figures with each difference and its 95% interval; an abort (confirmed) stops the running one; a short
history lists the past ones. The run lives in the control plane: the section reads it on the refresh clock,
so a closed browser loses nothing. Viewers see everything with every control disabled; the API refuses
their calls anyway.

The Chaos page imports this module (which registers its callbacks) and places :func:`section`.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import Input, Output, State, ctx, dcc, html

from controlplane.client import ApiError, ControlPlaneClient, SliceExperiment
from dashboards import session
from dashboards.shell import REFRESH
from dashboards.slice_figures import (
    FAULTS,
    checks_figure,
    history_rows,
    is_running,
    shown_id,
    sides_rows,
    start_request,
    summary,
)

HISTORY = 10
CONFIRM = "Abort the running slice experiment now: its fault is reverted and its colours cleared?"
# (component id, label, default, step) of the form's number fields after the fault's parameter
FIELDS = (
    ("sx-duration", "Duration (s)", 60, 1),
    ("sx-interval", "Check every (s)", 1, 0.1),
    ("sx-max-error", "Max error increase (pp)", 5, 0.5),
    ("sx-max-ratio", "Max latency ratio (×)", 1.5, 0.1),
)


def section(operate: bool) -> html.Div:
    """The section's layout; ``operate``: whether the user's role may start and abort."""
    return html.Div(
        [
            html.H3("Slice experiments"),
            html.Div("Chaos on a coloured share of traffic against a control colour of the same share, "
                     "compared every check; the run stops itself when the experiment side deviates beyond "
                     "the bounds. Requests in neither colour must never fail.", className="muted"),
            html.Div(
                className="grid2",
                children=[
                    html.Div(className="panel", children=[html.H4("Start one"), _form(operate)]),
                    html.Div(className="panel", children=[
                        html.H4("Running or latest"),
                        html.Div(id="sx-summary"),
                        html.Div(className="form-row", children=[
                            html.Button("Abort experiment", id="sx-abort", n_clicks=0,
                                        className="btn btn-danger", disabled=True),
                        ]),
                        html.Div(id="sx-abort-result"),
                    ]),
                ],
            ),
            html.Div(dcc.Graph(id="sx-checks", config={"displaylogo": False}), className="panel"),
            html.Div(className="panel", children=[
                html.H4("Both sides: experiment against control (differences: experiment minus control)"),
                html.Table(id="sx-sides", className="data"),
            ]),
            html.Div(className="panel", children=[
                html.H4("History"),
                html.Table(id="sx-history", className="data"),
            ]),
            dcc.ConfirmDialog(id="sx-abort-confirm", message=CONFIRM),
            dcc.Store(id="sx-shown", data=None),
            dcc.Store(id="sx-drawn", data=None),
        ],
        id="sx-section",
    )


def _form(operate: bool) -> html.Div:
    kind = "error_rate"
    _, label, default = FAULTS[kind]
    return html.Div(
        [
            html.Div("" if operate else "Your role may not start or abort slice experiments: the controls "
                     "are disabled.", className="notice", id="sx-role-note"),
            html.Div(className="form-row", children=[
                _number("sx-share", "Share of traffic (%, each side)", 10, 0.5, operate),
                html.Div([html.Label("Fault"),
                          dcc.Dropdown(id="sx-fault", options=list(FAULTS), value=kind, clearable=False,
                                       disabled=not operate, style={"minWidth": "11rem"})]),
                _number("sx-param", label, default, 0.01, operate, label_id="sx-param-label"),
            ]),
            html.Div([_number(cid, text, value, step, operate) for cid, text, value, step in FIELDS],
                     className="form-row"),
            html.Div(className="form-row", children=[
                html.Button("Start slice experiment", id="sx-start", n_clicks=0, className="btn btn-danger",
                            disabled=not operate),
            ]),
            html.Div(id="sx-start-result"),
        ]
    )


def _number(cid: str, label: str, value: float, step: float, operate: bool, *,
            label_id: str | None = None) -> html.Div:
    name = html.Label(label, id=label_id) if label_id else html.Label(label)
    return html.Div([name, dcc.Input(id=cid, type="number", value=value, min=0, step=step,
                                     disabled=not operate, style={"width": "7rem"})])


def _note(text: str, cid: str) -> html.Div:
    """An error as a note (the API's message), never a stack trace."""
    return html.Div(text, className="notice", id=cid)


# ---- live ----------------------------------------------------------------------------------------
@dash.callback(
    Output("sx-param-label", "children"),
    Output("sx-param", "value"),
    Input("sx-fault", "value"),
)
def fault_param(fault: str | None) -> tuple[str, float]:
    """The parameter field follows the fault: a probability for error_rate, seconds for the delays."""
    _, label, default = FAULTS.get(fault or "", FAULTS["error_rate"])
    return label, default


@dash.callback(
    Output("sx-summary", "children"),
    Output("sx-checks", "figure"),
    Output("sx-sides", "children"),
    Output("sx-history", "children"),
    Output("sx-shown", "data"),
    Output("sx-drawn", "data"),
    Output("sx-abort", "disabled"),
    Output("sx-start", "disabled"),
    Input(REFRESH, "n_intervals"),
    Input("sx-start-result", "children"),
    Input("sx-abort-result", "children"),
    State("sx-drawn", "data"),
)
def live(_: int, _start: Any, _abort: Any, drawn: list[Any] | None) -> tuple[Any, ...]:
    operate = session.can_operate()
    try:
        api = session.client()
    except ApiError as exc:
        return _unread(exc, operate)
    return show(api, operate, drawn)


def show(api: ControlPlaneClient, operate: bool, drawn: list[Any] | None,
         now: float | None = None) -> tuple[Any, ...]:
    """The section's outputs: summary, figure, sides table, history, the shown id, what is drawn, abort
    disabled, start disabled. An ended run drawn already keeps its figure (and the user's zoom)."""
    try:
        listing = api.slice_experiments(limit=HISTORY)
        shown_at = shown_id(listing)
        experiment: SliceExperiment | None = None if shown_at is None else api.slice_experiment(shown_at)
    except ApiError as exc:
        return _unread(exc, operate)
    key = None if experiment is None else [experiment.id, experiment.status, len(experiment.checks)]
    figure: Any = checks_figure(experiment)
    if key is not None and key == drawn and not is_running(experiment):
        figure = dash.no_update
    running = is_running(experiment)
    return (summary(experiment, now=time.time() if now is None else now), figure, sides_rows(experiment),
            history_rows(listing), None if experiment is None else experiment.id, key,
            not (operate and running), not operate or running)


def _unread(exc: ApiError, operate: bool) -> tuple[Any, ...]:
    """What the section shows when the API cannot be read: a note; the rest as it was, abort disabled."""
    note = _note(f"slice experiments: {exc}", "sx-read-error")
    return (note, dash.no_update, dash.no_update, dash.no_update, dash.no_update, dash.no_update, True,
            not operate)


# ---- actions -------------------------------------------------------------------------------------
@dash.callback(
    Output("sx-start-result", "children"),
    Input("sx-start", "n_clicks"),
    State("sx-share", "value"),
    State("sx-fault", "value"),
    State("sx-param", "value"),
    *[State(cid, "value") for cid, _, _, _ in FIELDS],
    prevent_initial_call=True,
)
def start(n_clicks: int, *values: Any) -> Any:
    if not n_clicks:
        return dash.no_update
    return start_experiment(session.client(), *values)


def start_experiment(api: ControlPlaneClient, *values: Any) -> html.Div:
    """Start one with the form's values (share, fault, param, duration, interval, max error pp, max
    ratio); a note for what the form or the API refuses."""
    try:
        request = start_request(*values)
        started = api.slice_experiment_start(**request)
    except (ApiError, ValueError) as exc:
        return _note(f"start refused: {exc}", "sx-start-refused")
    return html.Div(f"slice experiment {started.id} started ({started.status}): {request['fault']} on "
                    f"{request['share'] * 100:g}% against a control of the same share", className="muted",
                    id="sx-started")


@dash.callback(
    Output("sx-abort-confirm", "displayed"),
    Input("sx-abort", "n_clicks"),
    prevent_initial_call=True,
)
def confirm(n_clicks: int) -> bool:
    return bool(n_clicks) and ctx.triggered_id == "sx-abort"


@dash.callback(
    Output("sx-abort-result", "children"),
    Input("sx-abort-confirm", "submit_n_clicks"),
    State("sx-shown", "data"),
    prevent_initial_call=True,
)
def abort(submitted: int | None, shown: int | None) -> Any:
    if not submitted:
        return dash.no_update
    return abort_experiment(session.client(), shown)


def abort_experiment(api: ControlPlaneClient, experiment_id: int | None) -> html.Div:
    if experiment_id is None:
        return _note("abort: no slice experiment to abort", "sx-abort-refused")
    try:
        done = api.slice_experiment_abort(int(experiment_id))
    except ApiError as exc:
        return _note(f"abort refused: {exc}", "sx-abort-refused")
    return html.Div(f"slice experiment {done.id}: " + ("aborting: its fault is reverted and its colours "
                    "cleared" if done.aborting else "not aborting"), className="muted", id="sx-aborted")
