"""Rollouts: the model versions (register one), the traffic split now (stable against the canary, and a slice
experiment's colours), the running or latest release with its timeline (the canary's share over time, each
step's analysis marked by its decision) and every step's analysis (both sides' figures per metric, the test,
p-value, difference and verdict), the operators' controls (start a canary; promote and abort, each
confirmed; pause and resume) and the history of releases.

A canary runs in the control plane (``POST /api/v1/rollouts/canary`` answers the release at once); the page
reads ``GET /api/v1/rollouts`` on the refresh clock, so a closed browser loses nothing. Viewers see
everything with every control disabled; the API refuses their calls anyway.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, dcc, html

from controlplane.client import ApiError, ControlPlaneClient, ReleaseView
from dashboards import session
from dashboards.figures import number_input
from dashboards.rollout_figures import (
    analysis_tables,
    history_rows,
    is_live,
    parse_steps,
    release_summary,
    release_timeline,
    shown_release,
    split_figure,
    split_line,
    version_rows,
)
from dashboards.shell import REFRESH

HISTORY = 20
ACTIONS = ("promote", "abort", "pause", "resume")
# (field of POST /api/v1/rollouts/canary, label, default) of the start form besides version and steps
POLICY = (
    ("interval_s", "Step interval (s)", 60.0),
    ("max_extensions", "Max extensions", 3),
    ("replicas", "Canary replicas", 1),
    ("min_samples", "Min samples / side", 30),
)
CONFIRM = {
    "promote": "Promote the canary now: skip its remaining steps and move the whole fleet to its version?",
    "abort": "Abort the canary now: its share goes back to 0 and its replicas drain?",
}


def layout(**_: Any) -> html.Div:
    operate = session.can_operate()
    return html.Div(
        [
            html.H2("Rollouts"),
            html.Div(
                "" if operate else "Your role may not register versions or steer releases: the controls "
                "are disabled.",
                className="notice",
                id="ro-role-note",
            ),
            html.Div(
                className="grid2",
                children=[
                    html.Div(className="panel", children=[
                        html.H3("Versions"),
                        html.Table(id="ro-versions", className="data"),
                        _register_form(operate),
                    ]),
                    html.Div(className="panel", children=[
                        html.H3("Traffic split"),
                        dcc.Graph(id="ro-split", config={"displaylogo": False}),
                        html.Div(id="ro-split-line", className="muted"),
                    ]),
                ],
            ),
            html.Div(
                className="grid2",
                children=[
                    html.Div(className="panel", children=[
                        html.H3("Release"),
                        html.Div(id="ro-release"),
                        _release_controls(operate),
                    ]),
                    html.Div(className="panel", children=[html.H3("Start a canary"), _canary_form(operate)]),
                ],
            ),
            html.Div(dcc.Graph(id="ro-timeline", config={"displaylogo": False}), className="panel"),
            html.Div(className="panel", children=[
                html.H3("Step analyses (newest first): stable against canary over the same window"),
                html.Div(id="ro-analyses"),
            ]),
            html.Div(className="panel", children=[
                html.H3("History"),
                html.Table(id="ro-history", className="data"),
            ]),
            *[dcc.ConfirmDialog(id=f"ro-{action}-confirm", message=message)
              for action, message in CONFIRM.items()],
            dcc.Store(id="ro-release-id", data=None),
            dcc.Store(id="ro-drawn", data=None),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/rollouts", name="Rollouts", order=6, title="Rollouts · LLM SRE console", layout=layout
)


def _register_form(operate: bool) -> html.Div:
    return html.Div(
        [
            html.Div(className="form-row", children=[
                html.Div([html.Label("Name (a-z, 0-9, '.', '-')"),
                          dcc.Input(id="ro-new-name", type="text", disabled=not operate,
                                    style={"width": "8rem"})]),
                html.Div([html.Label("Model (bundled name or Hugging Face folder)"),
                          dcc.Input(id="ro-new-model", type="text", disabled=not operate,
                                    style={"width": "16rem"})]),
                html.Div([html.Label("Notes"),
                          dcc.Input(id="ro-new-notes", type="text", disabled=not operate,
                                    style={"width": "14rem"})]),
                html.Button("Register version", id="ro-add", n_clicks=0, className="btn",
                            disabled=not operate),
            ]),
            html.Div(id="ro-add-result"),
        ],
        style={"marginTop": ".8rem"},
    )


def _release_controls(operate: bool) -> html.Div:
    return html.Div(
        [
            html.Div(className="form-row", children=[
                html.Div([html.Label("Reason (audited)"),
                          dcc.Input(id="ro-reason", type="text", disabled=not operate,
                                    style={"width": "18rem"})]),
            ]),
            html.Div(className="form-row", children=[
                html.Button("Promote", id="ro-promote", n_clicks=0, className="btn", disabled=True),
                html.Button("Abort", id="ro-abort", n_clicks=0, className="btn btn-danger", disabled=True),
                html.Button("Pause", id="ro-pause", n_clicks=0, className="btn btn-small", disabled=True),
                html.Button("Resume", id="ro-resume", n_clicks=0, className="btn btn-small", disabled=True),
            ]),
            html.Div(id="ro-action-result"),
        ]
    )


def _canary_form(operate: bool) -> html.Div:
    return html.Div(
        [
            html.Div(className="form-row", children=[
                html.Div([html.Label("Version"),
                          dcc.Dropdown(id="ro-canary-version", options=[], value=None, disabled=not operate,
                                       placeholder="a registered version", style={"minWidth": "12rem"})]),
                html.Div([html.Label("Steps (% of traffic; the last is 100)"),
                          dcc.Input(id="ro-steps", type="text", value="5,20,50,100", disabled=not operate,
                                    style={"width": "12rem"})]),
            ]),
            html.Div([number_input(f"ro-{name}", label, default, operate) for name, label, default in POLICY],
                     className="form-row"),
            html.Div(className="form-row", children=[
                html.Button("Start canary", id="ro-start", n_clicks=0, className="btn", disabled=not operate),
            ]),
            html.Div(id="ro-start-result"),
        ]
    )


def _refused(what: str, exc: ApiError | ValueError, cid: str) -> html.Div:
    """An error as a note (the API's message), never a stack trace."""
    return html.Div(f"{what} refused: {exc}", className="notice", id=cid)


# ---- live ----------------------------------------------------------------------------------------
@dash.callback(
    Output("ro-versions", "children"),
    Output("ro-canary-version", "options"),
    Input(REFRESH, "n_intervals"),
    Input("ro-add-result", "children"),
)
def versions(*_: Any) -> tuple[Any, Any]:
    try:
        view = session.client().versions()
    except ApiError as exc:
        return [html.Tr(html.Td(f"versions: {exc}"))], []
    options = [{"label": f"{v.name} ({v.model})", "value": v.name} for v in view.versions
               if v.name != view.current]
    return version_rows(view), options


@dash.callback(
    Output("ro-split", "figure"),
    Output("ro-split-line", "children"),
    Output("ro-release", "children"),
    Output("ro-timeline", "figure"),
    Output("ro-analyses", "children"),
    Output("ro-history", "children"),
    Output("ro-release-id", "data"),
    Output("ro-drawn", "data"),
    *[Output(f"ro-{action}", "disabled") for action in ACTIONS],
    Output("ro-start", "disabled"),
    Input(REFRESH, "n_intervals"),
    Input("ro-action-result", "children"),
    Input("ro-start-result", "children"),
    State("ro-drawn", "data"),
)
def release(_: int, _action: Any, _start: Any, drawn: list[Any] | None) -> tuple[Any, ...]:
    operate = session.can_operate()
    try:
        view = session.client().rollouts(limit=HISTORY)
    except ApiError as exc:
        note = html.Div(f"rollouts: {exc}", className="notice")
        return (dash.no_update, "", note, dash.no_update, dash.no_update, dash.no_update, dash.no_update,
                dash.no_update, *[True] * len(ACTIONS), not operate)
    shown = shown_release(view)
    key = None if shown is None else [shown.id, shown.outcome, len(shown.steps)]
    figure: Any
    analyses: Any
    if key is not None and key == drawn and not is_live(shown):
        figure, analyses = dash.no_update, dash.no_update  # ended and drawn already: keep the zoom
    else:
        figure, analyses = release_timeline(shown), analysis_tables(shown)
    return (split_figure(view), split_line(view), release_summary(shown), figure, analyses,
            history_rows(view.history), None if shown is None else shown.id, key,
            *_disabled(shown, operate), not operate or is_live(shown))


def _disabled(release: ReleaseView | None, operate: bool) -> tuple[bool, ...]:
    """promote, abort, pause, resume: only on a live release, pause while it runs, resume while paused."""
    live = operate and is_live(release)
    outcome = release.outcome if release is not None else ""
    return not live, not live, not (live and outcome == "running"), not (live and outcome == "paused")


# ---- actions -------------------------------------------------------------------------------------
@dash.callback(
    Output("ro-add-result", "children"),
    Input("ro-add", "n_clicks"),
    State("ro-new-name", "value"),
    State("ro-new-model", "value"),
    State("ro-new-notes", "value"),
    prevent_initial_call=True,
)
def add_version(_: int, name: str | None, model: str | None, notes: str | None) -> Any:
    name, model = (name or "").strip(), (model or "").strip()
    if not name or not model:
        return html.Div("give the version a name and a model", className="notice", id="ro-add-refused")
    try:
        added = session.client().add_version(name, model, (notes or "").strip())
    except ApiError as exc:
        return _refused("register", exc, "ro-add-refused")
    return html.Div(f"registered {added.name}: {added.model}", className="muted", id="ro-added")


@dash.callback(
    Output("ro-start-result", "children"),
    Input("ro-start", "n_clicks"),
    State("ro-canary-version", "value"),
    State("ro-steps", "value"),
    *[State(f"ro-{name}", "value") for name, _, _ in POLICY],
    prevent_initial_call=True,
)
def start(_: int, version: str | None, steps: str | None, *values: Any) -> Any:
    return start_canary(session.client(), version, steps, values)


def start_canary(api: ControlPlaneClient, version: str | None, steps: str | None,
                 values: tuple[Any, ...]) -> Any:
    """Start a canary of ``version`` with the form's steps and policy (an empty field: the API's default)."""
    if not version:
        return html.Div("choose a version", className="notice", id="ro-start-refused")
    try:
        policy: dict[str, Any] = {"steps": parse_steps(steps)}
    except ValueError as exc:
        return _refused("start", exc, "ro-start-refused")
    for (name, _, default), value in zip(POLICY, values, strict=True):
        if value is not None and value != "":
            policy[name] = type(default)(value)
    try:
        started = api.start_canary(version, **policy)
    except ApiError as exc:
        return _refused("start", exc, "ro-start-refused")
    return html.Div(f"release {started.id} started: canary of {started.version}", className="muted",
                    id="ro-started")


@dash.callback(
    *[Output(f"ro-{action}-confirm", "displayed") for action in CONFIRM],
    *[Input(f"ro-{action}", "n_clicks") for action in CONFIRM],
    prevent_initial_call=True,
)
def confirm(*_: int) -> tuple[bool, ...]:
    return tuple(ctx.triggered_id == f"ro-{action}" for action in CONFIRM)


@dash.callback(
    Output("ro-action-result", "children"),
    Input("ro-promote-confirm", "submit_n_clicks"),
    Input("ro-abort-confirm", "submit_n_clicks"),
    Input("ro-pause", "n_clicks"),
    Input("ro-resume", "n_clicks"),
    State("ro-release-id", "data"),
    State("ro-reason", "value"),
    prevent_initial_call=True,
)
def act(*args: Any) -> Any:
    *clicks, release_id, reason = args
    trigger = str(ctx.triggered_id or "")
    action = trigger.removeprefix("ro-").removesuffix("-confirm")
    if action not in ACTIONS or not any(clicks):
        return dash.no_update
    return release_action(session.client(), release_id, action, reason)


def release_action(api: ControlPlaneClient, release_id: int | None, action: str, reason: str | None) -> Any:
    if release_id is None:
        return html.Div(f"{action}: no release to {action}", className="notice", id="ro-action-refused")
    try:
        done = api.release_action(int(release_id), action, (reason or "").strip())
    except ApiError as exc:
        return _refused(action, exc, "ro-action-refused")
    return html.Div(f"release {done.id} ({done.version}): {action} accepted, now {done.outcome}",
                    className="muted", id="ro-action-done")
