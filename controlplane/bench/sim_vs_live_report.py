"""The figures of ``python -m controlplane.bench sim-vs-live`` (:mod:`controlplane.bench.sim_vs_live`): each
side's SLO attainment, P95 TTFT and TPOT, replica-seconds and scale events, the simulator's error against
the live run, the verdicts on the targets, the table and the chart of both replica timelines."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from controlplane.sim.replica import RequestOutcome
from controlplane.sim.settings import Slo
from controlplane.sim.simulator import PolicyReport, format_seconds, p95
from controlplane.views import Event
from inference.bench.report import RequestRecord

TARGETS = {"attainment_points": 5.0, "replica_seconds": 0.15, "ttft_p95": 0.25}


@dataclass(slots=True)
class Side:
    """One side's figures over the compared span."""

    num_requests: int
    slo_attainment: float
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    replica_seconds: float
    scale_events: int
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the load's start, paid)
    failed: int = 0


def outcome(record: RequestRecord) -> RequestOutcome:
    """What the client saw, in the simulator's terms (a failed request has no first token: a miss)."""
    ok = record.is_success
    return RequestOutcome(arrival=record.send_time, prompt_len=record.prompt_len,
                          output_len=record.num_output_tokens if ok else record.output_len,
                          first_token=record.first_token_time if ok else None,
                          finish=record.end_time if ok else None)


def integrate(timeline: Sequence[tuple[float, int]], end: float) -> float:
    """Replica-seconds of a step function sampled at ``(t, count)`` (t from 0) over ``[0, end]``."""
    total = 0.0
    for (t, count), nxt in zip(timeline, [*timeline[1:], (end, 0)], strict=True):
        lo, hi = max(t, 0.0), min(nxt[0], end)
        if hi > lo:
            total += count * (hi - lo)
    return total


def load_start(records: Sequence[RequestRecord]) -> float:
    """The load client's time zero, in POSIX seconds."""
    return statistics.median(r.send_wall - r.send_time for r in records)


def replica_starts(events: Sequence[Event], since: float) -> list[float]:
    """Seconds from each scale-up the live fleet recorded after ``since`` (POSIX seconds) to each replica it
    added being ready, in order: a replica's start on the live host, the control plane's spawn and its
    readiness check included, against which the simulator waits the profile's ``start_s`` (measured by
    ``controlplane calibrate``, one replica alone). A replica not ready before the events end is left
    out."""
    ordered = sorted(events, key=lambda e: e.id)
    starts: list[float] = []
    for i, event in enumerate(ordered):
        if event.kind != "fleet.scaled" or event.ts < since:
            continue
        added = int(event.detail.get("to", 0)) - int(event.detail.get("from", 0))
        after = ordered[i + 1:]
        spawned = [e.subject for e in after if e.kind == "replica.spawned"][:max(added, 0)]
        for subject in spawned:
            ready = next((e for e in after if e.kind == "replica.ready" and e.subject == subject), None)
            if ready is not None:
                starts.append(ready.ts - event.ts)
    return starts


def live_side(records: Sequence[RequestRecord], fleet: Sequence[tuple[float, int]],
              decisions: Sequence[tuple[float, bool, str]], span_s: float, slo: Slo) -> Side:
    """The live figures: ``fleet`` as (POSIX seconds, replicas paid for), ``decisions`` as (POSIX seconds,
    applied, outcome); times are counted from the load client's start."""
    t0 = load_start(records)
    outcomes = [outcome(r) for r in records]
    timeline = [(round(at - t0, 2), n) for at, n in fleet]
    if timeline and timeline[0][0] > 0:
        timeline.insert(0, (0.0, timeline[0][1]))
    return Side(
        num_requests=len(outcomes),
        slo_attainment=sum(slo.is_met(o) for o in outcomes) / max(len(outcomes), 1),
        ttft_p95_s=p95([o.ttft if o.ttft is not None else math.inf for o in outcomes]),
        tpot_p95_s=p95([o.tpot for o in outcomes if o.tpot is not None]),
        replica_seconds=round(integrate(timeline, span_s), 1),
        scale_events=sum(applied and 0 <= at - t0 <= span_s for at, applied, _ in decisions),
        timeline=timeline,
        failed=sum(not r.is_success for r in records),
    )


def sim_side(report: PolicyReport) -> Side:
    t = report.timeline
    return Side(report.num_requests, report.slo_attainment, report.ttft_p95_s, report.tpot_p95_s,
                report.replica_seconds, report.scale_events, list(zip(t.at, t.replicas, strict=True)))


def relative(sim: float | None, live: float | None) -> float | None:
    """The simulator's error relative to the live figure."""
    if sim is None or live is None or live == 0:
        return None
    return (sim - live) / live


def verdicts(live: Side, sim: Side) -> dict[str, tuple[bool, str]]:
    points = (sim.slo_attainment - live.slo_attainment) * 100
    rs, ttft = relative(sim.replica_seconds, live.replica_seconds), relative(sim.ttft_p95_s, live.ttft_p95_s)
    return {
        "attainment": (abs(points) <= TARGETS["attainment_points"],
                       f"{points:+.1f} points (target within {TARGETS['attainment_points']:g})"),
        "replica_seconds": (rs is not None and abs(rs) <= TARGETS["replica_seconds"],
                            f"{_pct(rs)} (target within {TARGETS['replica_seconds']:.0%})"),
        "ttft_p95": (ttft is not None and abs(ttft) <= TARGETS["ttft_p95"],
                     f"{_pct(ttft)} (target within {TARGETS['ttft_p95']:.0%})"),
        # a slice one replica serves whole checks no autoscaling: the comparison is then of a static fleet
        "scaled": (live.scale_events >= 1 and sim.scale_events >= 1,
                   f"live {live.scale_events}, simulated {sim.scale_events} scale events (target: both "
                   "scale; raise --compress where one replica serves the slice)"),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def format_report(live: Side, sim: Side, judged: dict[str, tuple[bool, str]]) -> str:
    rows = [("requests", str(live.num_requests), str(sim.num_requests), ""),
            ("SLO attainment", f"{live.slo_attainment:.1%}", f"{sim.slo_attainment:.1%}",
             f"{(sim.slo_attainment - live.slo_attainment) * 100:+.1f} pts"),
            ("P95 TTFT", format_seconds(live.ttft_p95_s), format_seconds(sim.ttft_p95_s),
             _pct(relative(sim.ttft_p95_s, live.ttft_p95_s))),
            ("P95 TPOT", format_seconds(live.tpot_p95_s), format_seconds(sim.tpot_p95_s),
             _pct(relative(sim.tpot_p95_s, live.tpot_p95_s))),
            ("replica-seconds", f"{live.replica_seconds:.0f}", f"{sim.replica_seconds:.0f}",
             _pct(relative(sim.replica_seconds, live.replica_seconds))),
            ("scale events", str(live.scale_events), str(sim.scale_events),
             _pct(relative(sim.scale_events, live.scale_events))),
            ("peak replicas", str(max((n for _, n in live.timeline), default=0)),
             str(max((n for _, n in sim.timeline), default=0)), "")]
    lines = [f"{'':<16} {'LIVE':>10} {'SIM':>10} {'SIM vs LIVE':>12}"]
    lines += [f"{name:<16} {a:>10} {b:>10} {c:>12}" for name, a, b, c in rows]
    lines.append(f"live failed requests: {live.failed}")
    lines += [f"{name}: {'MET' if ok else 'NOT MET'} ({why})" for name, (ok, why) in judged.items()]
    return "\n".join(lines)


def write_html(path: Path, live: Side, sim: Side, title: str) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, side in (("live", live), ("simulated", sim)):
        fig.add_trace(go.Scatter(x=[t for t, _ in side.timeline], y=[n for _, n in side.timeline], name=name,
                                 line={"shape": "hv"}))
    fig.update_layout(title=title, xaxis_title="seconds since the load's start",
                      yaxis_title="replicas paid for (starting + ready + draining)")
    fig.write_html(str(path), include_plotlyjs="inline")


OVERLOAD_TARGET = 0.8  # of the fleet's capacity, the load a suggested --compress aims at


@dataclass(slots=True, frozen=True)
class Capacity:
    """What the fleet at its bound can give the slice's engine work over the compared span, in core-seconds:
    ``max_replicas`` replicas of ``cpu_limit`` cores each (a whole core without a limit), within the host's
    cores less what runs beside the replicas (the probe's CPU per request times the requests)."""

    engine_s: float  # the slice's engine-seconds by the profile
    core_s: float
    compress: float

    @property
    def load(self) -> float:
        return self.engine_s / self.core_s if self.core_s > 0 else math.inf

    def warning(self) -> str | None:
        """A line where the slice asks more than the fleet can give: both queues then grow without bound
        and their latencies diverge however good the simulator is; None where it fits."""
        if self.load <= 1.0:
            return None
        suggested = self.compress * OVERLOAD_TARGET / self.load
        return (f"warning: the slice asks {self.engine_s:.0f} engine-seconds of the profile where the fleet "
                f"at its bound has {self.core_s:.0f} core-seconds ({self.load:.0%}): both sides overload, "
                f"so their latencies say little of the simulator; about --compress {suggested:.1f} loads "
                f"it {OVERLOAD_TARGET:.0%}")


def fleet_capacity(engine_s: float, *, span_s: float, compress: float, max_replicas: int,
                   cpu_limit: float | None, host_cores: int, beside_core_s: float) -> Capacity:
    replicas = max_replicas * (cpu_limit or 1.0)
    cores = min(replicas, host_cores - beside_core_s / span_s if span_s > 0 else 0.0)
    return Capacity(engine_s, max(cores, 0.0) * span_s, compress)
