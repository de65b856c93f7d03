"""Overview: replicas by zone with their state and what each is doing; the fleet's golden signals; for a
mixture-of-experts model, the expert load (tokens/s per replica and expert, and each replica's imbalance)."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, dcc, html

from controlplane.client import (
    ActiveFault,
    ApiError,
    ControlPlaneClient,
    ExpertLoad,
    FleetView,
    MetricSummary,
    Quantiles,
    ReplicaActivity,
)
from dashboards import figures, session
from dashboards.figures import STATE_COLORS, empty, expert_heatmap, ms, number, share, time_series
from dashboards.shell import REFRESH

CHART_MINUTES = 10.0
E2E = "vllm:e2e_request_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"
DENSE_NOTE = ("No replica reports expert load: the model has no experts (a dense model), so there is no "
              "expert imbalance to show.")


def layout(**_: Any) -> html.Div:
    return html.Div(
        [
            html.H2("Overview"),
            html.Div(id="ov-fleet-line", className="muted"),
            html.Div(id="ov-zones", className="zones"),
            html.Div(id="ov-kpis", className="cards"),
            html.Div(
                className="grid2",
                children=[
                    html.Div(
                        dcc.Graph(
                            id="ov-throughput", config={"displaylogo": False}, figure=empty("Throughput")
                        ),
                        className="panel",
                    ),
                    html.Div(
                        dcc.Graph(id="ov-latency", config={"displaylogo": False}, figure=empty("Latency")),
                        className="panel",
                    ),
                ],
            ),
            html.Div(expert_panel(None), id="ov-experts", className="panel"),
        ]
    )


dash.register_page(  # type: ignore[no-untyped-call]
    __name__, path="/", name="Overview", order=0, title="Overview · LLM SRE console", layout=layout
)


@dash.callback(
    Output("ov-fleet-line", "children"),
    Output("ov-zones", "children"),
    Output("ov-kpis", "children"),
    Input(REFRESH, "n_intervals"),
)
def refresh_status(_: int) -> tuple[Any, Any, Any]:
    try:
        api = session.client()
        fleet = api.fleet()
        faults = api.chaos_faults()
    except ApiError as exc:
        return f"control plane: {exc}", [], []
    activity = _activity(api)
    summary = _summary(api)
    line = (
        f"model {fleet.model} · generation {fleet.generation} · {fleet.ready_replicas}/"
        f"{fleet.desired_replicas} replicas ready" + (" · rollout in progress" if fleet.rollout else "")
    )
    return line, _zones(fleet, activity, faults), _kpis(summary)


def _activity(api: ControlPlaneClient) -> dict[str, ReplicaActivity]:
    try:
        return api.replica_activity()
    except ApiError:  # telemetry may still be warming up: the panels say "–"
        return {}


def _summary(api: ControlPlaneClient) -> MetricSummary | None:
    try:
        return api.summary("fleet")
    except ApiError:
        return None


def _zones(fleet: FleetView, activity: dict[str, ReplicaActivity],
           faults: list[ActiveFault]) -> list[html.Div]:
    by_target: dict[str, list[str]] = {}
    for f in faults:
        by_target.setdefault(f.target, []).append(f"{f.kind} #{f.id}")
    zones = []
    for zone in fleet.zones:
        replicas = sorted((r for r in fleet.replicas if r.zone == zone), key=lambda r: r.replica_id)
        cards = [
            _replica_card(r.replica_id, r.state, r.pid, activity.get(r.replica_id), by_target, node=r.node)
            for r in replicas
        ] or [html.Div("no replica", className="muted")]
        ready = sum(r.state == "ready" for r in replicas)
        down = " · NO NODE" if zone in fleet.zones_down else ""
        zones.append(
            html.Div(
                [html.H4(f"{zone} · {ready}/{len(replicas)} ready{down}"), *cards],
                className="zone",
                **figures.data_attrs(zone=zone),
            )
        )
    return zones


def _replica_card(
    rid: str, state: str, pid: int | None, load: ReplicaActivity | None, faults: dict[str, list[str]], *,
    node: str | None = None,
) -> html.Div:
    doing = _doing(state, load)
    lines: list[Any] = [
        html.Div(
            [
                html.Strong(rid),
                " ",
                html.Span(state, className="state", style={"color": STATE_COLORS.get(state)}),
                html.Span(f"  pid {pid or '-'}" + (f" · node {node}" if node else ""), className="muted"),
            ]
        ),
        html.Div(doing, className="doing"),
    ]
    if rid in faults:
        lines.append(
            html.Div("FAULT: " + ", ".join(faults[rid]), style={"color": "#b91c1c", "fontWeight": 700})
        )
    return html.Div(
        lines,
        className="replica-card",
        style={"borderLeftColor": STATE_COLORS.get(state)},
        **figures.data_attrs(replica=rid, state=state),
    )


def _doing(state: str, load: ReplicaActivity | None) -> str:
    if state != "ready":
        return {
            "starting": "loading the model, waiting for readiness",
            "draining": "finishing its requests",
            "ejected": "ejected by the gateway after failures",
            "crashed": "crashed; restarting with backoff",
        }.get(state, state)
    if not load:
        return "no metrics yet"
    running, waiting = load.running or 0, load.waiting or 0
    if running == 0 and waiting == 0:
        return "idle"
    return (
        f"{running:.0f} running, {waiting:.0f} waiting · KV {share(load.kv_usage)} · "
        f"{number(load.qps)} req/s · {number(load.tokens_per_s, 1)} tok/s"
    )


def _kpis(summary: MetricSummary | None) -> list[html.Div]:
    def card(label: str, value: str, key: str) -> html.Div:
        return html.Div(
            [html.Div(label, className="label"), html.Div(value, className="value")],
            className="card",
            id=f"kpi-{key}",
        )

    s = summary or MetricSummary(scope="fleet", window_s=0.0, replicas=(), qps=None, error_rate=None)
    cards = [
        card("QPS", number(s.qps), "qps"),
        card("error rate", share(s.error_rate), "errors"),
        card("tokens/s", number(s.generation_tokens_per_s, 1), "tokens"),
        card("KV usage (mean / max)", f"{share(s.kv_usage_mean)} / {share(s.kv_usage_max)}", "kv"),
        card("waiting / running", f"{number(s.num_waiting, 0)} / {number(s.num_running, 0)}", "queue"),
    ]
    latencies: tuple[tuple[str, str, Quantiles], ...] = (("ttft", "TTFT", s.ttft), ("tpot", "TPOT", s.tpot),
                                                         ("e2e", "E2E", s.e2e))
    for name, label, q in latencies:
        cards.append(card(f"{label} P50 / P95 / P99", " / ".join(ms(v) for v in (q.p50, q.p95, q.p99)), name))
    return cards


@dash.callback(
    Output("ov-throughput", "figure"), Output("ov-latency", "figure"), Input(REFRESH, "n_intervals")
)
def refresh_charts(_: int) -> tuple[Any, Any]:
    try:
        api = session.client()
        qps = _line(api, "vllm:request_success_total", kind="rate")
        tokens = _line(api, "vllm:generation_tokens_total", kind="rate")
        latency = {
            f"{label} P{int(q * 100)}": _line(api, metric, q=q)
            for metric, label in ((TTFT, "TTFT"), (E2E, "E2E"))
            for q in (0.5, 0.99)
        }
    except ApiError as exc:
        return empty("Throughput", str(exc)), empty("Latency", str(exc))
    return (
        time_series(f"Throughput (last {CHART_MINUTES:.0f} min)", {"requests/s": qps, "tokens/s": tokens}),
        time_series(f"Latency percentiles (last {CHART_MINUTES:.0f} min)", latency, unit="ms", scale=1000.0),
    )


def _line(
    api: ControlPlaneClient, metric: str, *, kind: str = "quantile", q: float | None = None
) -> list[tuple[float, float]]:
    series = api.metrics_range(metric, kind=kind, q=q, minutes=CHART_MINUTES, step_s=5.0)
    return list(series[0].points) if series else []


@dash.callback(Output("ov-experts", "children"), Input(REFRESH, "n_intervals"))
def refresh_experts(_: int) -> Any:
    try:
        load = session.client().expert_load()
    except ApiError as exc:
        return expert_panel(None, f"expert load: {exc}")
    return expert_panel(load)


def expert_panel(load: ExpertLoad | None, note: str = "") -> html.Div:
    """The heatmap for a mixture-of-experts fleet; for a dense one, a plain sentence (no empty chart);
    before the first answer or when telemetry does not answer, ``note``."""
    if load is not None and load.is_moe:
        return html.Div(
            dcc.Graph(id="ov-experts-heatmap", figure=expert_heatmap(load), config={"displaylogo": False}),
            id="ov-experts-body",
            **figures.data_attrs(moe="yes", experts=len(load.experts), replicas=len(load.replicas)),
        )
    text = DENSE_NOTE if load is not None else (note or "expert load: waiting for the first answer")
    return html.Div(
        [html.H4("Expert load"), html.Div(text, className="muted", id="ov-experts-note")],
        id="ov-experts-body",
        **figures.data_attrs(moe="no" if load is not None else "unknown"),
    )
