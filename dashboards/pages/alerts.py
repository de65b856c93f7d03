"""Alerts: the rules (enable or disable them, operators only), the pending and firing alerts, and the history
of transitions with the action each firing took.

Viewers see everything with the switches disabled; the API refuses their calls anyway.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from controlplane.client import ActiveAlert, AlertRule, AlertTransition, ApiError
from dashboards import live_rows, session
from dashboards.figures import number, when
from dashboards.shell import REFRESH, alert_line

HISTORY = 100


def layout(**_: Any) -> html.Div:
    operate = session.can_operate()
    return html.Div(
        [
            html.H2("Alerts"),
            html.Div(
                "" if operate else "Your role may not switch rules: the controls are disabled.",
                className="notice",
                id="al-role-note",
            ),
            html.Div(className="panel", children=[html.H3("Pending and firing"),
                                                  html.Table(id="al-active", className="data")]),
            html.Div(className="panel", children=[html.H3("Rules"),
                                                  html.Table(id="al-rules", className="data"),
                                                  dcc.Store(id="al-rules-key"),
                                                  dcc.Store(id="al-rules-live"),
                                                  html.Div(id="al-switch-result", className="muted")]),
            html.Div(className="panel", children=[html.H3("History (newest first) and the actions taken"),
                                                  html.Table(id="al-history", className="data")]),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/alerts", name="Alerts", order=5, title="Alerts · LLM SRE console", layout=layout
)


def _data(**attrs: Any) -> dict[str, Any]:
    return {f"data-{k}": str(v) for k, v in attrs.items()}


@dash.callback(
    Output("al-active", "children"),
    Output("al-rules", "children"),
    Output("al-rules-key", "data"),
    Output("al-rules-live", "data"),
    Output("al-history", "children"),
    Input(REFRESH, "n_intervals"),
    Input("al-switch-result", "children"),
    State("al-rules-key", "data"),
)
def refresh(_tick: int, _switched: Any, drawn: str | None) -> tuple[Any, Any, Any, Any, Any]:
    """The rules table is drawn again only when a rule's definition, its switch or the role changes (the
    switches stay put: :mod:`dashboards.live_rows`); its counts and last evaluation go to their cells."""
    operate = session.can_operate()
    try:
        api = session.client()
        rules = api.alert_rules()
        active = api.active_alerts()
        history = api.alert_history(limit=HISTORY)
    except ApiError as exc:
        error = [html.Tr(html.Td(f"alerts: {exc}"))]
        return error, error, None, {}, error
    identity = (operate, [(r.name, r.summary, _condition(r), r.for_s, r.severity, r.action, r.enabled)
                          for r in rules])
    table, key = live_rows.redraw(identity, drawn, lambda: _rules(rules, operate))
    live = live_rows.live({"al-counts": {r.name: _counts(r) for r in rules},
                           "al-last": {r.name: _last_eval(r) for r in rules}})
    return _active(active), table, key, live, _history(history)


def _active(alerts: list[ActiveAlert]) -> list[Any]:
    if not alerts:
        return [html.Tr(html.Td("no pending or firing alert", id="al-none-active"))]
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("state", "alert", "since (UTC)", "fired at")])]
    for a in alerts:
        rows.append(html.Tr(
            [html.Td(a.state, className=f"alert-{a.state}"), html.Td(alert_line(a)),
             html.Td(when(a.since)), html.Td(when(a.fired_at))],
            className="active-alert", **_data(rule=a.rule, state=a.state)))
    return rows


def _rules(rules: list[AlertRule], operate: bool) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("rule", "condition", "for", "severity", "action",
                                                     "pending / firing", "last evaluation", "enabled", "")])]
    for r in rules:
        enabled = r.enabled
        rows.append(html.Tr(
            [
                html.Td([html.Strong(r.name), html.Div(r.summary, className="muted")]),
                html.Td(_condition(r)),
                html.Td(f"{number(r.for_s, 0)} s"),
                html.Td(r.severity),
                html.Td(r.action),
                live_rows.cell("al-counts", r.name, _counts(r), className="rule-counts"),
                live_rows.cell("al-last", r.name, _last_eval(r), className="rule-last-eval"),
                html.Td("yes" if enabled else "no"),
                html.Td(html.Button(
                    "Disable" if enabled else "Enable",
                    id={"type": "al-switch", "index": r.name},
                    n_clicks=0,
                    className="btn btn-small",
                    disabled=not operate,
                    **_data(enable=str(not enabled).lower()),
                )),
            ],
            className="rule-row" + ("" if enabled else " kind-unavailable"),
            **_data(rule=r.name, enabled=str(enabled).lower()),
        ))
    return rows


def _condition(rule: AlertRule) -> str:
    return f"{rule.query or rule.expr} {rule.comparison} {rule.threshold}"


def _counts(rule: AlertRule) -> str:
    return f"{rule.pending} / {rule.firing}"


def _last_eval(rule: AlertRule) -> str:
    return when(rule.last_eval) + (f" · error: {rule.last_error}" if rule.last_error else "")


live_rows.fill_cells("al-rules-live", "al-counts", "al-last")


def _history(records: list[AlertTransition]) -> list[Any]:
    if not records:
        return [html.Tr(html.Td("no alert has changed state yet", id="al-no-history"))]
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("time (UTC)", "alert", "state", "value", "action",
                                                     "outcome")])]
    for h in records:
        result = h.result
        outcome = (f"{result.outcome}: {result.target} {result.detail}".strip()
                   if result else ("–" if h.state != "resolved" else h.reason or "resolved"))
        labels = " ".join(f"{k}={v}" for k, v in sorted(h.labels.items()) if k != "alertname")
        rows.append(html.Tr(
            [
                html.Td(when(h.at)),
                html.Td(f"{h.rule} {labels}".strip()),
                html.Td(h.state),
                html.Td(number(h.value, 3)),
                html.Td(h.action),
                html.Td(outcome, className=f"outcome-{result.outcome}" if result else ""),
            ],
            className="history-row",
            **_data(rule=h.rule, state=h.state),
        ))
    return rows


@dash.callback(
    Output("al-switch-result", "children"),
    Input({"type": "al-switch", "index": ALL}, "n_clicks"),
    prevent_initial_call=True,
)
def switch(clicks: list[int | None]) -> Any:
    if not ctx.triggered_id or not any(clicks):
        return dash.no_update  # the table was redrawn; nobody clicked
    name = str(ctx.triggered_id["index"])
    try:
        rules = {r.name: r for r in session.client().alert_rules()}
        enable = name in rules and not rules[name].enabled
        result = session.client().set_alert_rule(name, enabled=enable)
    except ApiError as exc:
        return f"{name}: refused: {exc}"
    resolved = result.resolved
    return (f"{name} {'enabled' if enable else 'disabled'}"
            + (f"; {len(resolved)} active alert(s) resolved" if resolved else ""))
