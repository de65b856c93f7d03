"""Plotly figures and small formatting helpers the pages share; pure functions of API answers."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from controlplane.client import (
    Decision,
    DrillReport,
    ExpertLoad,
    LatencyBreakdown,
    Scenario,
    SimulationResult,
    StageMeans,
)

STAGES = ("gateway", "queue", "prefill", "decode", "serialization")
STAGE_COLORS = {
    "gateway": "#64748b",
    "queue": "#f59e0b",
    "prefill": "#3b82f6",
    "decode": "#10b981",
    "serialization": "#a855f7",
}
STATE_COLORS = {
    "ready": "#16a34a",
    "starting": "#2563eb",
    "draining": "#d97706",
    "ejected": "#dc2626",
    "crashed": "#dc2626",
    "stopped": "#6b7280",
}
EMPTY_NOTE = "no data yet"


def base_layout(fig: go.Figure, title: str, *, height: int = 300) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 14}},
        height=height,
        margin={"l": 50, "r": 20, "t": 40, "b": 40},
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def empty(title: str, note: str = EMPTY_NOTE, *, height: int = 300) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(
        text=note,
        showarrow=False,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        font={"size": 13, "color": "#64748b"},
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return base_layout(fig, title, height=height)


def time_series(
    title: str,
    lines: Mapping[str, Sequence[Sequence[float]]],
    *,
    unit: str = "",
    scale: float = 1.0,
    height: int = 300,
) -> go.Figure:
    """One line per name from ``[[posix_s, value], ...]`` points (as ``/api/v1/metrics/range`` answers)."""
    if not any(lines.values()):
        return empty(title, height=height)
    fig = go.Figure()
    for name, points in lines.items():
        xs = [_utc(p[0]) for p in points]
        fig.add_trace(go.Scatter(x=xs, y=[p[1] * scale for p in points], mode="lines", name=name))
    fig.update_yaxes(title_text=unit, rangemode="tozero")
    return base_layout(fig, title, height=height)


def breakdown_bars(breakdown: LatencyBreakdown) -> go.Figure:
    """Two horizontal stacked bars: where the time of tail requests and of typical requests goes (ms)."""
    title = "Where the time goes (mean per stage, ms)"
    rows = _breakdown_rows(breakdown)
    if not rows:
        return empty(title, "no traces in this window and scope")
    fig = go.Figure()
    for stage in STAGES:
        fig.add_trace(
            go.Bar(
                y=[label for label, _ in rows],
                x=[g.stages_s[stage] * 1000 for _, g in rows],
                name=stage,
                orientation="h",
                marker_color=STAGE_COLORS[stage],
                hovertemplate=f"{stage}: %{{x:.1f}} ms<extra></extra>",
            )
        )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="ms")
    return base_layout(fig, title, height=280).update_layout(legend={"y": -0.45})


def _breakdown_rows(breakdown: LatencyBreakdown) -> list[tuple[str, StageMeans]]:
    rows = []
    if breakdown.median:
        rows.append((f"P50 typical (n={breakdown.median.count})", breakdown.median))
    if breakdown.tail:
        rows.append((f"P{percent(breakdown.quantile)} tail (n={breakdown.tail.count})", breakdown.tail))
    return rows


def replica_comparison(breakdown: LatencyBreakdown) -> go.Figure:
    """Per replica: the mean stage times of its own tail requests, stacked."""
    title = f"Per replica: P{percent(breakdown.quantile)} tail by stage (ms)"
    replicas = {rid: v.tail for rid, v in breakdown.by_replica.items() if v.tail}
    if not replicas:
        return empty(title, "no traces in this window and scope")
    fig = go.Figure()
    for stage in STAGES:
        fig.add_trace(
            go.Bar(
                x=list(replicas),
                y=[g.stages_s[stage] * 1000 for g in replicas.values()],
                name=stage,
                marker_color=STAGE_COLORS[stage],
            )
        )
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="ms")
    return base_layout(fig, title)


def expert_heatmap(load: ExpertLoad) -> go.Figure:
    """Replicas (rows) x experts (columns), colored by tokens/s over the window; each row is labelled with
    the replica's imbalance (busiest expert over the mean, worst layer, since start; "–" for a replica that
    stopped reporting it), and the hover adds the tokens since start and the imbalance in the window. The
    caller shows this only for a mixture-of-experts fleet."""
    rows = sorted(load.replicas, key=lambda r: r.replica)
    worst = max((r for r in rows if r.imbalance is not None), key=lambda r: r.imbalance or 0.0, default=None)
    title = f"Expert load: tokens/s per expert (last {load.window_s:g} s)"
    if worst is not None:
        title += f" · worst imbalance {ratio(worst.imbalance)} on {worst.replica}"
    if not rows:
        return empty(title, "no replica reports expert load yet", height=320)
    experts = [f"E{e}" for e in load.experts]
    labels = [f"{r.replica} · imbalance {ratio(r.imbalance)}" for r in rows]
    hover = [[[r.replica, number(total, 0), ratio(r.imbalance), ratio(r.recent_imbalance)]
              for total in r.tokens_total] for r in rows]
    fig = go.Figure(go.Heatmap(
        z=[list(r.tokens_per_s) for r in rows], x=experts, y=labels, customdata=hover,
        colorscale="Viridis", colorbar={"title": {"text": "tok/s"}}, hoverongaps=False,
        hovertemplate=("replica %{customdata[0]} · expert %{x}<br>%{z:.2f} tokens/s · %{customdata[1]} "
                       "tokens since start<br>imbalance %{customdata[2]} since start, %{customdata[3]} "
                       "in the window<extra></extra>")))
    fig.update_xaxes(title_text="expert", type="category")
    fig.update_yaxes(type="category", autorange="reversed")  # the row labels say what they are
    return base_layout(fig, title, height=max(260, 120 + 34 * len(rows)))


def ratio(value: float | None) -> str:
    """An imbalance: "1.42×"; "–" when unknown or before any token (0)."""
    return "–" if not value else f"{value:.2f}×"


def percent(q: float) -> str:
    """0.99 -> "99", 0.995 -> "99.5"."""
    return f"{q * 100:g}"


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.0f} ms"


def share(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def number(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def when(posix_s: float | None) -> str:
    return "–" if posix_s is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(posix_s))


def _utc(posix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(posix_s))


def progress(fraction: float | None, label: str = "") -> Any:
    """A progress bar for long work that runs in the control plane (0..1; None: not started)."""
    from dash import html

    value = 0.0 if fraction is None else min(max(fraction, 0.0), 1.0)
    return html.Div(
        [
            html.Progress(value=f"{value:.3f}", max="1", style={"width": "20rem"}),
            html.Span(f" {value * 100:.0f}% {label}"),
        ],
        className="progress",
    )


# ---- autoscaler, simulator, drills (console part 2) ---------------------------------------------------
def autoscaler_timeline(decisions: Sequence[Decision]) -> go.Figure:
    """Replicas (current and decided) against load (request rate, demand) over time, from decision
    records; a marker on every tick whose decision differs from the current count (filled: applied,
    hollow: observe-only or not applied)."""
    title = "Replicas vs load (autoscaler decisions)"
    records = sorted(decisions, key=lambda d: d.at)
    if not records:
        return empty(title, "no decision recorded yet", height=320)
    xs = [_utc(d.at) for d in records]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[d.inputs.request_rate for d in records], name="load (req/s)",
                             mode="lines", line={"color": "#94a3b8"}, yaxis="y2"))
    if any(d.inputs.refused_rate for d in records):  # part of the load above, never seen by a replica
        fig.add_trace(go.Scatter(x=xs, y=[d.inputs.refused_rate for d in records],
                                 name="refused at the gateways (req/s)", mode="lines",
                                 line={"color": "#dc2626", "dash": "dot"}, yaxis="y2"))
    fig.add_trace(go.Scatter(x=xs, y=[d.inputs.demand for d in records], name="offered load (engine s/s)",
                             mode="lines", line={"color": "#f59e0b", "dash": "dot"}, yaxis="y2"))
    fig.add_trace(go.Scatter(x=xs, y=[d.inputs.current for d in records], name="replicas (current)",
                             mode="lines", line={"shape": "hv", "color": "#2563eb"}))
    fig.add_trace(go.Scatter(x=xs, y=[d.final for d in records], name="replicas (decided)",
                             mode="lines", line={"shape": "hv", "color": "#16a34a", "dash": "dash"}))
    changes = [d for d in records if d.final != d.inputs.current]
    for applied in (True, False):
        picked = [d for d in changes if d.applied == applied]
        fig.add_trace(go.Scatter(
            x=[_utc(d.at) for d in picked], y=[d.final for d in picked],
            mode="markers", name="scale decision (applied)" if applied else "scale decision (not applied)",
            marker={"size": 11, "symbol": "diamond" if applied else "diamond-open", "color": "#dc2626"},
            text=[decision_reason(d) for d in picked], hovertemplate="%{text}<extra></extra>"))
    fig.update_layout(yaxis={"title": {"text": "replicas"}, "rangemode": "tozero"},
                      yaxis2={"title": {"text": "load"}, "overlaying": "y", "side": "right",
                              "rangemode": "tozero"})
    return base_layout(fig, title, height=320)


def decision_reason(decision: Decision) -> str:
    """One line: each proposal with its reason, then the clamps, then what happened."""
    parts = [f"{p.source} -> {p.replicas}: {p.reason}" for p in decision.proposals]
    parts += [f"clamp: {c}" for c in decision.clamps]
    parts.append(f"final {decision.final} ({decision.outcome})")
    return "; ".join(parts)


def profile_drift_text(last: Decision | None) -> str:
    """The last decision's profile drift: engine time observed over the profile's prediction, and the shares
    of the engines' step time on a core and waiting for one (the rest they waited for the interpreter lock)
    where the replicas count them."""
    drift = None if last is None else last.inputs.profile_drift
    if not drift:
        return "– (replicas too idle to judge)"
    ratio = float(drift["ratio"])
    on_cpu = "" if drift.get("on_cpu") is None else f", {float(drift['on_cpu']):.0%} on a core"
    if on_cpu and drift.get("waiting_core") is not None:
        on_cpu += f", {float(drift['waiting_core']):.0%} waiting for one"
    return f"{ratio:.2f}x{on_cpu}" + (" (stale: run controlplane calibrate)" if drift.get("stale") else "")


def simulation_timeline(result: SimulationResult | None) -> go.Figure:
    """What-if: each policy's replicas over simulated time against the trace's load."""
    title = "What-if: replicas per policy vs load"
    if result is None or not result.policies:
        return empty(title, "run a simulation", height=320)
    fig = go.Figure()
    first = result.policies[0].timeline
    fig.add_trace(go.Scatter(x=list(first.at), y=list(first.load_rps), name="load (req/s)",
                             mode="lines", line={"color": "#94a3b8"}, yaxis="y2"))
    for p in result.policies:
        fig.add_trace(go.Scatter(x=list(p.timeline.at), y=list(p.timeline.replicas),
                                 name=f"{p.policy} replicas", mode="lines", line={"shape": "hv"}))
    fig.update_layout(xaxis={"title": {"text": "simulated seconds"}},
                      yaxis={"title": {"text": "replicas"}, "rangemode": "tozero"},
                      yaxis2={"title": {"text": "req/s"}, "overlaying": "y", "side": "right",
                              "rangemode": "tozero"})
    return base_layout(fig, title, height=320)


DRILL_MARKERS = ("t_detect", "t_switch", "t_first_ok", "t_slo", "t_capacity")


def drill_timeline(report: DrillReport | None) -> go.Figure:
    """The drill's client timeline against seconds after t0: load sent, errors, P99 TTFT and ready
    replicas, with a vertical line at t0 and at each measured t_* (from the report's series)."""
    title = f"Drill {report.id}: {report.scenario} ({report.status})" if report else "Drill timeline"
    series = report.timeline if report else {}
    ts = list(series.get("t") or [])
    if not ts:
        return empty(title, "the timeline comes with the report", height=360)
    ready = series.get("ready") or []
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ts, y=series.get("sent_rps", []), name="sent (req/s)", mode="lines",
                             line={"color": "#2563eb"}))
    fig.add_trace(go.Bar(x=ts, y=series.get("errors", []), name="errors", marker_color="#dc2626"))
    fig.add_trace(go.Scatter(x=ts, y=series.get("ttft_p99_s", []), name="P99 TTFT (s)",
                             mode="lines+markers", yaxis="y2", line={"color": "#f59e0b"},
                             connectgaps=True))
    fig.add_trace(go.Scatter(x=[p[0] for p in ready], y=[p[1] for p in ready], name="ready replicas",
                             mode="lines", line={"shape": "hv", "color": "#16a34a"}, yaxis="y3"))
    figures = report.figures if report else {}
    marks = {"t0": 0.0, **{m: figures.get(m) for m in DRILL_MARKERS}}
    for name, x in marks.items():
        if x is None:
            continue
        fig.add_vline(x=float(x), line_dash="solid" if name == "t0" else "dot", line_width=1,
                      annotation_text=name, annotation_textangle=-45, annotation_font_size=10)
    fig.update_layout(
        xaxis={"title": {"text": "seconds after t0"}, "domain": [0, 0.88]},
        yaxis={"title": {"text": "req/s, errors"}, "rangemode": "tozero"},
        yaxis2={"title": {"text": "P99 TTFT (s)"}, "overlaying": "y", "side": "right", "rangemode": "tozero"},
        yaxis3={"title": {"text": "ready"}, "overlaying": "y", "side": "right", "anchor": "free",
                "position": 0.97, "rangemode": "tozero"},
        barmode="overlay")
    return base_layout(fig, title, height=360)


def data_attrs(**attrs: Any) -> dict[str, Any]:
    """``data-*`` attributes of a component, as text: what the browser tests read (``zone=...`` becomes
    ``data-zone``)."""
    return {f"data-{k}": str(v) for k, v in attrs.items()}


def number_input(cid: str, label: str, value: Any, operate: bool, width: str = "7rem") -> Any:
    """A labelled number field (>= 0), disabled for a role that may not change anything."""
    from dash import dcc, html

    return html.Div([html.Label(label), dcc.Input(id=cid, type="number", value=value, min=0,
                                                  disabled=not operate, style={"width": width})])


def scenario_options(scenarios: list[Scenario]) -> list[dict[str, Any]]:
    """Drill scenarios as dropdown options."""
    return [{"label": f"{s.id}: {s.title}", "value": s.id} for s in scenarios]
