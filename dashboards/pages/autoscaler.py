"""Autoscaler: replicas against load with the decision markers, the decision log with every record's reasons,
the policy editor (``PUT /api/v1/autoscaler/config``), pause and resume, the schedule
(:mod:`dashboards.schedule_panel`: cron windows with their next start and end, and a JSON editor that
replaces them through ``PUT /api/v1/autoscaler/windows``) and the what-if simulator
(:mod:`dashboards.whatif_panel`: a background job in the control plane, followed with a progress bar, then
the policies' comparison).

Viewers see everything with every control disabled; the API refuses their calls anyway.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, dcc, html

from controlplane.client import AUTOSCALER_TARGETS, ApiError, AutoscalerPolicy, AutoscalerStatus, Decision
from dashboards import figures, schedule_panel, session, whatif_panel
from dashboards.figures import autoscaler_timeline, decision_reason, empty, number, profile_drift_text, when
from dashboards.shell import REFRESH

DECISIONS = 200  # decision records drawn and listed
LOG_ROWS = 50
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


def layout(**_: Any) -> html.Div:
    operate = session.can_operate()
    config: AutoscalerPolicy | None = None
    error = ""
    try:
        config = session.client().autoscaler_status().config
    except ApiError as exc:
        error = f"autoscaler: {exc}"
    following = whatif_panel.running_simulation()
    windows, unread = schedule_panel.current_windows()
    error = error or unread
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
            schedule_panel.section(windows, operate),
            html.Div(
                className="grid2",
                children=[
                    html.Div(className="panel", children=[html.H3("Policy"), _editor(config, operate)]),
                    whatif_panel.section(operate, following),
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
        ("as-drift", "replicas vs profile", profile_drift_text(last)),
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

