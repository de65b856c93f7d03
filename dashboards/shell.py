"""What every page shares: navigation, the live-refresh clock and its pause toggle, the banner of active
faults and firing alerts, and the HALT ALL button (operators and admins; with a confirm dialog).

Pages refresh by listening to ``Input(REFRESH, "n_intervals")``; pausing disables that interval.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from controlplane.client import ApiError
from dashboards import session

REFRESH = "refresh"  # the dcc.Interval every live panel listens to


def layout(refresh_s: float) -> html.Div:
    who = session.current()
    user = f"{who.user} ({who.role})" if who else "-"
    operate = who is not None and who.can_operate
    pages = sorted(dash.page_registry.values(), key=lambda p: (p.get("order") or 0, p["name"]))
    return html.Div(
        [
            dcc.Location(id="url"),
            dcc.Interval(id=REFRESH, interval=int(refresh_s * 1000), n_intervals=0),
            html.Header(
                className="topbar",
                children=[
                    html.Span("LLM SRE console", className="brand"),
                    html.Nav(
                        [
                            dcc.Link(
                                p["name"],
                                href=p["relative_path"],
                                className="nav-link",
                                id=f"nav-{p['name'].lower()}",
                            )
                            for p in pages
                        ],
                        className="nav",
                    ),
                    html.Div(
                        className="topbar-right",
                        children=[
                            dcc.Checklist(
                                id="pause",
                                options=[{"label": " pause live refresh", "value": "paused"}],
                                value=[],
                                className="pause",
                                inline=True,
                            ),
                            html.Button(
                                "HALT ALL",
                                id="halt-all",
                                n_clicks=0,
                                className="halt",
                                disabled=not operate,
                                title="revert every active fault now" if operate else "operators only",
                            ),
                            html.Span(user, id="who", className="who"),
                            html.Form(
                                html.Button("Log out", type="submit", className="logout"),
                                method="post",
                                action="/logout",
                                id="logout-form",
                            ),
                        ],
                    ),
                ],
            ),
            dcc.ConfirmDialog(
                id="halt-confirm",
                message="HALT ALL: revert every active fault now, and refuse "
                "new faults until someone releases them. Continue?",
            ),
            html.Div(id="banner", className="banner banner-ok"),
            html.Div(id="halt-result", className="notice"),
            html.Main(dash.page_container, className="page"),
        ]
    )


@dash.callback(Output(REFRESH, "disabled"), Input("pause", "value"))
def pause(value: list[str] | None) -> bool:
    return "paused" in (value or [])


@dash.callback(Output("banner", "children"), Output("banner", "className"), Input(REFRESH, "n_intervals"))
def banner(_: int) -> tuple[Any, str]:
    try:
        api = session.client()
        faults = api.chaos_faults()
    except ApiError as exc:
        return f"control plane: {exc}", "banner banner-warn"
    alerts, alerts_note = _firing_alerts(api)
    items = [
        html.Li(
            f"FAULT #{f['id']} {f['kind']} on {f['target']}: {f['remaining_s']:.0f} s left",
            className="banner-fault",
        )
        for f in faults
    ]
    items += [html.Li(alert_line(a), className="banner-alert") for a in alerts]
    if not items:
        return [
            html.Span("No active faults, no firing alerts."),
            html.Span(alerts_note, className="muted"),
        ], "banner banner-ok"
    title = f"{len(faults)} active fault(s), {len(alerts)} firing alert(s)"
    return [html.Strong(title), html.Ul(items)], "banner banner-alarm"


def alert_line(alert: dict[str, Any]) -> str:
    """``ALERT HighErrorRate [critical] replica=az-a-1: error rate above 5% (value 0.12)``."""
    labels = dict(alert.get("labels") or {})
    annotations = dict(alert.get("annotations") or {})
    severity = labels.pop("severity", None) or alert.get("severity") or ""
    labels.pop("alertname", None)
    where = " ".join(f"{k}={v}" for k, v in sorted(labels.items()))
    summary = annotations.get("summary") or annotations.get("description") or alert.get("summary") or ""
    value = alert.get("value")
    return (
        f"ALERT {alert.get('rule') or alert.get('name') or '?'}"
        + (f" [{severity}]" if severity else "")
        + (f" {where}" if where else "")
        + (f": {summary}" if summary else "")
        + (f" (value {value:.3g})" if isinstance(value, int | float) else "")
    )


def _firing_alerts(api: Any) -> tuple[list[dict[str, Any]], str]:
    try:
        alerts = api.active_alerts()
    except ApiError as exc:
        if exc.status == 404:
            return [], " (alerts: not available on this control plane)"
        return [], f" (alerts: {exc})"
    return [a for a in alerts if a.get("state", "firing") == "firing"], ""


@dash.callback(Output("halt-confirm", "displayed"), Input("halt-all", "n_clicks"), prevent_initial_call=True)
def confirm_halt(n_clicks: int) -> bool:
    return bool(n_clicks)


@dash.callback(
    Output("halt-result", "children"),
    Input("halt-confirm", "submit_n_clicks"),
    State("halt-confirm", "message"),
    prevent_initial_call=True,
)
def halt(submitted: int | None, _: str) -> str:
    if not submitted:
        return ""
    try:
        report = session.client().chaos_halt()
    except ApiError as exc:
        return f"HALT ALL refused: {exc}"
    failed = report.get("failed") or {}
    return (
        f"HALT ALL: {len(report.get('reverted', []))} fault(s) reverted in {report.get('elapsed_s', 0):.2f} s"
        + (f"; {len(failed)} failed: {failed}" if failed else "")
        + "; new faults are refused until released (Chaos page)."
    )
