"""The Rollouts page's figures and tables: pure functions of ``/api/v1/versions`` and ``/api/v1/rollouts``
answers (the typed views of ``controlplane.client``), so that they are tested without a browser.

A release's ``steps`` are its records, oldest first: ``started`` (with the policy), ``step`` (a new share),
``analysis`` (the step's window, both sides' figures per metric, the verdict and the decision: next, extend
or abort), ``pause``/``resume``, and the end (``promoting``, ``aborted``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from dash import html

from controlplane.client import ReleaseView, RolloutsView, VersionsView
from dashboards.figures import base_layout, data_attrs, empty, when

STABLE_COLOUR = "#2563eb"
CANARY_COLOURS = ("#f59e0b", "#a855f7", "#0d9488", "#db2777")
UNCOLOURED = "#e2e8f0"
COLOUR_COLOURS = ("#16a34a", "#dc2626", "#0891b2", "#ca8a04")
# decision -> (marker symbol, colour, legend label)
DECISIONS = {
    "next": ("circle", "#16a34a", "analysis: next step"),
    "extend": ("diamond", "#f59e0b", "analysis: extend the step"),
    "abort": ("x", "#dc2626", "analysis: abort"),
}
# event -> (marker symbol, colour, legend label)
EVENTS = {
    "pause": ("line-ns-open", "#64748b", "paused"),
    "resume": ("triangle-right", "#64748b", "resumed"),
    "promoting": ("star", "#2563eb", "promoting"),
    "promoted": ("star", "#15803d", "promoted"),
    "aborted": ("x-thin-open", "#b91c1c", "aborted"),
}
LIVE = ("running", "paused")
SIDES = (("baseline", "stable"), ("candidate", "canary"))
HISTORY_HEAD = ("release", "version", "from", "kind", "outcome", "started (UTC)", "ended (UTC)",
                "highest share", "analyses", "reason")
ANALYSIS_HEAD = ("metric", "test", "side", "requests", "failed", "error rate", "p50 (ms)", "p95 (ms)",
                 "p99 (ms)", "p-value", "difference", "verdict", "reason")


# ---- what is shown -----------------------------------------------------------------------------------
def shown_release(view: RolloutsView) -> ReleaseView | None:
    """The running release, else the latest one (the history is newest first); None before any."""
    if view.release is not None:
        return view.release
    return view.history[0] if view.history else None


def is_live(release: ReleaseView | None) -> bool:
    return release is not None and release.outcome in LIVE


def current_share(release: ReleaseView) -> float | None:
    """The share of the release's last step (None before its first)."""
    shares = [float(s["share"]) for s in release.steps if s.get("event") == "step"]
    return shares[-1] if shares else None


def parse_steps(text: str | None) -> list[float]:
    """``"5, 20, 50, 100"`` (percent; spaces, commas or ``%`` signs) -> ``[5.0, 20.0, 50.0, 100.0]``;
    ``ValueError`` with a message for the operator otherwise (the API checks the rest)."""
    words = (text or "").replace(",", " ").replace(";", " ").replace("%", " ").split()
    if not words:
        raise ValueError("give the steps as percents, e.g. 5,20,50,100")
    try:
        steps = [float(w) for w in words]
    except ValueError:
        raise ValueError(f"steps: {text!r} is not a list of percents, e.g. 5,20,50,100") from None
    if any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
        raise ValueError("steps: increasing percents in (0, 100], e.g. 5,20,50,100")
    if steps[-1] != 100:
        raise ValueError("steps: the last step must be 100 (promotion follows it)")
    return steps


# ---- the split ---------------------------------------------------------------------------------------
def split_shares(view: RolloutsView) -> list[tuple[str, float]]:
    """(label, share) of the traffic split now: the stable version's rest first, then each version."""
    split = {str(k): float(v) for k, v in (view.plan.get("split") or {}).items()}
    stable = f"stable ({view.current})" if view.current else "stable"
    return [(stable, max(0.0, 1.0 - sum(split.values()))), *sorted(split.items())]


def colour_shares(view: RolloutsView) -> list[tuple[str, float]]:
    """(colour, share) of a slice experiment's colours now, with the uncoloured rest last; [] for none."""
    colours = {str(k): float(v) for k, v in (view.plan.get("colours") or {}).items()}
    if not colours:
        return []
    return [*sorted(colours.items()), ("uncoloured", max(0.0, 1.0 - sum(colours.values())))]


def split_line(view: RolloutsView) -> str:
    """``stable (v1) 95.0% · v2 5.0%`` (and the colours, if a slice experiment colours traffic)."""
    line = " · ".join(f"{name} {share * 100:.1f}%" for name, share in split_shares(view))
    colours = colour_shares(view)
    if colours:
        line += " | colours: " + " · ".join(f"{name} {share * 100:.1f}%" for name, share in colours)
    return line


def split_figure(view: RolloutsView) -> go.Figure:
    """One stacked horizontal bar of the version split (stable against each canary), and one of a slice
    experiment's colours when it has any."""
    fig = go.Figure()
    rows: list[tuple[str, list[tuple[str, float]], tuple[str, ...]]] = [
        ("versions", split_shares(view), (STABLE_COLOUR, *CANARY_COLOURS))]
    colours = colour_shares(view)
    if colours:
        rows.append(("colours", colours, (*COLOUR_COLOURS[:len(colours) - 1], UNCOLOURED)))
    for row, shares, palette in rows:
        for i, (name, share) in enumerate(shares):
            colour = palette[i] if i < len(palette) else palette[-1]
            fig.add_trace(go.Bar(
                y=[row], x=[share * 100], name=name, orientation="h", marker_color=colour,
                text=[f"{name} {share * 100:.1f}%"], textposition="inside", insidetextanchor="middle",
                hovertemplate=f"{name}: %{{x:.1f}}%<extra></extra>"))
    fig.update_layout(barmode="stack", showlegend=False)
    fig.update_xaxes(range=[0, 100], title_text="% of requests")
    fig.update_yaxes(autorange="reversed")
    return base_layout(fig, "Traffic split now", height=140 + 50 * len(rows))


# ---- a release's timeline ----------------------------------------------------------------------------
def _utc(posix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(posix_s))


def release_timeline(release: ReleaseView | None, *, now: float | None = None) -> go.Figure:
    """The canary's share over time (a step line), each analysis marked at its window's end by its
    decision (next / extend / abort), pauses and resumes, and the end (promoted at 100%, aborted at 0)."""
    if release is None:
        return empty("Release timeline", "no release yet", height=320)
    title = f"Release {release.id}: {release.version} from {release.from_version or '–'} ({release.outcome})"
    steps = [s for s in release.steps if s.get("event") == "step"]
    if not steps:
        return empty(title, "no step yet: the canary's replicas are starting", height=320)
    xs: list[float] = []
    ys: list[float] = []
    share = 0.0
    for record in release.steps:
        event, at = record.get("event"), record.get("at")
        if at is None:
            continue
        if event == "step":
            share = float(record["share"]) * 100
        elif event == "aborted":
            share = 0.0
        elif event not in ("started",):
            continue
        xs.append(float(at))
        ys.append(share)
    end = release.ended if release.ended is not None else (now if now is not None else time.time())
    if release.outcome == "promoted":
        share = 100.0
    if end >= xs[-1]:
        xs.append(float(end))
        ys.append(share)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[_utc(x) for x in xs], y=ys, name=f"{release.version} share (%)",
                             mode="lines", line={"shape": "hv", "color": CANARY_COLOURS[0], "width": 3},
                             hovertemplate="%{y:.0f}%<extra></extra>"))
    for decision, (symbol, colour, label) in DECISIONS.items():
        picked = [a for a in release.analyses if a.get("decision") == decision]
        if not picked:
            continue
        fig.add_trace(go.Scatter(
            x=[_utc(_window_end(a)) for a in picked], y=[float(a.get("share", 0)) * 100 for a in picked],
            mode="markers", name=label, marker={"symbol": symbol, "size": 13, "color": colour,
                                                 "line": {"width": 1, "color": "#0f172a"}},
            text=[analysis_hover(a) for a in picked], hovertemplate="%{text}<extra></extra>"))
    for event, (symbol, colour, label) in EVENTS.items():
        marks = _events(release, event)
        if not marks:
            continue
        fig.add_trace(go.Scatter(
            x=[_utc(at) for at, _ in marks], y=[y for _, y in marks], mode="markers", name=label,
            marker={"symbol": symbol, "size": 15, "color": colour, "line": {"width": 2, "color": colour}},
            text=[label] * len(marks), hovertemplate="%{text}<extra></extra>"))
    fig.update_yaxes(title_text="canary share (%)", range=[-5, 108])
    return base_layout(fig, title, height=320)


def _window_end(analysis: Mapping[str, Any]) -> float:
    window = analysis.get("window") or []
    return float(window[-1]) if window else float(analysis.get("at") or 0.0)


def _events(release: ReleaseView, event: str) -> list[tuple[float, float]]:
    """(at, share %) of each ``event`` record; ``promoted``: the release's end at 100%."""
    if event == "promoted":
        return [(release.ended, 100.0)] if release.outcome == "promoted" and release.ended else []
    found = []
    share = 0.0
    for record in release.steps:
        if record.get("event") == "step":
            share = float(record["share"]) * 100
        if record.get("event") == event and record.get("at") is not None:
            found.append((float(record["at"]), 0.0 if event == "aborted" else share))
    return found


def analysis_hover(analysis: Mapping[str, Any]) -> str:
    """``20%: pass -> next<br>ttft: ...``: what a marker's hover says."""
    reasons = "<br>".join(str(r) for r in analysis.get("reasons") or [])
    head = (f"{float(analysis.get('share', 0)) * 100:g}%: {analysis.get('verdict', '?')} -> "
            f"{analysis.get('decision', '?')}")
    return head + (f"<br>{reasons}" if reasons else "")


# ---- tables ------------------------------------------------------------------------------------------
def version_rows(view: VersionsView) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in ("version", "model", "created (UTC)", "notes",
                                                     "last analysis")])]
    for v in view.versions:
        current = v.name == view.current
        name: list[Any] = [v.name]
        if current:
            name.append(html.Span(" current", className="outcome-ok"))
        rows.append(html.Tr(
            [html.Td(name), html.Td(v.model), html.Td(when(v.created)), html.Td(v.notes or ""),
             html.Td(last_analysis(v.last_analysis))],
            className="version-row" + (" version-current" if current else ""),
            **data_attrs(version=v.name, current=str(current).lower())))
    if not view.versions:
        rows.append(html.Tr(html.Td("no version registered yet", colSpan=5), id="ro-no-versions"))
    return rows


def last_analysis(analysis: Mapping[str, Any] | None) -> str:
    """``pass at 20% -> next``; "–" before any."""
    if not analysis:
        return "–"
    share = analysis.get("share")
    at = f" at {float(share) * 100:g}%" if share is not None else ""
    return f"{analysis.get('verdict', '?')}{at} -> {analysis.get('decision', '?')}"


def release_summary(release: ReleaseView | None) -> html.Div:
    if release is None:
        return html.Div("no release yet: register a version, then start a canary of it",
                        id="ro-no-release", className="muted")
    share = current_share(release)
    policy = next((s.get("policy") for s in release.steps if s.get("event") == "started"), None) or {}
    steps = ", ".join(f"{float(s) * 100:g}" for s in policy.get("steps") or [])
    lines: list[Any] = [
        html.Strong(f"Release {release.id}: {release.version} (from {release.from_version or '–'}), "
                    f"{release.kind}: {release.outcome}", id="ro-release-title"),
        html.Div(f"started {when(release.started)} UTC · ended {when(release.ended)} UTC · "
                 f"share now {'–' if share is None else f'{share * 100:g}%'}"
                 + (f" · steps {steps}% every {policy.get('interval_s')} s" if steps else ""),
                 className="muted"),
    ]
    if release.reason:
        lines.append(html.Div(f"reason: {release.reason}", id="ro-release-reason"))
    return html.Div(lines, id="ro-release-body",
                    **data_attrs(release=release.id, version=release.version, outcome=release.outcome))


def analysis_tables(release: ReleaseView | None) -> list[Any]:
    """One table per analysis record, newest first, each under a line naming its step and decision."""
    if release is None or not release.analyses:
        return [html.Div("no step analysed yet", className="muted", id="ro-no-analysis")]
    out: list[Any] = []
    for number, analysis in reversed(list(enumerate(release.analyses, start=1))):
        out.append(html.Div(
            [html.H4(analysis_title(number, analysis)),
             html.Table(analysis_rows(analysis), className="data")],
            className="analysis",
            **data_attrs(step=number, share=analysis.get("share"), decision=analysis.get("decision"),
                         verdict=analysis.get("verdict"))))
    return out


def analysis_title(number: int, analysis: Mapping[str, Any]) -> str:
    window = analysis.get("window") or []
    span = ""
    if len(window) == 2:
        span = f", window {when(window[0])[11:]}-{when(window[1])[11:]} UTC ({window[1] - window[0]:.0f} s)"
    share = float(analysis.get("share", 0)) * 100
    return (f"Analysis {number}: {share:g}% of traffic{span}: {analysis.get('verdict', '?')} -> "
            f"{analysis.get('decision', '?')}")


def analysis_rows(analysis: Mapping[str, Any]) -> list[Any]:
    """Per metric two rows, stable and canary: requests, failed, error rate, p50/p95/p99; the metric's
    test, p-value, difference, verdict and reason span both."""
    rows: list[Any] = [html.Tr([html.Th(h) for h in ANALYSIS_HEAD])]
    for m in analysis.get("metrics") or []:
        metric = str(m.get("metric", "?"))
        verdict = str(m.get("verdict", "?"))
        for i, (key, side) in enumerate(SIDES):
            figures = m.get(key) or {}
            cells: list[Any] = []
            if i == 0:
                cells += [html.Td(metric, rowSpan=2), html.Td(str(m.get("test", "")), rowSpan=2)]
            cells += [html.Td(side), html.Td(_count(figures.get("requests"))),
                      html.Td(_count(figures.get("failed"))), html.Td(_rate(figures.get("error_rate"))),
                      html.Td(_ms(figures.get("p50"))), html.Td(_ms(figures.get("p95"))),
                      html.Td(_ms(figures.get("p99")))]
            if i == 0:
                cells += [html.Td(p_value(m.get("p_value")), rowSpan=2),
                          html.Td(difference(metric, m.get("difference")), rowSpan=2),
                          html.Td(verdict, rowSpan=2, className=_verdict_class(verdict)),
                          html.Td(str(m.get("reason", "")), rowSpan=2)]
            rows.append(html.Tr(cells, className="metric-row",
                                **data_attrs(metric=metric, side=side, verdict=verdict,
                                             requests=figures.get("requests"), p50=figures.get("p50"))))
    return rows


def history_rows(history: Sequence[ReleaseView]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in HISTORY_HEAD])]
    for r in history:
        shares = [float(s["share"]) for s in r.steps if s.get("event") == "step"]
        rows.append(html.Tr(
            [html.Td(str(r.id)), html.Td(r.version), html.Td(r.from_version or "–"), html.Td(r.kind),
             html.Td(r.outcome, className=_outcome_class(r.outcome)), html.Td(when(r.started)),
             html.Td(when(r.ended)), html.Td(f"{max(shares) * 100:g}%" if shares else "–"),
             html.Td(str(len(r.analyses))), html.Td(r.reason or "")],
            className="release-row", **data_attrs(release=r.id, version=r.version, outcome=r.outcome)))
    if not history:
        rows.append(html.Tr(html.Td("no release yet", colSpan=len(HISTORY_HEAD)), id="ro-no-history"))
    return rows


# ---- formatting --------------------------------------------------------------------------------------
def p_value(value: Any) -> str:
    return "not tested" if value is None else f"{float(value):.3g}"


def difference(metric: str, value: Any) -> str:
    """errors: the canary's failure share minus stable's, in points; latency: the median ratio."""
    if value is None:
        return "–"
    value = float(value)
    if metric == "errors":
        return f"{value * 100:+.2f} pp"
    return "∞" if math.isinf(value) else f"×{value:.2f}"


def _count(value: Any) -> str:
    return "–" if value is None else str(value)


def _rate(value: Any) -> str:
    return "–" if value is None else f"{float(value) * 100:.2f}%"


def _ms(value: Any) -> str:
    return "–" if value is None else f"{float(value):,.1f}"


def _verdict_class(verdict: str) -> str:
    return {"pass": "outcome-ok", "fail": "outcome-error"}.get(verdict, "")


def _outcome_class(outcome: str) -> str:
    return {"promoted": "outcome-ok", "aborted": "outcome-error"}.get(outcome, "")
