"""What-if runs of autoscaling policies on request traces, in a calibrated fleet simulation.

Where it sits: beside the live autoscaler. Both call the same pure decision
(``controlplane.autoscale.policies``); the live loop observes telemetry and scales real replicas, this module
observes a discrete-event fleet (``controlplane.sim.fleet``) whose replicas step as fast as a measured profile
says (``controlplane.autoscale.profile``). Traces come from ``controlplane.sim.trace``.

Policies: ``hpa`` (the Kubernetes HPA baseline on the live loop's metric targets: waiting requests, KV-cache
usage, P95 TTFT and generated tokens/s per replica, all sizing; 15 s sync, 300 s scale-down window with the
highest recommendation, tolerance 0.1, HPA's default rate policies, no panic), ``static:N``, and ``ours``:
what the live loop runs, its own :func:`controlplane.autoscale.decide.decide` (less the anomaly source and
schedule windows) on its own policy (:func:`controlplane.autoscale.decide.ours_policy`) and configuration
defaults, every 5 s. It is LLM-aware in three ways, each a rule in ``controlplane.autoscale.policies``:

- the fleet is sized by the *offered engine load*: request rate x mean prompt and output tokens per request,
  converted to engine seconds with the replica profile (target 0.7 per replica). It is linear in the load,
  as HPA's formula assumes, and keeps growing past saturation, where served token rates flatten;
- P95 TTFT and the waiting queue are guards (``MetricTarget.guard``): they forbid scaling down but do not
  size the fleet, because TTFT has a floor and lags, and a queue is a backlog to drain, not a rate to
  serve: ``ceil(current * metric / target)`` on them overshoots and the window then holds the overshoot;
- panic mode compares the offered load over the 6 s panic window with twice the ready capacity (real
  overload, not a momentary queue) and then goes straight to what that load needs, without the scale-up
  rate limit, as Knative's KPA does (``PolicyConfig.panic_skips_rate_limit``); scale-down is gradual, one
  replica per 60 s (``PolicyConfig.scale_down_period_s``), so a burst that comes back finds capacity there.

The policies' adapters to the simulated fleet are in ``controlplane.sim.policies``, the SLO, policy spec
and fleet settings in ``controlplane.sim.settings``; this module runs them and reports. A report per
policy: SLO attainment
(share of requests with TTFT and TPOT within the SLO), replica-seconds, scale events, direction reversals
within the stabilization window, and a timeline (load, replicas, P95 TTFT) that :func:`figure` draws.

``python -m controlplane.sim profile|bench`` measures a replica profile or runs the policy benchmark.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from controlplane.autoscale.decide import LoopState
from controlplane.autoscale.profile import ReplicaProfile, load_profile
from controlplane.sim.fleet import FleetSim, ScaleEvent
from controlplane.sim.policies import make_policy
from controlplane.sim.settings import PolicySpec, SimSettings, Slo
from controlplane.sim.trace import SimRequest

# The window a report's worst attainment is taken over: the short window of a multiwindow burn-rate SLO
# alert (5 minutes), where an hour's attainment can hide a peak that ran under the SLO.
SLO_WINDOW_S = 300.0

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from controlplane.sim.replica import RequestOutcome

Progress = Callable[[float], None]  # fraction of simulated time done, 0..1


# ---- reports ---------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Timeline:
    at: list[float]
    load_rps: list[float]  # arrivals per second in the bucket
    replicas: list[int]  # paid for: starting + ready + draining
    ready: list[int]
    ttft_p95_s: list[float | None]  # of the requests that arrived in the bucket


@dataclass(slots=True, frozen=True)
class PolicyReport:
    policy: str
    num_requests: int
    slo_attainment: float  # 0..1
    replica_seconds: float
    scale_events: int
    reversals: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    unfinished: int
    missed_ttft: int  # requests past the TTFT SLO, or with no first token
    missed_tpot: int  # requests past the TPOT SLO (either or both: slo_attainment counts the rest)
    duration_s: float
    wall_s: float
    timeline: Timeline
    # the lowest attainment over SLO_WINDOW_S windows of arrivals (None: no request)
    worst_window_attainment: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def simulate(
    requests: Sequence[SimRequest],
    spec: PolicySpec,
    *,
    profile: ReplicaProfile | None = None,
    settings: SimSettings = SimSettings(),
    progress: Progress | None = None,
    speed: Callable[[float], float] | None = None,
    prior: LoopState | None = None,
    first_tick_s: float | None = None,
    panic_counted_s: float | None = None,
) -> PolicyReport:
    """One policy on the trace. ``speed(t)`` multiplies the replicas' step times at simulated time ``t``
    while the policy prices the work with the profile as given: a fleet whose replicas run off the profile
    it is sized by (``python -m controlplane.bench sim-vs-live``'s diagnostic); None: at the profile.
    ``prior``, ``first_tick_s`` and ``panic_counted_s``: the loop's memory from before the trace, its first
    tick and the seconds its panic window's rate counts (None: a loop that starts with the trace, first
    ticking a tick in, counting the whole window), to replay a live loop's run."""
    profile = profile or load_profile()
    policy, tick, initial = make_policy(spec, profile, settings, prior=prior)
    started = time.perf_counter()
    hook = None if progress is None else (lambda now, end: progress(min(now / end, 1.0) if end else 1.0))
    sim = FleetSim(
        profile,
        requests,
        initial_replicas=initial,
        policy=policy,
        tick_s=tick,
        crashes=settings.crashes,
        sample_s=settings.sample_s,
        progress=hook,
        host_cores=settings.host_cores,
        speed=speed,
        host_cpu_per_request_s=settings.host_cpu_per_request_s,
        first_tick_s=first_tick_s,
        panic_counted_s=panic_counted_s,
    ).run()
    return _report(spec.label, sim, settings, time.perf_counter() - started)


def compare(
    requests: Sequence[SimRequest],
    specs: Sequence[PolicySpec],
    *,
    profile: ReplicaProfile | None = None,
    settings: SimSettings = SimSettings(),
    progress: Progress | None = None,
) -> list[PolicyReport]:
    """Each policy on the same trace; ``progress`` sees the fraction of all runs done."""
    profile = profile or load_profile()
    reports = []
    for i, spec in enumerate(specs):
        part = None if progress is None else (lambda f, i=i: progress((i + f) / len(specs)))
        reports.append(simulate(requests, spec, profile=profile, settings=settings, progress=part))
    return reports


def count_reversals(events: Sequence[ScaleEvent], window_s: float) -> int:
    """Scale events in the opposite direction of the previous one, less than ``window_s`` after it."""
    reversals, previous = 0, None
    for event in events:
        if event.after == event.before:
            continue
        if (
            previous is not None
            and (event.after > event.before) != (previous.after > previous.before)
            and event.at - previous.at < window_s
        ):
            reversals += 1
        previous = event
    return reversals


def _report(label: str, sim: FleetSim, settings: SimSettings, wall_s: float) -> PolicyReport:
    outcomes = sim.outcomes
    met = sum(settings.slo.is_met(o) for o in outcomes)
    ttfts = [o.ttft if o.ttft is not None else math.inf for o in outcomes]
    tpots = [o.tpot for o in outcomes if o.tpot is not None]
    return PolicyReport(
        policy=label,
        num_requests=len(outcomes),
        slo_attainment=met / len(outcomes) if outcomes else 1.0,
        replica_seconds=round(sim.replica_seconds(), 1),
        scale_events=sum(e.after != e.before for e in sim.events),
        reversals=count_reversals(sim.events, settings.stabilization_s),
        ttft_p95_s=p95(ttfts),
        tpot_p95_s=p95(tpots),
        unfinished=sum(o.finish is None for o in outcomes),
        missed_ttft=sum(o.ttft is None or o.ttft > settings.slo.ttft_s for o in outcomes),
        missed_tpot=sum(o.tpot is not None and o.tpot > settings.slo.tpot_s for o in outcomes),
        duration_s=round(sim.duration, 1),
        wall_s=round(wall_s, 2),
        timeline=_timeline(sim),
        worst_window_attainment=worst_window(outcomes, settings.slo),
    )


def worst_window(outcomes: Sequence[RequestOutcome], slo: Slo, window_s: float = SLO_WINDOW_S
                 ) -> float | None:
    """The lowest SLO attainment of the requests arriving in any ``window_s`` window (aligned to the
    run's start); None when there is no request."""
    windows: dict[int, list[int]] = {}
    for o in outcomes:
        counts = windows.setdefault(int(o.arrival // window_s), [0, 0])
        counts[0] += 1
        counts[1] += slo.is_met(o)
    return min((met / n for n, met in windows.values()), default=None)


def p95(values: Sequence[float]) -> float | None:
    """Nearest-rank P95; None when empty or when it is infinite (a request with no first token)."""
    if not values:
        return None
    ordered = sorted(values)
    value = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return None if math.isinf(value) else round(value, 4)


def _timeline(sim: FleetSim) -> Timeline:
    step = sim.sample_s
    buckets: list[list[float]] = [[] for _ in sim.samples]
    for o in sim.outcomes:
        i = min(int(o.arrival // step), len(buckets) - 1)
        if i >= 0:
            buckets[i].append(o.ttft if o.ttft is not None else math.inf)
    return Timeline(
        at=[s.at for s in sim.samples],
        load_rps=[round(len(b) / step, 3) for b in buckets],
        replicas=[s.alive for s in sim.samples],
        ready=[s.ready for s in sim.samples],
        ttft_p95_s=[p95(b) for b in buckets],
    )


def format_table(reports: Sequence[PolicyReport], slo: Slo = Slo()) -> str:
    head = (
        f"{'POLICY':<10} {'REQUESTS':>8} {'SLO MET':>8} {'WORST 5M':>8} {'MISSED TTFT':>11} "
        f"{'MISSED TPOT':>11} {'REPLICA-S':>10} {'SCALE EV':>8} {'REVERSALS':>9} {'P95 TTFT':>9} "
        f"{'P95 TPOT':>9} {'SIM WALL':>8}"
    )
    lines = [f"SLO: TTFT <= {slo.ttft_s:g}s and TPOT <= {slo.tpot_s:g}s (WORST 5M: the lowest attainment "
             f"over {SLO_WINDOW_S / 60:g}-minute windows; a request may miss both)", head]
    for r in reports:
        lines.append(
            f"{r.policy:<10} {r.num_requests:>8} {r.slo_attainment * 100:>7.1f}% "
            f"{format_share(r.worst_window_attainment):>8} "
            f"{r.missed_ttft:>11} {r.missed_tpot:>11} {r.replica_seconds:>10.0f} {r.scale_events:>8} "
            f"{r.reversals:>9} {format_seconds(r.ttft_p95_s):>9} {format_seconds(r.tpot_p95_s):>9} "
            f"{r.wall_s:>7.2f}s"
        )
    return "\n".join(lines)


def format_seconds(value: float | None) -> str:
    """Seconds to the millisecond, or "-" when unknown: the tables' P95 columns."""
    return "-" if value is None else f"{value:.3f}s"


def format_share(value: float | None) -> str:
    """A share (0..1) as a percentage to a tenth, or "-" when unknown: the tables' attainment columns."""
    return "-" if value is None else f"{value:.1%}"


def figure(reports: Sequence[PolicyReport], title: str = "What-if: load, replicas, P95 TTFT") -> go.Figure:
    """A plotly timeline per policy: load (req/s), replicas paid for, P95 TTFT of arrivals."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.05,
        subplot_titles=("load (requests/s)", "replicas", "P95 TTFT (s)"),
    )
    if reports:
        t = reports[0].timeline
        fig.add_trace(go.Scatter(x=t.at, y=t.load_rps, name="load", line={"color": "grey"}), row=1, col=1)
    for r in reports:
        fig.add_trace(
            go.Scatter(
                x=r.timeline.at, y=r.timeline.replicas, name=f"{r.policy} replicas", line={"shape": "hv"}
            ),
            row=2,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=r.timeline.at, y=r.timeline.ttft_p95_s, name=f"{r.policy} P95 TTFT", connectgaps=False
            ),
            row=3,
            col=1,
        )
    fig.update_xaxes(title_text="simulated seconds", row=3, col=1)
    fig.update_layout(title=title, height=800)
    return fig
