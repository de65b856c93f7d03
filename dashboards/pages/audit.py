"""Audit: who did what, when, to what, with which outcome (newest first)."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, dcc, html

from controlplane.client import ApiError, AuditEntry
from dashboards import session
from dashboards.figures import data_attrs, when
from dashboards.shell import REFRESH

LIMIT = 200


def layout(**_: Any) -> html.Div:
    return html.Div(
        [
            html.H2("Audit trail"),
            html.Div(
                className="controls",
                children=[
                    html.Div(
                        [
                            html.Label("Action starts with"),
                            dcc.Input(id="audit-action", type="text", value="", debounce=True),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Actor"),
                            dcc.Input(id="audit-actor", type="text", value="", debounce=True),
                        ]
                    ),
                ],
            ),
            html.Table(id="audit-table", className="data"),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/audit", name="Audit", order=90, title="Audit · LLM SRE console", layout=layout
)


@dash.callback(
    Output("audit-table", "children"),
    Input(REFRESH, "n_intervals"),
    Input("audit-action", "value"),
    Input("audit-actor", "value"),
)
def refresh(_: int, action: str | None, actor: str | None) -> list[Any]:
    try:
        records = session.client().audit(limit=LIMIT)
    except ApiError as exc:
        return [html.Tr(html.Td(str(exc)))]
    records = [r for r in records if _matches(r, action, actor)]
    rows: list[Any] = [
        html.Tr(
            [
                html.Th(h)
                for h in (
                    "time (UTC)",
                    "actor",
                    "role",
                    "action",
                    "target",
                    "outcome",
                    "detail",
                    "parameters",
                )
            ]
        )
    ]
    for r in records:
        params = ", ".join(f"{k}={v}" for k, v in r.params.items())
        rows.append(
            html.Tr(
                [
                    html.Td(when(r.ts)),
                    html.Td(r.actor),
                    html.Td(r.role),
                    html.Td(r.action),
                    html.Td(r.target),
                    html.Td(r.outcome, className=f"outcome-{r.outcome}"),
                    html.Td(r.detail),
                    html.Td(params),
                ],
                className="audit-row",
                **data_attrs(action=r.action, outcome=r.outcome),
            )
        )
    if len(rows) == 1:
        rows.append(html.Tr(html.Td("no record matches")))
    return rows


def _matches(record: AuditEntry, action: str | None, actor: str | None) -> bool:
    """``actor`` "alice" matches alice's console sessions ("alice/console-1a2b3c") too."""
    if action and not record.action.startswith(action):
        return False
    return not actor or record.actor == actor or record.actor.startswith(f"{actor}/")
