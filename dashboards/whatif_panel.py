"""The Autoscaler page's what-if simulator: a trace (synthetic bursty or the Azure LLM trace), compressed
and cut to a length, replayed against the chosen policies (ours, HPA, static at a given size); a table
compares their SLO attainment, replica-seconds, scale events, reversals, P95 TTFT and TPOT and unfinished
requests, and a figure draws their replicas over the trace.

The simulator runs in the control plane as a background job (``POST /api/v1/simulations`` answers its id at
once; a long trace takes tens of seconds to minutes): the section keeps the id in a ``dcc.Store`` and polls
the job on its own interval, enabled only while the job runs, with a progress bar naming the policy
simulated now, then draws the comparison. A job already running when the page opens (started from another
browser) is followed too. An operator starts a run; viewers see everything with every control disabled,
and the API refuses their calls anyway.

The Autoscaler page imports this module (which registers its callbacks), finds the job to follow with
:func:`running_simulation` and places :func:`section`.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, dcc, html

from controlplane.client import (
    AZURE_TRACE,
    DEFAULT_POLICIES,
    HPA,
    OURS,
    STATIC,
    SYNTHETIC_BURSTY,
    ApiError,
    PolicyOutcome,
    SimulationJob,
    static_policy,
)
from dashboards import figures, session
from dashboards.figures import number, progress, share, simulation_timeline

SIM_POLL_MS = 300  # how often a running simulation job is polled (a run takes a second or two)


def running_simulation() -> int | None:
    """The newest simulation job when it still runs (whoever started it), for the page to follow."""
    try:
        jobs = session.client().simulations(limit=1)
    except ApiError:
        return None
    return jobs[0].id if jobs and jobs[0].status == "running" else None


def section(operate: bool, following: int | None) -> html.Div:
    """The section's layout; ``operate``: whether the user's role may start a run; ``following``: the id of
    a running job to follow from the start (:func:`running_simulation`), or None."""
    return html.Div(className="panel",
                    children=[html.H3("What-if simulator"), _simulator(operate, following)])


def _simulator(operate: bool, following: int | None) -> html.Div:
    return html.Div(
        [
            html.Div(
                className="form-row",
                children=[
                    html.Div([html.Label("Trace"), dcc.Dropdown(
                        id="as-sim-trace",
                        options=[{"label": "synthetic bursty (seeded)", "value": SYNTHETIC_BURSTY},
                                 {"label": "Azure LLM inference trace", "value": AZURE_TRACE}],
                        value=SYNTHETIC_BURSTY, clearable=False, disabled=not operate,
                        style={"minWidth": "14rem"})]),
                    html.Div([html.Label("Compression (x)"), dcc.Input(
                        id="as-sim-compress", type="number", value=4, min=0.1, max=1000, step=0.1,
                        disabled=not operate, style={"width": "6rem"})]),
                    html.Div([html.Label("Trace seconds kept (empty: all)"), dcc.Input(
                        id="as-sim-duration", type="number", value=None, min=1, max=14400,
                        disabled=not operate, style={"width": "8rem"})]),
                ],
            ),
            html.Div(
                className="form-row",
                children=[
                    html.Div([html.Label("Policies to compare"), dcc.Checklist(
                        id="as-sim-policies",
                        options=[{"label": " ours", "value": OURS, "disabled": not operate},
                                 {"label": " HPA", "value": HPA, "disabled": not operate},
                                 {"label": " static", "value": STATIC, "disabled": not operate}],
                        value=list(DEFAULT_POLICIES), inline=True)]),
                    html.Div([html.Label("Static replicas"), dcc.Input(
                        id="as-sim-static", type="number", value=3, min=1, max=64, step=1,
                        disabled=not operate, style={"width": "5rem"})]),
                    html.Button("Simulate", id="as-sim-run", n_clicks=0, className="btn",
                                disabled=not operate),
                ],
            ),
            html.Div(id="as-sim-progress"),
            html.Div(id="as-sim-note", className="muted"),
            html.Table(id="as-sim-table", className="data"),
            dcc.Graph(id="as-sim-graph", config={"displaylogo": False}, figure=simulation_timeline(None)),
            dcc.Store(id="as-sim-job", data=following),
            dcc.Interval(id="as-sim-poll", interval=SIM_POLL_MS, n_intervals=0, disabled=following is None),
        ]
    )


@dash.callback(
    Output("as-sim-progress", "children"),
    Output("as-sim-note", "children"),
    Output("as-sim-table", "children"),
    Output("as-sim-graph", "figure"),
    Output("as-sim-job", "data"),
    Output("as-sim-poll", "disabled"),
    Input("as-sim-run", "n_clicks"),
    Input("as-sim-poll", "n_intervals"),
    State("as-sim-job", "data"),
    State("as-sim-trace", "value"),
    State("as-sim-compress", "value"),
    State("as-sim-duration", "value"),
    State("as-sim-policies", "value"),
    State("as-sim-static", "value"),
    prevent_initial_call=True,
)
def simulate(_run: int, _tick: int, job: int | None, trace: str | None, compress: float | None,
             duration: float | None, chosen: list[str] | None, static: int | None) -> tuple[Any, ...]:
    """The Simulate button starts a job; the poll interval follows it until it ends."""
    if ctx.triggered_id == "as-sim-run":
        return _start(trace, compress, duration, chosen, static)
    return _follow(job)


def _start(trace: str | None, compress: float | None, duration: float | None, chosen: list[str] | None,
           static: int | None) -> tuple[Any, ...]:
    keep = dash.no_update
    policies = [static_policy(int(static or 1)) if p == STATIC else p for p in chosen or []]
    if not policies:
        return keep, html.Span("choose at least one policy", className="notice"), [], keep, keep, keep
    options: dict[str, Any] = {"compress": float(compress or 4.0)}
    if duration:
        options["duration_s"] = float(duration)
    try:
        job = session.client().start_simulation(trace=trace or SYNTHETIC_BURSTY, policies=policies,
                                                **options)
    except ApiError as exc:
        refused = html.Span(f"refused: {exc}", className="notice", id="as-sim-refused")
        return keep, refused, [], keep, keep, keep
    return _running(job), "", [], simulation_timeline(None), job.id, False


def _follow(job_id: int | None) -> tuple[Any, ...]:
    keep = dash.no_update
    if job_id is None:
        return keep, keep, keep, keep, keep, True
    try:
        job = session.client().simulation(int(job_id))
    except ApiError as exc:  # a control plane that restarts comes back; a job that is gone does not
        notice = html.Span(f"simulation {job_id}: {exc}", className="notice", id="as-sim-refused")
        return keep, notice, keep, keep, keep, exc.status == 404
    if job.status == "running":
        return _running(job), keep, keep, keep, keep, False
    result = job.result
    if job.status != "done" or result is None:
        notice = html.Span(f"simulation {job_id} {job.status}: {job.error}", className="notice",
                           id="as-sim-refused" if job.status == "error" else "as-sim-interrupted")
        return "", notice, [], keep, keep, True
    note = (f"{result.num_requests} requests of the {result.trace} trace; SLO: TTFT <= "
            f"{result.slo.ttft_s} s, TPOT <= {result.slo.tpot_s} s; replica profile: {result.profile} "
            f"({result.profile_path}; fit error {result.profile_fit or 'unknown'})")
    return "", note, _comparison(result.policies), simulation_timeline(result), keep, True


def _running(job: SimulationJob) -> html.Div:
    """The progress bar of a running job: the fraction of all policies' runs done, the policy now."""
    policy = job.progress.policy if job.progress else ""
    fraction = job.progress.fraction if job.progress else None
    step = f" ({job.policies.index(policy) + 1} of {len(job.policies)})" if policy in job.policies else ""
    return html.Div(
        [html.Strong(f"Simulation {job.id} on the {job.trace} trace: running {policy}{step}"),
         progress(fraction, f"simulating {policy}")],
        id="as-sim-running",
        **figures.data_attrs(id=job.id, fraction=fraction, policy=policy),
    )


def _comparison(policies: tuple[PolicyOutcome, ...]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("policy", "SLO attainment", "worst 5 min",
                                                     "missed TTFT / TPOT", "replica-seconds",
                                                     "scale events", "reversals", "P95 TTFT", "P95 TPOT",
                                                     "unfinished")])]
    for p in policies:
        rows.append(html.Tr(
            [
                html.Td(p.policy),
                html.Td(share(p.slo_attainment)),
                html.Td(share(p.worst_window_attainment)),
                html.Td(f"{_count(p.missed_ttft)} / {_count(p.missed_tpot)}"),
                html.Td(number(p.replica_seconds, 0)),
                html.Td(str(p.scale_events)),
                html.Td(str(p.reversals)),
                html.Td(number(p.ttft_p95_s, 3) + " s"),
                html.Td(number(p.tpot_p95_s, 3) + " s"),
                html.Td(str(p.unfinished)),
            ],
            className="sim-row",
            **figures.data_attrs(policy=p.policy, slo=p.slo_attainment, worst=p.worst_window_attainment,
                                 missed_ttft=p.missed_ttft, missed_tpot=p.missed_tpot,
                                 unfinished=p.unfinished),
        ))
    return rows


def _count(value: int | None) -> str:
    return "–" if value is None else f"{value:,}"
