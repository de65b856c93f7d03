"""Latency: the P99 breakdown. Where the time of the slowest requests goes, attributed from per-request
traces (``GET /api/v1/latency/breakdown``), next to typical requests; percentile curves; per replica;
the slowest traces with their stage timings."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, dcc, html

from controlplane.client import ApiError, LatencyBreakdown, Trace
from dashboards import figures, session
from dashboards.figures import (
    STAGES,
    breakdown_bars,
    empty,
    ms,
    percent,
    replica_comparison,
    share,
    time_series,
    when,
)
from dashboards.shell import REFRESH

WINDOWS = {60: "last minute", 300: "last 5 minutes", 900: "last 15 minutes", 3600: "last hour"}
QUANTILES = (0.99, 0.95, 0.9)
EXPLAIN = (
    "Per-stage P99s do not add up to the end-to-end P99: the request that is slowest in the queue is "
    "rarely the one slowest in decode. So the tail is attributed from per-request traces: the bars show "
    "the mean time per stage of the requests whose end-to-end latency is at or above the chosen quantile, "
    "and of typical requests around the median (P40–P60). The control plane keeps every trace above the "
    "running P95 and a sample of the rest."
)
E2E = "vllm:e2e_request_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"


def layout(**_: Any) -> html.Div:
    scopes = [{"label": "whole fleet", "value": "fleet"}]
    try:
        fleet = session.client().fleet()
        scopes += [{"label": f"zone {z}", "value": f"zone:{z}"} for z in fleet.zones]
        scopes += [
            {"label": f"replica {r.replica_id}", "value": f"replica:{r.replica_id}"}
            for r in sorted(fleet.replicas, key=lambda r: r.replica_id)
        ]
    except ApiError:
        pass  # the fleet scope still works
    return html.Div(
        [
            html.H2("Latency: where the tail time goes"),
            html.Div(
                className="controls",
                children=[
                    html.Div(
                        [
                            html.Label("Window"),
                            dcc.Dropdown(
                                id="lat-window",
                                value=300,
                                clearable=False,
                                options=[{"label": v, "value": k} for k, v in WINDOWS.items()],
                            ),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Scope"),
                            dcc.Dropdown(id="lat-scope", value="fleet", clearable=False, options=scopes),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Tail quantile"),
                            dcc.Dropdown(
                                id="lat-quantile",
                                value=0.99,
                                clearable=False,
                                options=[{"label": f"P{percent(q)}", "value": q} for q in QUANTILES],
                            ),
                        ]
                    ),
                ],
            ),
            html.Div(
                className="explain",
                id="lat-explain",
                children=[
                    EXPLAIN,
                ],
            ),
            html.Div(id="lat-summary", className="cards"),
            html.Div(
                className="grid2",
                children=[
                    html.Div(
                        dcc.Graph(
                            id="lat-breakdown",
                            figure=empty("Where the time goes"),
                            config={"displaylogo": False},
                        ),
                        className="panel",
                    ),
                    html.Div(html.Table(id="lat-shares", className="data"), className="panel"),
                ],
            ),
            html.Div(
                className="grid2",
                children=[
                    html.Div(
                        dcc.Graph(
                            id="lat-curves",
                            figure=empty("Percentiles over time"),
                            config={"displaylogo": False},
                        ),
                        className="panel",
                    ),
                    html.Div(
                        dcc.Graph(
                            id="lat-replicas", figure=empty("Per replica"), config={"displaylogo": False}
                        ),
                        className="panel",
                    ),
                ],
            ),
            html.H3("Slowest requests"),
            html.Table(id="lat-slowest", className="data"),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/latency", name="Latency", order=1, title="Latency · LLM SRE console", layout=layout
)


@dash.callback(
    Output("lat-summary", "children"),
    Output("lat-breakdown", "figure"),
    Output("lat-shares", "children"),
    Output("lat-replicas", "figure"),
    Output("lat-slowest", "children"),
    Input(REFRESH, "n_intervals"),
    Input("lat-window", "value"),
    Input("lat-scope", "value"),
    Input("lat-quantile", "value"),
)
def refresh_breakdown(_: int, window_s: int, scope: str, quantile: float) -> tuple[Any, ...]:
    try:
        data = session.client().latency_breakdown(
            window_s=window_s, scope=scope, quantile=quantile, slowest=20
        )
    except ApiError as exc:
        note = str(exc)
        return (
            [html.Div(note, className="notice")],
            empty("Where the time goes", note),
            [],
            empty("Per replica", note),
            [],
        )
    return (
        _summary(data),
        breakdown_bars(data),
        _shares(data),
        replica_comparison(data),
        _slowest(data.slowest),
    )


def _summary(data: LatencyBreakdown) -> list[html.Div]:
    q = percent(data.quantile)

    def card(label: str, value: str, key: str) -> html.Div:
        return html.Div(
            [html.Div(label, className="label"), html.Div(value, className="value")],
            className="card",
            id=f"lat-{key}",
        )

    cards = [
        card("traces in window", str(data.num_traces), "count"),
        card(f"E2E P{q} (from traces)", ms(data.threshold_s), "threshold"),
        card(f"mean E2E of the P{q} tail", ms(data.tail.e2e_s if data.tail else None), "tail-e2e"),
        card("mean E2E around P50", ms(data.median.e2e_s if data.median else None), "median-e2e"),
    ]
    if data.truncated:
        cards.append(
            html.Div(
                "too many traces: only the window's oldest were read; choose a shorter window",
                className="notice",
            )
        )
    return cards


def _shares(data: LatencyBreakdown) -> list[Any]:
    tail, median = data.tail, data.median
    if not tail:
        return [html.Tr(html.Td("no traces in this window and scope"))]
    q = percent(data.quantile)
    head = html.Tr(
        [
            html.Th("stage"),
            html.Th(f"P{q} tail: mean"),
            html.Th("share"),
            html.Th("P50 typical: mean"),
            html.Th("share"),
        ]
    )
    rows = [head]
    for stage in STAGES:
        rows.append(
            html.Tr(
                [
                    html.Td(stage),
                    html.Td(ms(tail.stages_s[stage])),
                    html.Td(
                        share(tail.shares[stage]),
                        className="tail-share",
                        **figures.data_attrs(stage=stage, share=f"{tail.shares[stage]:.6f}"),
                    ),
                    html.Td(ms(median.stages_s[stage]) if median else "–"),
                    html.Td(share(median.shares[stage]) if median else "–"),
                ],
                id=f"lat-share-{stage}",
            )
        )
    return rows


def _slowest(traces: tuple[Trace, ...]) -> list[Any]:
    head = html.Tr(
        [
            html.Th(h)
            for h in (
                "started (UTC)",
                "request",
                "replica",
                "status",
                "E2E",
                "TTFT",
                "gateway",
                "queue",
                "prefill",
                "decode",
                "serialization",
                "tokens",
                "retries/resumes",
                "trace id",
            )
        ]
    )
    rows = [head]
    for t in traces:
        rows.append(
            html.Tr(
                [
                    html.Td(when(t.started_at)),
                    html.Td(t.request_id),
                    html.Td(t.replica_id or "–"),
                    html.Td(str(t.status) + (f" {t.error}" if t.error else "")),
                    html.Td(ms(t.e2e_s)),
                    html.Td(ms(t.ttft_s)),
                    html.Td(ms(t.gateway_s)),
                    html.Td(ms(t.queue_s)),
                    html.Td(ms(t.prefill_s)),
                    html.Td(ms(t.decode_s)),
                    html.Td(ms(t.serialization_s)),
                    html.Td(f"{t.prompt_tokens}→{t.output_tokens}"),
                    html.Td(f"{t.retries}/{t.resumes}"),
                    html.Td(t.trace_id or "–", className="trace-id"),
                ],
                className="trace-row",
            )
        )
    return rows


@dash.callback(
    Output("lat-curves", "figure"),
    Input(REFRESH, "n_intervals"),
    Input("lat-window", "value"),
    Input("lat-scope", "value"),
)
def refresh_curves(_: int, window_s: int, scope: str) -> Any:
    minutes = max(window_s / 60, 5.0)
    step = max(2.0, window_s / 120)
    title = "Percentiles over time (histograms)"
    try:
        api = session.client()
        lines = {}
        for metric, label, qs in ((E2E, "E2E", (0.5, 0.95, 0.99)), (TTFT, "TTFT", (0.99,))):
            for q in qs:
                series = api.metrics_range(metric, q=q, scope=scope, minutes=minutes, step_s=step)
                lines[f"{label} P{percent(q)}"] = list(series[0].points) if series else []
    except ApiError as exc:
        return empty(title, str(exc))
    return time_series(title, lines, unit="ms", scale=1000.0)
