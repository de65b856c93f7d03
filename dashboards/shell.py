"""What every page shares: navigation, the live-refresh clock and its pause toggle, the banner of active
faults and firing alerts, and the HALT ALL button (operators and admins; with a confirm dialog).

Pages refresh by listening to ``Input(REFRESH, "n_intervals")``; pausing disables that interval.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from controlplane.client import ActiveAlert, ApiError, ControlPlaneClient, Unreachable
from dashboards import session

REFRESH = session.REFRESH  # the dcc.Interval every live panel listens to


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
        with session.OUTAGE.reporting():
            faults = api.chaos_faults()
    except Unreachable:
        return outage_banner(session.OUTAGE), "banner banner-down"
    except ApiError as exc:
        return f"control plane: {exc}", "banner banner-warn"
    alerts, alerts_note = _firing_alerts(api)
    items = [
        html.Li(
            f"FAULT #{f.id} {f.kind} on {f.target}: {f.remaining_s:.0f} s left",
            className="banner-fault",
        )
        for f in faults
    ]
    items += [html.Li(line, className="banner-node") for line in _lost_nodes(api)]
    items += [html.Li(alert_line(a), className="banner-alert") for a in alerts]
    if not items:
        return [
            html.Span("No active faults, no firing alerts."),
            html.Span(alerts_note, className="muted"),
        ], "banner banner-ok"
    title = f"{len(faults)} active fault(s), {len(alerts)} firing alert(s)"
    lost = len(items) - len(faults) - len(alerts)
    if lost:
        title += f", {lost} cluster node(s) lost"
    return [html.Strong(title), html.Ul(items)], "banner banner-alarm"


def outage_banner(outage: session.Outage) -> list[Any]:
    """The control plane is gone: since when, what the pages show, and that serving goes on."""
    now = outage.clock()
    since = outage.since if outage.since is not None else now
    last = (f"The pages show what it last answered at {_clock_time(outage.last_answer)}"
            if outage.last_answer is not None else "No data was received from it yet")
    return [html.Strong(f"Control plane unreachable for {now - since:.0f} s (since {_clock_time(since)})."),
            html.Span(f" {last}; the gateways and replicas keep serving on their last known replica set. "
                      "Actions will fail until it is back."),
            html.Div(outage.error, className="muted")]


def _clock_time(at: float | None) -> str:
    return "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))


def _lost_nodes(api: ControlPlaneClient) -> list[str]:
    """``NODE 10.199.0.4 (az-b) LOST`` for each cluster node the fleet lost (Ray backend; none locally)."""
    try:
        fleet = api.fleet()
    except ApiError:
        return []
    lines = [f"NODE {n.address} ({n.zone or 'no zone'}) LOST" for n in fleet.nodes if not n.alive]
    lines += [f"ZONE {zone}: no node left" for zone in fleet.zones_down]
    return lines


def alert_line(alert: ActiveAlert) -> str:
    """``ALERT HighErrorRate [critical] replica=az-a-1: error rate above 5% (value 0.12)``."""
    labels = dict(alert.labels)
    severity = labels.pop("severity", None) or ""
    labels.pop("alertname", None)
    where = " ".join(f"{k}={v}" for k, v in sorted(labels.items()))
    summary = alert.annotations.get("summary") or alert.annotations.get("description") or ""
    return (
        f"ALERT {alert.rule or '?'}"
        + (f" [{severity}]" if severity else "")
        + (f" {where}" if where else "")
        + (f": {summary}" if summary else "")
        + (f" (value {alert.value:.3g})" if alert.value is not None else "")
    )


def _firing_alerts(api: ControlPlaneClient) -> tuple[list[ActiveAlert], str]:
    try:
        alerts = api.active_alerts()
    except ApiError as exc:
        if exc.status == 404:
            return [], " (alerts: not available on this control plane)"
        return [], f" (alerts: {exc})"
    return [a for a in alerts if a.state == "firing"], ""


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
    failed = dict(report.failed)
    return (
        f"HALT ALL: {len(report.reverted)} fault(s) reverted in {report.elapsed_s:.2f} s"
        + (f"; {len(failed)} failed: {failed}" if failed else "")
        + "; new faults are refused until released (Chaos page)."
    )
