"""Chaos: the fault catalogue (unavailable kinds greyed, with why), an inject form with a blast-radius
preview (the API's dry run), the active faults with their time left and a revert button, and slice
experiments (:mod:`dashboards.slice_panel`: chaos on a coloured share of traffic against a control colour).

Viewers see everything with every control disabled; the API refuses their calls anyway.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from controlplane.client import ActiveFault, ApiError, BlastRadius, FaultKind, FaultParam
from dashboards import figures, live_rows, session, slice_panel
from dashboards.shell import REFRESH


def layout(**_: Any) -> html.Div:
    operate = session.can_operate()
    kinds: list[FaultKind] = []
    replicas: list[str] = []
    zones: list[str] = []
    error = ""
    try:
        api = session.client()
        kinds = api.chaos_catalogue()
        fleet = api.fleet()
        replicas = sorted(r.replica_id for r in fleet.replicas)
        zones = list(fleet.zones)
    except ApiError as exc:
        error = str(exc)
    available = [k.kind for k in kinds if k.available]
    return html.Div(
        [
            html.H2("Chaos"),
            html.Div(error, className="notice"),
            html.Div(
                className="grid2",
                children=[
                    html.Div(
                        className="panel",
                        children=[
                            html.H3("Inject a fault"),
                            _form(kinds, replicas, zones, operate),
                            html.Div(id="chaos-plan"),
                            html.Div(id="chaos-result"),
                        ],
                    ),
                    html.Div(
                        className="panel",
                        children=[
                            html.H3("Active faults"),
                            html.Table(id="chaos-active", className="data"),
                            dcc.Store(id="chaos-active-key"),
                            dcc.Store(id="chaos-active-live"),
                            html.Div(id="chaos-revert-result", className="notice"),
                            html.Button(
                                "Release (accept new faults after a HALT ALL)",
                                id="chaos-release",
                                n_clicks=0,
                                className="btn btn-small",
                                disabled=not operate,
                            ),
                            html.Div(id="chaos-release-result", className="muted"),
                        ],
                    ),
                ],
            ),
            slice_panel.section(operate),
            html.H3("Catalogue"),
            html.Table(_catalogue(kinds), id="chaos-catalogue", className="data"),
            dcc.Store(id="chaos-available", data=available),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/chaos", name="Chaos", order=3, title="Chaos · LLM SRE console", layout=layout
)


def _form(kinds: list[FaultKind], replicas: list[str], zones: list[str], operate: bool) -> html.Div:
    options = [
        {
            "label": k.kind if k.available else f"{k.kind} (unavailable)",
            "value": k.kind,
            "disabled": not k.available,
        }
        for k in kinds
    ]
    first = next((k.kind for k in kinds if k.available), None)
    why = "" if operate else "Your role may not inject faults: the controls are disabled."
    return html.Div(
        [
            html.Div(why, className="notice", id="chaos-role-note"),
            html.Div(
                className="form-row",
                children=[
                    html.Div(
                        [
                            html.Label("Kind"),
                            dcc.Dropdown(
                                id="chaos-kind",
                                options=options,
                                value=first,
                                clearable=False,
                                disabled=not operate,
                                style={"minWidth": "14rem"},
                            ),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Duration (s)"),
                            dcc.Input(
                                id="chaos-duration",
                                type="number",
                                value=30,
                                min=1,
                                max=3600,
                                disabled=not operate,
                            ),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Selector"),
                            dcc.Input(
                                id="chaos-selector", type="text", value="COUNT(1)", disabled=not operate
                            ),
                        ]
                    ),
                ],
            ),
            html.Div(
                className="form-row",
                children=[
                    html.Div(
                        [
                            html.Label("Replicas (empty: any)"),
                            dcc.Dropdown(
                                id="chaos-replicas",
                                options=replicas,
                                multi=True,
                                disabled=not operate,
                                style={"minWidth": "14rem"},
                            ),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Zones (empty: any)"),
                            dcc.Dropdown(
                                id="chaos-zones",
                                options=zones,
                                multi=True,
                                disabled=not operate,
                                style={"minWidth": "12rem"},
                            ),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Parameters (NAME=VALUE, one per line)"),
                            dcc.Textarea(
                                id="chaos-params",
                                value="",
                                disabled=not operate,
                                style={"width": "14rem", "height": "3rem"},
                            ),
                        ]
                    ),
                ],
            ),
            dcc.Checklist(
                id="chaos-allow-all",
                options=[{"label": " allow taking down every target", "value": "yes"}],
                value=[],
            ),
            html.Div(
                className="form-row",
                children=[
                    html.Button(
                        "Preview blast radius",
                        id="chaos-preview",
                        n_clicks=0,
                        className="btn",
                        disabled=not operate,
                    ),
                    html.Button(
                        "Inject",
                        id="chaos-inject",
                        n_clicks=0,
                        className="btn btn-danger",
                        disabled=not operate,
                    ),
                ],
            ),
        ]
    )


def _catalogue(kinds: list[FaultKind]) -> list[Any]:
    rows: list[Any] = [
        html.Tr([html.Th(h) for h in ("kind", "family", "what it does", "parameters", "availability")])
    ]
    for k in kinds:
        rows.append(
            html.Tr(
                [
                    html.Td(k.kind),
                    html.Td(k.family),
                    html.Td(k.description),
                    html.Td(_params_text(k.params)),
                    html.Td(
                        "available" if k.available else f"unavailable: {k.unavailable_reason or 'unknown'}"
                    ),
                ],
                className="kind-available" if k.available else "kind-unavailable",
                **figures.data_attrs(kind=k.kind),
            )
        )
    return rows


def _params_text(params: tuple[FaultParam, ...]) -> str:
    return ", ".join(p.name for p in params)


def _parse_params(text: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for line in (text or "").replace(",", "\n").splitlines():
        if not line.strip():
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"parameters: expected NAME=VALUE, got {line.strip()!r}")
        try:
            params[name.strip()] = float(value)
        except ValueError:
            params[name.strip()] = value.strip()
    return params


@dash.callback(
    Output("chaos-plan", "children"),
    Output("chaos-result", "children"),
    Input("chaos-preview", "n_clicks"),
    Input("chaos-inject", "n_clicks"),
    State("chaos-kind", "value"),
    State("chaos-duration", "value"),
    State("chaos-selector", "value"),
    State("chaos-replicas", "value"),
    State("chaos-zones", "value"),
    State("chaos-params", "value"),
    State("chaos-allow-all", "value"),
    prevent_initial_call=True,
)
def inject(
    _preview: int,
    _inject: int,
    kind: str | None,
    duration: float | None,
    selector: str | None,
    replicas: list[str] | None,
    zones: list[str] | None,
    params_text: str | None,
    allow_all: list[str] | None,
) -> tuple[Any, Any]:
    dry_run = ctx.triggered_id == "chaos-preview"
    if not kind or not duration:
        return "", html.Div("choose a kind and a duration", className="notice")
    try:
        result = session.client().chaos_inject(
            kind,
            duration_s=float(duration),
            selector=selector or "COUNT(1)",
            params=_parse_params(params_text),
            replicas=replicas or [],
            zones=zones or [],
            allow_all=bool(allow_all),
            dry_run=dry_run,
        )
    except (ApiError, ValueError) as exc:
        return ("", html.Div(f"refused: {exc}", className="notice", id="chaos-refused"))
    plan = _plan(result.plan)
    if dry_run:
        return plan, ""
    done = ", ".join(
        f"#{f.id} on {f.target}" + (f" failed: {f.error}" if f.error else "") for f in result.faults
    )
    return plan, html.Div(f"injected {kind}: {done}", id="chaos-injected")


def _plan(plan: BlastRadius) -> html.Div:
    verdict = "allowed" if plan.allowed else "refused by the safety limits"
    return html.Div(
        [
            html.Strong(
                f"Blast radius: {len(plan.targets)} target(s): {', '.join(plan.targets) or 'none'} · "
                f"{verdict}"
            ),
            html.Ul([html.Li(r) for r in plan.reasons]),
        ],
        id="chaos-plan-body",
        **figures.data_attrs(allowed=str(plan.allowed).lower()),
    )


@dash.callback(
    Output("chaos-active", "children"),
    Output("chaos-active-key", "data"),
    Output("chaos-active-live", "data"),
    Input(REFRESH, "n_intervals"),
    Input("chaos-result", "children"),
    Input("chaos-revert-result", "children"),
    State("chaos-active-key", "data"),
)
def active(_tick: int, _injected: Any, _reverted: Any, drawn: str | None) -> tuple[Any, Any, Any]:
    """The active faults, drawn again only when the set of faults or the role changes (their Revert
    buttons stay put: :mod:`dashboards.live_rows`); the time left goes to its cells every tick."""
    operate = session.can_operate()
    try:
        faults = session.client().chaos_faults()
    except ApiError as exc:
        return [html.Tr(html.Td(str(exc)))], None, {}
    identity = (operate, [(f.id, f.kind, f.target) for f in faults])
    rows, key = live_rows.redraw(identity, drawn, lambda: _active_rows(faults, operate))
    return rows, key, live_rows.live({"chaos-left": {f.id: _time_left(f) for f in faults}})


def _active_rows(faults: list[ActiveFault], operate: bool) -> list[Any]:
    if not faults:
        return [html.Tr(html.Td("no active fault", id="chaos-none-active"))]
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("id", "kind", "target", "time left", "")])]
    for f in faults:
        rows.append(
            html.Tr(
                [
                    html.Td(str(f.id)),
                    html.Td(f.kind),
                    html.Td(f.target),
                    live_rows.cell("chaos-left", f.id, _time_left(f), className="time-left"),
                    html.Td(
                        html.Button(
                            "Revert",
                            id={"type": "chaos-revert", "index": f.id},
                            n_clicks=0,
                            className="btn btn-small",
                            disabled=not operate,
                        )
                    ),
                ],
                className="active-fault",
                **figures.data_attrs(fault=f.id, kind=f.kind, target=f.target),
            )
        )
    return rows


def _time_left(fault: ActiveFault) -> str:
    return f"{fault.remaining_s:.0f} s"


live_rows.fill_cells("chaos-active-live", "chaos-left")


@dash.callback(
    Output("chaos-revert-result", "children"),
    Input({"type": "chaos-revert", "index": ALL}, "n_clicks"),
    prevent_initial_call=True,
)
def revert(clicks: list[int | None]) -> Any:
    if not ctx.triggered_id or not any(clicks):
        return dash.no_update  # new rows appeared; nobody clicked
    fault_id = int(ctx.triggered_id["index"])
    try:
        result = session.client().chaos_revert(fault_id)
    except ApiError as exc:
        return f"revert of #{fault_id} refused: {exc}"
    return f"fault #{fault_id} reverted" + ("" if result.ok else f" with an error: {result.detail}")


@dash.callback(
    Output("chaos-release-result", "children"), Input("chaos-release", "n_clicks"), prevent_initial_call=True
)
def release(n_clicks: int) -> str:
    if not n_clicks:
        return ""
    try:
        session.client().chaos_release()
    except ApiError as exc:
        return f"release refused: {exc}"
    return "released: new faults are accepted again"
