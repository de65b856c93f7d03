"""The soak benchmark's samples, its targets and its report (text, JSON and a plotly HTML page). Pure: no
processes, no network; :mod:`controlplane.bench.soak` runs the soak and hands its samples here.

Targets (each a :class:`Verdict`: pass, fail, or not judged with the reason):

- ``kv_blocks_after_drain``: once the load has stopped and every replica has drained, every replica's
  ``llmsre_kv_cache_blocks_in_use`` is 0 (a block still referenced then has leaked).
- ``rss_growth``: per process, the resident set grows by less than :data:`MAX_RSS_GROWTH` over the last
  two thirds of its life in the run (the first third is warm-up: caches, the KV pool, the allocator's
  arenas), and after a warm-up of its own where the process has one (``ProcessSample.warm_from``:
  Prometheus, whose head keeps each series' samples in memory until its chunks are cut). Growth compares
  the median of the first and of the last :data:`EDGE_SAMPLES` samples of that span. A process judged over
  less than ``min_span_s`` (one restarted by a fault near the end) is not judged, and says so.
- ``fd_growth`` and ``task_growth``: open file descriptors and asyncio tasks do not grow monotonically over
  the same span. The span is cut into :data:`QUARTERS` parts and each part's floor (its minimum) taken:
  load makes a count go up and down, a leak lifts the floor. Floors that rise from each part to the next
  are a monotonic growth. The descriptors judged are those the process holds for itself: its open
  descriptors less its established TCP connections (``ProcessSample.connections``). How many connections
  a peer keeps open is the peer's pool: a replica that takes over a killed one's traffic keeps more of the
  gateway's connections for the rest of the run (floors 19, 20, 21, 22 in a CI run, all of it connections).
  A leaked socket still counts: once its peer closes it, it waits in CLOSE_WAIT, not established.
- ``failed_outside_faults``: no request failed outside the fault windows (a window runs from a fault's
  injection until it was reverted, the fleet was whole again and ``recovery_s`` more had passed). A request
  counts as inside when any part of it (send to end) overlaps a window.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from chaos.drill_figures import percentile
from inference.bench.report import BAD, CANCEL, PLAIN, STREAM, RequestRecord

MAX_RSS_GROWTH = 0.10
EDGE_SAMPLES = 3
QUARTERS = 4
Outcome = Literal["pass", "fail", "not judged"]


@dataclass(slots=True, frozen=True)
class ProcessSample:
    role: str  # "control-plane", "gateway gw-0", "replica az-a-1", "prometheus"
    pid: int
    rss_bytes: int
    num_fds: int
    tasks: int | None = None  # asyncio tasks from its /metrics (None: it has none, or did not answer)
    warm_from: float | None = None  # seconds since the load started when its own warm-up is over, if any
    connections: int | None = None  # established TCP connections among num_fds (None: not read)

    @property
    def own_fds(self) -> int:
        """Open descriptors less established TCP connections: what ``fd_growth`` judges."""
        return self.num_fds - (self.connections or 0)


@dataclass(slots=True, frozen=True)
class Sample:
    t: float  # seconds since the load started
    wall: float
    processes: tuple[ProcessSample, ...]
    kv_blocks_in_use: Mapping[str, int]  # replica id -> blocks referenced by sequences
    requests_running: Mapping[str, int]
    store_bytes: int  # the SQLite file with its WAL
    store_rows: Mapping[str, int]  # table -> rows
    prometheus_series: int | None  # head series of the Prometheus the control plane runs
    ready: int
    desired: int


@dataclass(slots=True, frozen=True)
class FaultWindow:
    kind: str
    target: str
    start_wall: float
    end_wall: float  # reverted, fleet whole again, plus the recovery margin
    error: str | None = None  # the injection failed: nothing happened (the window still excuses nothing)


@dataclass(slots=True, frozen=True)
class Verdict:
    name: str
    outcome: Outcome
    detail: str


@dataclass(slots=True)
class SoakResult:
    config: Mapping[str, Any]
    capacity_rps: float
    rate_rps: float
    load_start_wall: float
    samples: list[Sample]
    windows: list[FaultWindow]
    records: list[RequestRecord]
    kv_after_drain: Mapping[str, int | None]  # replica id -> blocks in use after the drain (None: no answer)
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def outcome(self) -> Outcome:
        if any(v.outcome == "fail" for v in self.verdicts):
            return "fail"
        return "pass"

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body["records"] = [r.to_json() for r in self.records]
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SoakResult:
        """A result written by :meth:`to_json` (to draw its report again)."""
        samples = [Sample(**{**s, "processes": tuple(ProcessSample(**p) for p in s["processes"])})
                   for s in body["samples"]]
        return cls(body["config"], body["capacity_rps"], body["rate_rps"], body["load_start_wall"], samples,
                   [FaultWindow(**w) for w in body["windows"]],
                   [RequestRecord.from_json(r) for r in body["records"]], body["kv_after_drain"],
                   [Verdict(**v) for v in body["verdicts"]])


# ---- series -------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Series:
    """One process's values of one quantity over the run: (t, value) in time order."""

    role: str
    pid: int
    points: tuple[tuple[float, float], ...]
    warm_from: float | None = None  # its own warm-up ends here (t), beyond the first third of its life


def process_series(samples: Sequence[Sample], value: Callable[[ProcessSample], float | None]) -> list[Series]:
    """One series per (role, pid): a replica restarted by a fault is a new process with a new series."""
    by_key: dict[tuple[str, int], list[tuple[float, float]]] = {}
    warm: dict[tuple[str, int], float] = {}
    for s in samples:
        for p in s.processes:
            v = value(p)
            if v is not None:
                by_key.setdefault((p.role, p.pid), []).append((s.t, float(v)))
            if p.warm_from is not None:
                warm[p.role, p.pid] = p.warm_from
    return [Series(role, pid, tuple(points), warm.get((role, pid)))
            for (role, pid), points in sorted(by_key.items())]


def judged_span(series: Series) -> tuple[tuple[float, float], ...]:
    """The last two thirds of the process's life in the run, and past its own warm-up if it has one."""
    if not series.points:
        return ()
    first, last = series.points[0][0], series.points[-1][0]
    start = max(first + (last - first) / 3, series.warm_from if series.warm_from is not None else -math.inf)
    return tuple(p for p in series.points if p[0] >= start)


def rss_growth(points: Sequence[tuple[float, float]]) -> float:
    """Relative growth between the medians of the first and the last EDGE_SAMPLES points."""
    head = statistics.median(v for _, v in points[:EDGE_SAMPLES])
    tail = statistics.median(v for _, v in points[-EDGE_SAMPLES:])
    return (tail - head) / head if head > 0 else math.inf


def floors(points: Sequence[tuple[float, float]], parts: int = QUARTERS) -> list[float]:
    """The minimum of each of ``parts`` consecutive parts of the points (equal counts; the last one takes
    the remainder)."""
    size = len(points) // parts
    return [min(v for _, v in points[i * size:(i + 1) * size if i < parts - 1 else len(points)])
            for i in range(parts)]


def grows_monotonically(points: Sequence[tuple[float, float]]) -> bool:
    lows = floors(points)
    return all(b > a for a, b in itertools.pairwise(lows))


# ---- targets ------------------------------------------------------------------------------------
def judge(result: SoakResult, *, min_span_s: float) -> list[Verdict]:
    """Every target of the module docstring, against the run's samples, windows and records."""
    return [_kv_after_drain(result.kv_after_drain), *_growth_verdicts(result.samples, min_span_s),
            _failed_outside(result.records, result.windows)]


def _kv_after_drain(kv: Mapping[str, int | None]) -> Verdict:
    if not kv:
        return Verdict("kv_blocks_after_drain", "fail", "no replica answered after the drain")
    missing = sorted(r for r, v in kv.items() if v is None)
    held = {r: v for r, v in kv.items() if v}
    detail = ", ".join(f"{r} {'no answer' if v is None else v}" for r, v in sorted(kv.items()))
    ok = not missing and not held
    return Verdict("kv_blocks_after_drain", "pass" if ok else "fail", f"blocks in use: {detail}")


def _growth_verdicts(samples: Sequence[Sample], min_span_s: float) -> list[Verdict]:
    out = []
    checks: tuple[tuple[str, Callable[[ProcessSample], float | None]], ...] = (
        ("rss_growth", lambda p: p.rss_bytes), ("fd_growth", lambda p: p.own_fds),
        ("task_growth", lambda p: p.tasks))
    for name, value in checks:
        for series in process_series(samples, value):
            out.append(_growth(name, series, min_span_s))
    return out


def _growth(name: str, series: Series, min_span_s: float) -> Verdict:
    who = f"{name} {series.role} (pid {series.pid})"
    span = judged_span(series)
    covered = span[-1][0] - span[0][0] if span else 0.0
    if covered < min_span_s or len(span) < max(2 * EDGE_SAMPLES, 2 * QUARTERS):
        warm = "" if series.warm_from is None else f" (its warm-up ran to t={series.warm_from:.0f} s)"
        return Verdict(who, "not judged", f"lived {covered:.0f} s in its judged span{warm}, {len(span)} "
                                          f"samples (needs {min_span_s:.0f} s and {2 * QUARTERS})")
    if name == "rss_growth":
        growth = rss_growth(span)
        head, tail = (statistics.median(v for _, v in part) / 2**20
                      for part in (span[:EDGE_SAMPLES], span[-EDGE_SAMPLES:]))
        return Verdict(who, "pass" if growth < MAX_RSS_GROWTH else "fail",
                       f"{growth:+.1%} over {covered:.0f} s ({head:.0f} -> {tail:.0f} MiB; "
                       f"target < {MAX_RSS_GROWTH:.0%})")
    lows = floors(span)
    grows = grows_monotonically(span)
    what = " of descriptors less established connections" if name == "fd_growth" else ""
    return Verdict(who, "fail" if grows else "pass",
                   f"floors per quarter{what} {', '.join(f'{v:g}' for v in lows)}"
                   + (" rise every quarter" if grows else ""))


def inside(record: RequestRecord, windows: Iterable[FaultWindow]) -> bool:
    """Whether any part of the request (send to end) overlaps a fault window."""
    send = record.send_wall
    end = send + max((record.end_time or record.send_time) - record.send_time, 0.0)
    return any(send <= w.end_wall and end >= w.start_wall for w in windows)


def _failed_outside(records: Sequence[RequestRecord], windows: Sequence[FaultWindow]) -> Verdict:
    if not records:
        return Verdict("failed_outside_faults", "fail", "the load client recorded no request")
    failed = [r for r in records if not r.is_success]
    outside = [r for r in failed if not inside(r, windows)]
    kinds = {k: sum(1 for r in outside if r.kind == k) for k in (STREAM, PLAIN, CANCEL, BAD)}
    errors = sorted({r.error_kind or "?" for r in outside})
    detail = (f"{len(outside)} failed outside the {len(windows)} fault windows ({len(failed)} failed in all, "
              f"{len(records)} sent)")
    if outside:
        detail += f"; kinds {kinds}; errors {', '.join(errors)}; first {outside[0].request_id}"
    return Verdict("failed_outside_faults", "fail" if outside else "pass", detail)


# ---- latency per interval -----------------------------------------------------------------------
def latency_bins(records: Sequence[RequestRecord], *, start_wall: float,
                 bin_s: float) -> dict[str, list[Any]]:
    """Per ``bin_s`` of the run (by send time): TTFT and E2E p50/p99 of successful streams and plain
    requests, and how many requests of each outcome were sent."""
    bins: dict[int, list[RequestRecord]] = {}
    for r in records:
        bins.setdefault(int((r.send_wall - start_wall) // bin_s), []).append(r)
    out: dict[str, list[Any]] = {k: [] for k in ("t", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "ok",
                                                  "failed")}
    for i in sorted(bins):
        group = bins[i]
        ttft = [r.ttft for r in group if r.is_success and r.kind == STREAM and r.ttft is not None]
        e2e = [r.e2el for r in group if r.is_success and r.kind in (STREAM, PLAIN) and r.e2el is not None]
        out["t"].append(i * bin_s)
        out["ttft_p50"].append(percentile(ttft, 50))
        out["ttft_p99"].append(percentile(ttft, 99))
        out["e2e_p50"].append(percentile(e2e, 50))
        out["e2e_p99"].append(percentile(e2e, 99))
        out["ok"].append(sum(1 for r in group if r.is_success))
        out["failed"].append(sum(1 for r in group if not r.is_success))
    return out



# ---- reports ------------------------------------------------------------------------------------
def format_report(result: SoakResult) -> str:
    cfg = result.config
    ok = sum(1 for r in result.records if r.is_success)
    lines = [f"soak: {cfg.get('minutes')} min, {cfg.get('replicas')} replicas; load {result.rate_rps:.2f} "
             f"req/s ({cfg.get('load_fraction'):.0%} of the measured capacity {result.capacity_rps:.2f} "
             f"req/s), mix {cfg.get('mix')}; a fault every {cfg.get('fault_every_s'):g} s; sampled every "
             f"{cfg.get('sample_s'):g} s",
             f"requests: {len(result.records)} sent, {ok} as intended; faults: "
             + (", ".join(f"{w.kind}@{w.start_wall - result.load_start_wall:.0f}s->{w.target}"
                          + (f" (not injected: {w.error})" if w.error else "") for w in result.windows)
                or "none"), ""]
    width = max((len(v.name) for v in result.verdicts), default=10)
    lines += [f"{v.name:<{width}}  {v.outcome.upper():<10}  {v.detail}" for v in result.verdicts]
    lines.append(f"overall: {result.outcome.upper()}")
    return "\n".join(lines)


def write_html(result: SoakResult, path: Path, *, bin_s: float, plotlyjs: str = "inline") -> None:
    """The samples as a plotly page: one panel per quantity, fault windows shaded on each. ``plotlyjs``
    "inline" makes the page self-contained (about 4.6 MB; it opens on a machine with no network), "cdn"
    loads plotly.js from the network (a small file)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = ("RSS (MiB)", "file descriptors (less established connections)", "asyncio tasks",
              "KV blocks in use", "store: SQLite file with WAL (MiB)", "store rows", "Prometheus head series",
              "latency of successful requests (s)", "requests per interval")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, subplot_titles=panels,
                        vertical_spacing=0.025)
    values: tuple[Callable[[ProcessSample], float | None], ...] = (
        lambda p: p.rss_bytes / 2**20, lambda p: p.own_fds, lambda p: p.tasks)
    for row, value in enumerate(values, start=1):
        for s in process_series(result.samples, value):
            fig.add_trace(go.Scatter(x=[t / 60 for t, _ in s.points], y=[v for _, v in s.points],
                                     mode="lines", name=f"{s.role} ({s.pid})", legendgroup=s.role,
                                     showlegend=row == 1), row=row, col=1)
    minutes = [s.t / 60 for s in result.samples]
    for replica in sorted({r for s in result.samples for r in s.kv_blocks_in_use}):
        fig.add_trace(go.Scatter(x=minutes, y=[s.kv_blocks_in_use.get(replica) for s in result.samples],
                                 mode="lines", name=f"KV {replica}"), row=4, col=1)
    fig.add_trace(go.Scatter(x=minutes, y=[s.store_bytes / 2**20 for s in result.samples], mode="lines",
                             name="store MiB"), row=5, col=1)
    for table in sorted({t for s in result.samples for t in s.store_rows}):
        fig.add_trace(go.Scatter(x=minutes, y=[s.store_rows.get(table) for s in result.samples], mode="lines",
                                 name=f"rows {table}"), row=6, col=1)
    fig.add_trace(go.Scatter(x=minutes, y=[s.prometheus_series for s in result.samples], mode="lines",
                             name="series"), row=7, col=1)
    bins = latency_bins(result.records, start_wall=result.load_start_wall, bin_s=bin_s)
    at = [t / 60 for t in bins["t"]]
    for key in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"):
        fig.add_trace(go.Scatter(x=at, y=bins[key], mode="lines+markers", name=key.replace("_", " ")), row=8,
                      col=1)
    fig.add_trace(go.Bar(x=at, y=bins["ok"], name="as intended"), row=9, col=1)
    fig.add_trace(go.Bar(x=at, y=bins["failed"], name="failed", marker={"color": "crimson"}), row=9, col=1)
    for w in result.windows:
        x0, x1 = [(v - result.load_start_wall) / 60 for v in (w.start_wall, w.end_wall)]
        fig.add_vrect(x0=x0, x1=x1, fillcolor="orange", opacity=0.15, line_width=0, row="all", col=1)
        fig.add_annotation(x=x0, y=1.0, yref="paper", text=w.kind, showarrow=False, textangle=-60,
                           font={"size": 9}, xanchor="left")
    missed = [v.name for v in result.verdicts if v.outcome == "fail"]
    unjudged = sum(1 for v in result.verdicts if v.outcome == "not judged")
    verdict = (f"missed: {', '.join(missed)}" if missed else "every target met") + \
        (f"; {unjudged} series too short to judge (restarted processes)" if unjudged else "")
    fig.update_layout(title={"text": f"Soak: {result.outcome.upper()} ({verdict})", "font": {"size": 14}},
                      height=260 * len(panels), barmode="stack", legend={"font": {"size": 9}})
    fig.update_xaxes(title_text="minutes since the load started", row=len(panels), col=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs="cdn" if plotlyjs == "cdn" else True, full_html=True)
