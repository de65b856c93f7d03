"""The Chaos page's slice-experiment figures and tables: pure functions of ``/api/v1/experiments/slices``
answers (the typed views of ``controlplane.client``), so that they are tested without a browser.

A slice experiment puts a coloured fault on a ``share`` of traffic (the experiment colour) and compares it
with a control colour of the same share every ``check_interval_s``; each check counts both sides since the
colours went on (and the uncoloured rest, which the fault must never reach). At the end the report has both
sides' figures per metric and each difference (experiment minus control) with its 95% interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from dash import html

from controlplane.client import (
    SliceCheck,
    SliceCounts,
    SliceDifference,
    SliceExperiment,
    SliceExperimentSummary,
    SliceMetricFigures,
)
from dashboards.figures import base_layout, data_attrs, empty, when

EXPERIMENT_COLOUR = "#dc2626"
CONTROL_COLOUR = "#2563eb"
VERDICT_COLOURS = {"pass": "#16a34a", "fail": "#dc2626", "inconclusive": "#94a3b8"}
# fault kind -> (its parameter, the form's label, the form's default)
FAULTS = {
    "error_rate": ("probability", "Probability (0..1] of refusing a request", 0.2),
    "token_latency": ("seconds", "Extra seconds per token", 0.05),
    "prefill_delay": ("seconds", "Extra seconds before the first token", 0.2),
}
# report metric -> the difference that goes with it
DIFFERENCES = {"errors": "error_rate", "ttft": "ttft_p50_s", "tpot": "tpot_p50_s"}
SIDES_HEAD = ("metric", "side", "requests", "failed", "error rate", "p50 (ms)", "p95 (ms)", "p99 (ms)",
              "difference (exp − ctl)", "95% interval", "significant")
HISTORY_HEAD = ("id", "status", "fault", "share", "by", "started (UTC)", "stopped", "after",
                "experiment req / failed", "control req / failed", "uncoloured req / failed")
STATUS_CLASS = {"completed": "outcome-ok", "deviated": "outcome-error", "failed": "outcome-error",
                "interrupted": "outcome-error"}


# ---- the form ------------------------------------------------------------------------------------
def start_request(share_pct: Any, fault: Any, param: Any, duration_s: Any, interval_s: Any,
                  max_error_pp: Any, max_latency_ratio: Any) -> dict[str, Any]:
    """The form's fields (share and max error increase in percent) as the keyword arguments of
    ``ControlPlaneClient.slice_experiment_start``; ValueError with a message for the operator (the API
    checks the rest and names the field it refuses). An empty bound: the API's default."""
    if fault not in FAULTS:
        raise ValueError(f"choose a fault: {', '.join(FAULTS)}")
    name = FAULTS[str(fault)][0]
    share = _number("share", share_pct)
    value = _number(name, param)
    if not 0 < share <= 50:
        raise ValueError("share: a percent in (0, 50] (two slices of it: experiment and control)")
    request: dict[str, Any] = {"share": share / 100, "fault": str(fault), "params": {name: value},
                               "duration_s": _number("duration", duration_s),
                               "check_interval_s": _number("check interval", interval_s)}
    bounds: dict[str, float] = {}
    if max_error_pp not in (None, ""):
        bounds["max_error_increase"] = _number("max error increase", max_error_pp) / 100
    if max_latency_ratio not in (None, ""):
        bounds["max_latency_ratio"] = _number("max latency ratio", max_latency_ratio)
    if bounds:
        request["bounds"] = bounds
    return request


def _number(name: str, value: Any) -> float:
    if value is None or value == "" or isinstance(value, bool):
        raise ValueError(f"{name}: give a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not a number") from None


# ---- what is shown -------------------------------------------------------------------------------
def shown_id(listing: Sequence[SliceExperimentSummary]) -> int | None:
    """The running experiment, else the latest (the listing is newest first); None before any."""
    running = next((s for s in listing if s.status == "running"), None)
    if running is not None:
        return running.id
    return listing[0].id if listing else None


def is_running(experiment: SliceExperiment | None) -> bool:
    return experiment is not None and experiment.status == "running"


def describe_fault(fault: str, params: Any) -> str:
    """``error_rate (probability 0.2)``."""
    shown = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in dict(params).items()
                      if k != "colour")
    return f"{fault} ({shown})" if shown else fault


def latest_counts(experiment: SliceExperiment) -> tuple[SliceCounts, SliceCounts, SliceCounts] | None:
    """(experiment, control, uncoloured) counts: the report's, else the latest check's; None before both."""
    if experiment.report is not None:
        r = experiment.report
        return (SliceCounts(r.experiment.requests, r.experiment.failed),
                SliceCounts(r.control.requests, r.control.failed), r.uncoloured)
    if experiment.checks:
        c = experiment.checks[-1]
        return c.experiment, c.control, c.uncoloured
    return None


def summary(experiment: SliceExperiment | None, *, now: float | None = None) -> html.Div:
    """Its status, fault and share, why it stopped and when (the time to stop), and the clean-up."""
    if experiment is None:
        return html.Div("no slice experiment yet: start one with the form", id="sx-none", className="muted")
    spec = experiment.spec
    lines: list[Any] = [
        html.Strong(f"Slice experiment {experiment.id}: {describe_fault(spec.fault, spec.params)} on "
                    f"{spec.share * 100:g}% ({spec.colour}) against {spec.share * 100:g}% ({spec.control})"
                    f": {experiment.status}", id="sx-title",
                    className=STATUS_CLASS.get(experiment.status, "")),
        html.Div(f"by {experiment.by or '–'} · started {when(experiment.started_at)} UTC · ended "
                 f"{when(experiment.finished_at)} UTC · duration {spec.duration_s:g} s, a check every "
                 f"{spec.check_interval_s:g} s · bounds: +{spec.bounds.max_error_increase * 100:g} pp "
                 f"errors, ×{spec.bounds.max_latency_ratio:g} median latency (alpha {spec.bounds.alpha:g}, "
                 f"min {spec.bounds.min_samples} a side)", className="muted"),
    ]
    if is_running(experiment):
        since = experiment.coloured_at
        running = "" if since is None or now is None else f" for {max(0.0, now - since):.0f} s"
        last = experiment.checks[-1].verdict if experiment.checks else "none yet"
        lines.append(html.Div(f"running{running}: {len(experiment.checks)} check(s), last verdict {last}",
                              id="sx-running"))
    if experiment.stopped is not None:
        stop = experiment.stopped
        after = "–" if stop.after_s is None else f"{stop.after_s:.1f} s"
        lines.append(html.Div([html.Span(f"stopped: {stop.reason}"), html.Span(f" · time to stop: {after}"),
                               html.Div(stop.detail, className="muted") if stop.detail else ""],
                              id="sx-stopped", **data_attrs(reason=stop.reason, after=stop.after_s)))
    if experiment.finished:
        lines.append(html.Div(f"faults reverted: {_yes(experiment.faults_reverted)} · colours cleared: "
                              f"{_yes(experiment.colours_cleared)}", className="muted", id="sx-cleanup"))
    if experiment.error:
        lines.append(html.Div(f"error: {experiment.error}", className="notice", id="sx-error"))
    return html.Div(lines, id="sx-body",
                    **data_attrs(experiment=experiment.id, status=experiment.status, fault=spec.fault))


def _yes(value: bool | None) -> str:
    return "–" if value is None else ("yes" if value else "NO")


# ---- the checks over time ------------------------------------------------------------------------
def checks_figure(experiment: SliceExperiment | None) -> go.Figure:
    """Each side's failure share per check (the experiment's markers coloured by the check's verdict) and
    its requests, against seconds after the colours went on; the stop marked by a vertical line."""
    if experiment is None:
        return empty("Slice experiment checks", "no slice experiment yet", height=320)
    title = f"Experiment {experiment.id}: {experiment.spec.fault} ({experiment.status})"
    checks = list(experiment.checks)
    if not checks:
        return empty(title, "no check yet" if is_running(experiment) else "no check recorded", height=320)
    ts = [c.t for c in checks]
    fig = go.Figure()
    sides = (("experiment", experiment.spec.colour, EXPERIMENT_COLOUR),
             ("control", experiment.spec.control, CONTROL_COLOUR))
    for side, colour, line in sides:
        counts = [_side(c, side) for c in checks]
        fig.add_trace(go.Scatter(
            x=ts, y=[_failure_pct(c) for c in counts], name=f"{side} ({colour}) failures %",
            mode="lines+markers", line={"color": line, "width": 2},
            marker={"size": 8, "line": {"width": 1, "color": line},
                    "color": [VERDICT_COLOURS.get(c.verdict, "#94a3b8") for c in checks]
                    if side == "experiment" else line},
            text=[check_hover(c, side) for c in checks], hovertemplate="%{text}<extra></extra>"))
        fig.add_trace(go.Scatter(
            x=ts, y=[c.requests for c in counts], name=f"{side} requests", mode="lines", yaxis="y2",
            line={"color": line, "dash": "dot", "width": 1}, hovertemplate="%{y} requests<extra></extra>"))
    stop = experiment.stopped
    if stop is not None and stop.after_s is not None:
        fig.add_vline(x=stop.after_s, line_dash="dash", line_width=2,
                      line_color=EXPERIMENT_COLOUR if stop.reason == "deviation" else "#64748b",
                      annotation_text=f"stop: {stop.reason}", annotation_font_size=11)
    fig.update_layout(xaxis={"title": {"text": "seconds after the colours went on"}},
                      yaxis={"title": {"text": "failed (% of the side's requests)"}, "rangemode": "tozero"},
                      yaxis2={"title": {"text": "requests"}, "overlaying": "y", "side": "right",
                              "rangemode": "tozero", "showgrid": False})
    return base_layout(fig, title, height=340)


def _side(check: SliceCheck, side: str) -> SliceCounts:
    return check.experiment if side == "experiment" else check.control


def _failure_pct(counts: SliceCounts) -> float | None:
    return counts.failed / counts.requests * 100 if counts.requests else None


def check_hover(check: SliceCheck, side: str) -> str:
    counts = _side(check, side)
    reasons = "".join(f"<br>{r}" for r in check.reasons)
    return f"t={check.t:g} s {side}: {counts.failed}/{counts.requests} failed · {check.verdict}{reasons}"


# ---- tables --------------------------------------------------------------------------------------
def sides_rows(experiment: SliceExperiment | None) -> list[Any]:
    """Per metric two rows, experiment and control (requests, failed, error rate, P50/P95/P99), with the
    difference and its 95% interval spanning both; then the uncoloured requests (their failures must be 0).
    While it runs (no report yet): the latest check's counts."""
    rows: list[Any] = [html.Tr([html.Th(h) for h in SIDES_HEAD])]
    if experiment is None:
        rows.append(html.Tr(html.Td("no slice experiment yet", colSpan=len(SIDES_HEAD)), id="sx-no-sides"))
        return rows
    spec, report = experiment.spec, experiment.report
    names = (("experiment", spec.colour), ("control", spec.control))
    if report is not None:
        metrics = [m for m in ("errors", "ttft", "tpot")
                   if m in report.experiment.metrics or m in report.control.metrics]
        for metric in metrics:
            diff = report.difference(DIFFERENCES[metric])
            for i, (side, colour) in enumerate(names):
                figures = (report.experiment if side == "experiment" else report.control).metrics.get(metric)
                rows.append(_side_row(metric, f"{side} ({colour})", figures, diff if i == 0 else None,
                                      first=i == 0))
    else:
        counts = latest_counts(experiment)
        if counts is None:
            rows.append(html.Tr(html.Td("no check yet", colSpan=len(SIDES_HEAD)), id="sx-no-sides"))
        else:
            for i, (side, colour) in enumerate(names):
                c = counts[i]
                figures = SliceMetricFigures(c.requests, c.failed, c.failed / c.requests if c.requests else 0)
                rows.append(_side_row("errors (so far)", f"{side} ({colour})", figures, None, first=i == 0,
                                      pending=True))
    counts = latest_counts(experiment)
    if counts is not None:
        rows.append(uncoloured_row(counts[2]))
    return rows


def _side_row(metric: str, side: str, figures: SliceMetricFigures | None, diff: SliceDifference | None, *,
              first: bool, pending: bool = False) -> html.Tr:
    cells: list[Any] = []
    if first:
        cells.append(html.Td(metric, rowSpan=2))
    f = figures
    cells += [html.Td(side), html.Td("–" if f is None else str(f.requests)),
              html.Td("–" if f is None else str(f.failed)),
              html.Td("–" if f is None else f"{f.error_rate * 100:.2f}%"),
              html.Td(_ms(None if f is None else f.p50)), html.Td(_ms(None if f is None else f.p95)),
              html.Td(_ms(None if f is None else f.p99))]
    if first:
        if pending:
            cells.append(html.Td("with the report, at the end", colSpan=3, className="muted", rowSpan=2))
        else:
            cells += [html.Td(difference_text(diff), rowSpan=2), html.Td(interval_text(diff), rowSpan=2),
                      html.Td(_significant(diff), rowSpan=2,
                              className="outcome-error" if diff is not None and diff.excludes_zero else "")]
    return html.Tr(cells, className="side-row",
                   **data_attrs(metric=metric, side=side.split(" ")[0],
                                requests=None if f is None else f.requests,
                                failed=None if f is None else f.failed))


def uncoloured_row(counts: SliceCounts) -> html.Tr:
    ok = counts.failed == 0
    return html.Tr(
        [html.Td("uncoloured"), html.Td("neither colour"), html.Td(str(counts.requests)),
         html.Td(str(counts.failed), className="outcome-ok" if ok else "outcome-error"),
         html.Td(f"{counts.failed / counts.requests * 100:.2f}%" if counts.requests else "–"),
         html.Td("the fault must not reach them: failures must be 0"
                 + ("" if ok else f" — {counts.failed} FAILED"), colSpan=6,
                 className="muted" if ok else "outcome-error")],
        id="sx-uncoloured", **data_attrs(requests=counts.requests, failed=counts.failed))


def difference_text(diff: SliceDifference | None) -> str:
    """error_rate: points of failure share; the medians: milliseconds."""
    if diff is None:
        return "–"
    if diff.metric == "error_rate":
        return f"{diff.estimate * 100:+.2f} pp"
    return f"{diff.estimate * 1000:+,.1f} ms"


def interval_text(diff: SliceDifference | None) -> str:
    if diff is None:
        return "–"
    scale, unit = (100, " pp") if diff.metric == "error_rate" else (1000, " ms")
    return f"[{diff.low * scale:+,.2f}, {diff.high * scale:+,.2f}]{unit}"


def _significant(diff: SliceDifference | None) -> str:
    if diff is None:
        return "–"
    return "yes: excludes 0" if diff.excludes_zero else "no: includes 0"


def history_rows(listing: Sequence[SliceExperimentSummary]) -> list[Any]:
    rows: list[Any] = [html.Tr([html.Th(h) for h in HISTORY_HEAD])]
    for s in listing:
        after = "–" if s.stopped is None or s.stopped.after_s is None else f"{s.stopped.after_s:.1f} s"
        rows.append(html.Tr(
            [html.Td(str(s.id)), html.Td(s.status, className=STATUS_CLASS.get(s.status, "")),
             html.Td(s.fault), html.Td(f"{s.share * 100:g}%"), html.Td(s.by or "–"),
             html.Td(when(s.started_at)),
             html.Td("–" if s.stopped is None else s.stopped.reason), html.Td(after),
             html.Td(_counts(s.experiment)), html.Td(_counts(s.control)),
             html.Td(_counts(s.uncoloured),
                     className="outcome-error" if s.uncoloured is not None and s.uncoloured.failed else "")],
            className="slice-row", **data_attrs(experiment=s.id, status=s.status, fault=s.fault)))
    if not listing:
        rows.append(html.Tr(html.Td("no slice experiment yet", colSpan=len(HISTORY_HEAD)),
                            id="sx-no-history"))
    return rows


def _counts(counts: SliceCounts | None) -> str:
    return "–" if counts is None else f"{counts.requests} / {counts.failed}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"
