"""The Autoscaler page's schedule section: the cron windows that set the replica bounds, each with its
schedule, its bounds, whether it is active now and its next start and end, refreshed on the clock; and a
JSON editor of the whole list that replaces it in one ``PUT /api/v1/autoscaler/windows`` (which validates
the windows as the config file's; ``[]`` removes every one).

An operator edits and saves the list; viewers see everything with the editor and its button disabled, and
the API refuses their calls anyway. A saved schedule changes the active window at once, so the page's own
refresh listens to this section's result too.

The Autoscaler page imports this module (which registers its callbacks), reads the windows with
:func:`current_windows` and places :func:`section`.
"""

from __future__ import annotations

import json
from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from controlplane.client import ApiError, ScheduleWindow
from dashboards import figures, session
from dashboards.figures import when
from dashboards.shell import REFRESH

# The fields of a window the editor shows (the API's answer adds next_start, next_end, active, schedule).
WINDOW_FIELDS = ("name", "cron", "duration_s", "end_cron", "timezone", "weekdays", "min_replicas",
                 "max_replicas")
WINDOW_EXAMPLE = [{"name": "business-hours", "cron": "0 8 * * 1-5", "duration_s": 36000,
                   "timezone": "Europe/Berlin", "min_replicas": 4}]


def current_windows() -> tuple[tuple[ScheduleWindow, ...], str]:
    """The windows as the API has them now, and an error text ("" when they were read)."""
    try:
        return session.client().autoscaler_windows().windows, ""
    except ApiError as exc:
        return (), f"autoscaler windows: {exc}"


def section(windows: tuple[ScheduleWindow, ...], operate: bool) -> html.Div:
    """The section's layout, its editor filled with ``windows``; ``operate``: whether the user's role may
    save."""
    return html.Div(className="panel",
                    children=[html.H3("Schedule: cron windows that set the replica bounds"),
                              _editor(windows, operate)])


def _editor(windows: tuple[ScheduleWindow, ...], operate: bool) -> html.Div:
    """The windows' table (refreshed) and a JSON editor of the whole list, saved in one PUT."""
    text = json.dumps([w.settings() for w in windows], indent=2)
    return html.Div(
        [
            html.Div(id="as-windows-source", className="muted"),
            html.Table(id="as-windows", className="data"),
            html.Label("Windows (JSON list; fields: " + ", ".join(WINDOW_FIELDS) + "; give duration_s or "
                       "end_cron; [] removes every window). Example: " + json.dumps(WINDOW_EXAMPLE)),
            dcc.Textarea(id="as-windows-json", value=text, disabled=not operate,
                         style={"width": "100%", "height": "12rem", "fontFamily": "monospace"}),
            html.Div(
                className="form-row",
                children=[html.Button("Save schedule", id="as-windows-save", n_clicks=0, className="btn",
                                      disabled=not operate)],
            ),
            html.Div(id="as-windows-result", className="muted"),
        ]
    )


@dash.callback(
    Output("as-windows", "children"),
    Output("as-windows-source", "children"),
    Input(REFRESH, "n_intervals"),
    Input("as-windows-result", "children"),
)
def refresh_windows(*_: Any) -> tuple[Any, Any]:
    try:
        view = session.client().autoscaler_windows()
    except ApiError as exc:
        return [], html.Span(f"autoscaler windows: {exc}", className="notice")
    source = "set through the console or API" if view.source == "api" else "from the config file"
    note = f"{len(view.windows)} window(s), {source}; active now: {view.active or 'none'}"
    return _window_rows(view.windows), note


def _window_rows(windows: tuple[ScheduleWindow, ...]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("window", "schedule", "min..max", "active now",
                                                     "next start (UTC)", "next end (UTC)")])]
    for w in windows:
        low = "–" if w.min_replicas is None else w.min_replicas
        high = "–" if w.max_replicas is None else w.max_replicas
        rows.append(html.Tr(
            [
                html.Td(w.name),
                html.Td(w.schedule),
                html.Td(f"{low}..{high}"),
                html.Td("active" if w.active else "no"),
                html.Td(when(w.next_start)),
                html.Td(when(w.next_end)),
            ],
            className="window-row",
            **figures.data_attrs(name=w.name, active=str(w.active).lower(), next_start=w.next_start,
                                 next_end=w.next_end),
        ))
    if len(rows) == 1:
        rows.append(html.Tr(html.Td("no schedule window: the autoscaler's own bounds apply all the time",
                                    id="as-no-windows")))
    return rows


@dash.callback(
    Output("as-windows-result", "children"),
    Input("as-windows-save", "n_clicks"),
    State("as-windows-json", "value"),
    prevent_initial_call=True,
)
def save_windows(_: int, text: str | None) -> Any:
    try:
        windows = json.loads(text or "[]")
    except json.JSONDecodeError as exc:
        return html.Span(f"not saved: the windows are not JSON: {exc}", className="notice",
                         id="as-windows-refused")
    if isinstance(windows, dict) and set(windows) == {"windows"}:
        windows = windows["windows"]
    if not isinstance(windows, list) or not all(isinstance(w, dict) for w in windows):
        return html.Span('not saved: give a JSON list of windows, e.g. [{"name": ..., "cron": ...}]',
                         className="notice", id="as-windows-refused")
    try:
        view = session.client().autoscaler_set_windows(windows)
    except ApiError as exc:
        return html.Span(f"refused: {exc}", className="notice", id="as-windows-refused")
    names = ", ".join(w.name for w in view.windows) or "none"
    return html.Span(f"saved {len(view.windows)} window(s): {names}", id="as-windows-saved")
