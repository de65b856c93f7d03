"""Drill reports for people: a one-line summary, Markdown, a side-by-side comparison and a Plotly timeline.

Input is the JSON report ``chaos.drills`` produces (as stored in the ``drills`` collection and returned by
``GET /api/v1/drills/{id}``); nothing here talks to the fleet, so the CLI, the API and the console (which
gets the report through the REST API and calls :func:`timeline_figure`) all render the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# (figure, label, unit) in report order
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("rto_service_s", "RTO service", "s"),
    ("rto_service_p99_s", "RTO service p99 (per request)", "s"),
    ("rto_slo_s", "RTO SLO", "s"),
    ("rto_capacity_s", "RTO capacity", "s"),
    ("t_detect", "t_detect", "s"),
    ("t_switch", "t_switch", "s"),
    ("t_first_ok", "t_first_ok", "s"),
    ("t_service", "t_service", "s"),
    ("t_slo", "t_slo", "s"),
    ("t_capacity", "t_capacity", "s"),
    ("requests_total", "requests sent", ""),
    ("requests_affected", "requests affected", ""),
    ("requests_failed", "requests failed", ""),
    ("requests_resumed", "requests resumed", ""),
    ("tokens_lost", "tokens lost", ""),
    ("tokens_duplicated", "tokens duplicated", ""),
    ("writes_lost", "acknowledged writes lost", ""),
    ("rto_api_s", "RTO API (restart to the first answer)", "s"),
    ("faults_past_expiry", "faults in effect past their expiry", ""),
    ("orphans", "orphaned processes", ""),
    ("uncoloured_failed", "uncoloured requests failed (slice experiment)", ""),
    ("slice_stop_s", "slice experiment: self-stop on the deviation after", "s"),
    ("slice_sides_missing", "slice experiment: sides unreported", ""),
)
# Shown only when measured: they belong to some scenarios (the control plane's own crash, a slice
# experiment) only.
OPTIONAL = frozenset({"rto_api_s", "faults_past_expiry", "orphans", "uncoloured_failed", "slice_stop_s",
                      "slice_sides_missing"})
MARKERS = ("t_detect", "t_switch", "t_first_ok", "t_slo", "t_capacity")


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}{' ' + unit if unit else ''}"
    return f"{value}{' ' + unit if unit else ''}"


def summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The fields a listing shows."""
    fig = report.get("figures") or {}
    return {"id": report.get("id"), "scenario": report.get("scenario"), "status": report.get("status"),
            "started_at": report.get("started_at"), "finished_at": report.get("finished_at"),
            "progress": report.get("progress"), "error": report.get("error"),
            **{k: fig.get(k) for k in ("rto_service_s", "rto_slo_s", "rto_capacity_s", "requests_failed",
                                       "tokens_lost")}}


def to_markdown(report: Mapping[str, Any]) -> str:
    fig = report.get("figures") or {}
    pred = report.get("prediction") or {}
    lines = [f"# Drill {report.get('id')}: {report.get('title') or report.get('scenario')}", "",
             f"- scenario: `{report.get('scenario')}`", f"- status: **{report.get('status')}**"]
    if report.get("error"):
        lines.append(f"- error: {report['error']}")
    lines += _steady_lines(report)
    if (report.get("load") or {}).get("not_started"):
        lines.append(f"- load not started: {report['load']['not_started']}")
    if report.get("fault_targets"):
        lines.append(f"- fault targets: {', '.join(report['fault_targets'])}")
    cfg = report.get("config") or {}
    if cfg:
        lines.append(f"- load: {cfg.get('rate')} req/s for {cfg.get('duration_s')} s, t0 at "
                     f"{cfg.get('fault_at_s')} s, max_tokens {cfg.get('max_tokens')}")
    lines += ["", "## Figures (client timeline; times in seconds after t0)", "",
              "| figure | measured | predicted |", "|---|---|---|"]
    predicted = {"rto_service_s": pred.get("rto_service_s"), "rto_capacity_s": pred.get("rto_capacity_s")}
    for key, label, unit in FIGURES:
        if key in OPTIONAL and fig.get(key) is None:
            continue
        lines.append(f"| {label} | {_fmt(fig.get(key), unit)} | {_fmt(predicted.get(key), unit)} |")
    if report.get("gateway_killed"):
        lines.append(f"\n- gateway killed: {report['gateway_killed']}")
    loss = report.get("client_loss") or {}
    if loss:
        lines.append(f"- clients lost {loss.get('failed')} requests: {loss.get('failed_before_first_token')} "
                     f"before their first token (a client retry recovers them), "
                     f"{loss.get('failed_mid_stream')} mid-stream after "
                     f"{loss.get('tokens_delivered_to_failed')} tokens (a retry repeats those tokens; "
                     "a resume from them recovers the rest)")
    writes = report.get("writes") or {}
    if writes:
        lines.append(f"\n- acknowledged writes before t0: {writes.get('acknowledged')}; missing after the "
                     f"restart: {', '.join(writes.get('lost') or []) or 'none'}")
    if report.get("orphans"):
        lines.append(f"- orphaned processes: {', '.join(report['orphans'])}")
    checks = report.get("checks") or []
    if checks:
        lines += ["", "## Verdict", "", "| check | target | measured | result |", "|---|---|---|---|"]
        for c in checks:
            outcome = _outcome(c)
            measured = "not measured" if outcome == "not measured" else _fmt(c["measured"])
            lines.append(f"| {c['name']} | <= {_fmt(c['target'])} | {measured} | "
                         f"{'pass' if outcome == 'pass' else outcome.upper()} |")
    return "\n".join(lines) + "\n"


def _outcome(check: Mapping[str, Any]) -> str:
    """pass, fail or not measured (reports stored before the outcome was kept have only ``ok``)."""
    if check.get("outcome"):
        return str(check["outcome"])
    if check.get("measured") is None:
        return "not measured"
    return "pass" if check.get("ok") else "fail"


def _steady_lines(report: Mapping[str, Any]) -> list[str]:
    """How long the drill waited for its steady state, and for what."""
    steady = report.get("steady_state") or {}
    if not steady.get("waited_for"):
        return []
    reached = "reached" if steady.get("ok") else "not reached"
    return [f"- steady state {reached} after {_fmt(steady.get('waited_s'), 's')} (at most "
            f"{_fmt(steady.get('timeout_s'), 's')}); waited for: {'; '.join(steady['waited_for'])}"]


def compare(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Figures side by side: one column per drill, one row per figure (None where not measured)."""
    columns = [{"id": r.get("id"), "scenario": r.get("scenario"), "status": r.get("status"),
                "started_at": r.get("started_at")} for r in reports]
    rows = [{"figure": key, "label": label, "unit": unit,
             "values": [(r.get("figures") or {}).get(key) for r in reports]} for key, label, unit in FIGURES]
    predicted = [{"figure": f"predicted_{key}", "label": f"predicted {key}", "unit": "s",
                  "values": [(r.get("prediction") or {}).get(key) for r in reports]}
                 for key in ("rto_service_s", "rto_capacity_s")]
    return {"columns": columns, "rows": rows + predicted}


def compare_markdown(table: Mapping[str, Any]) -> str:
    head = " | ".join(f"#{c['id']} {c['scenario']} ({c['status']})" for c in table["columns"])
    lines = [f"| figure | {head} |", "|---|" + "---|" * len(table["columns"])]
    for row in table["rows"]:
        lines.append(f"| {row['label']} | " + " | ".join(_fmt(v, row["unit"]) for v in row["values"]) + " |")
    return "\n".join(lines) + "\n"


def timeline_figure(report: Mapping[str, Any]) -> dict[str, Any]:
    """A Plotly figure (as a dict) of the drill: load, errors, P99 TTFT and ready replicas against time
    after t0, with a vertical marker at t0 and at each measured t_*."""
    series = report.get("timeline") or {}
    fig = report.get("figures") or {}
    ready = series.get("ready") or []
    data: list[dict[str, Any]] = [
        {"type": "scatter", "mode": "lines", "name": "sent (req/s)", "x": series.get("t", []),
         "y": series.get("sent_rps", []), "yaxis": "y"},
        {"type": "bar", "name": "errors", "x": series.get("t", []), "y": series.get("errors", []),
         "yaxis": "y", "marker": {"color": "crimson"}},
        {"type": "scatter", "mode": "lines+markers", "name": "P99 TTFT (s)", "x": series.get("t", []),
         "y": series.get("ttft_p99_s", []), "yaxis": "y2"},
        {"type": "scatter", "mode": "lines", "name": "ready replicas", "line": {"shape": "hv"},
         "x": [p[0] for p in ready], "y": [p[1] for p in ready], "yaxis": "y3"},
    ]
    marks = {"t0": 0.0, **{m: fig.get(m) for m in MARKERS}}
    shapes, notes = [], []
    for name, x in marks.items():
        if x is None:
            continue
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
                       "line": {"dash": "solid" if name == "t0" else "dot", "width": 1}})
        notes.append({"x": x, "y": 1.02, "xref": "x", "yref": "paper", "text": name, "showarrow": False,
                      "textangle": -45, "font": {"size": 10}})
    title = f"Drill {report.get('id')}: {report.get('scenario')} ({report.get('status')})"
    layout = {"title": {"text": title},
              "xaxis": {"title": {"text": "seconds after t0"}, "domain": [0, 0.88]},
              "yaxis": {"title": {"text": "requests / errors"}},
              "yaxis2": {"title": {"text": "P99 TTFT (s)"}, "overlaying": "y", "side": "right"},
              "yaxis3": {"title": {"text": "ready"}, "overlaying": "y", "side": "right", "anchor": "free",
                         "position": 0.96, "rangemode": "tozero"},
              "shapes": shapes, "annotations": notes, "legend": {"orientation": "h", "y": -0.2}}
    return {"data": data, "layout": layout}
