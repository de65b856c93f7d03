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

A report per policy: SLO attainment
(share of requests with TTFT and TPOT within the SLO), replica-seconds, scale events, direction reversals
within the stabilization window, and a timeline (load, replicas, P95 TTFT) that :func:`figure` draws.

``python -m controlplane.sim profile|bench`` measures a replica profile or runs the policy benchmark.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from controlplane.autoscale.config import AutoscalerConfig
from controlplane.autoscale.decide import (
    LoopState,
    applied,
    offered_engine_load,
    ours_policy,
    per_replica,
    with_work,
)
from controlplane.autoscale.decide import Observation as LiveObservation
from controlplane.autoscale.decide import decide as live_decide
from controlplane.autoscale.policies import (
    History,
    PanicState,
    PolicyConfig,
    Proposal,
    Recommendation,
    Snapshot,
    decide,
)
from controlplane.autoscale.policies import applied as applied_policy
from controlplane.autoscale.profile import ReplicaProfile, load_profile
from controlplane.sim.fleet import FleetSim, Observation, ScaleEvent
from controlplane.sim.replica import RequestOutcome
from controlplane.sim.trace import SimRequest
from controlplane.vocabulary import HPA, OURS, STATIC, static_policy

if TYPE_CHECKING:
    import plotly.graph_objects as go

Progress = Callable[[float], None]  # fraction of simulated time done, 0..1


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"slo: ttft_s and tpot_s must be > 0, got {self.ttft_s}/{self.tpot_s}")

    def is_met(self, outcome: RequestOutcome) -> bool:
        ttft, tpot = outcome.ttft, outcome.tpot
        return ttft is not None and tpot is not None and ttft <= self.ttft_s and tpot <= self.tpot_s


@dataclass(slots=True, frozen=True)
class PolicySpec:
    """``ours``, ``hpa`` or ``static:N``."""

    kind: str
    replicas: int = 0

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        name, _, count = text.strip().partition(":")
        if name in (OURS, HPA) and not count:
            return cls(name)
        if name == STATIC and count.isdigit() and int(count) >= 1:
            return cls(STATIC, int(count))
        raise ValueError(f"policy: expected ours, hpa or static:N (N >= 1), got {text!r}")

    @property
    def label(self) -> str:
        return static_policy(self.replicas) if self.kind == STATIC else self.kind


@dataclass(slots=True, frozen=True)
class SimSettings:
    slo: Slo = Slo()
    min_replicas: int = 1
    max_replicas: int = 12
    initial_replicas: int = 2
    ours_tick_s: float = 5.0
    hpa_tick_s: float = 15.0
    stabilization_s: float = 300.0  # both policies' scale-down window, and the reversal window
    crashes: tuple[float, ...] = ()  # simulated times at which the busiest ready replica dies
    sample_s: float = 10.0
    # None: every replica has cores of its own; N: the replicas share N cores (steps stretch, see fleet.py)
    host_cores: int | None = None
    # with host_cores: core-seconds per request the host's other processes spend (gateway, a co-located
    # load client), which the replicas then do not have (fleet.py)
    host_cpu_per_request_s: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= initial_replicas <= max_replicas")
        if self.ours_tick_s <= 0 or self.hpa_tick_s <= 0 or self.sample_s <= 0:
            raise ValueError("ticks and sample_s: must be > 0")
        if self.host_cores is not None and self.host_cores < 1:
            raise ValueError(f"host_cores: must be >= 1 or None, got {self.host_cores}")
        if not self.host_cpu_per_request_s >= 0:
            raise ValueError(f"host_cpu_per_request_s: must be >= 0, got {self.host_cpu_per_request_s!r}")

    @classmethod
    def what_if(cls, *, ttft_slo_s: float, tpot_slo_s: float, max_replicas: int,
                crashes: Sequence[float] = ()) -> SimSettings:
        """An operator's what-if (``controlplane simulate``, the REST API): two replicas at the start, or
        fewer when the bound is lower."""
        return cls(slo=Slo(ttft_slo_s, tpot_slo_s), max_replicas=max_replicas,
                   initial_replicas=min(2, max_replicas), crashes=tuple(crashes))


# ---- policies on the simulated fleet ----------------------------------------------------------
def autoscaler_config(profile: ReplicaProfile, settings: SimSettings) -> AutoscalerConfig:
    """The live loop's configuration for this fleet: its defaults (our policy's knobs included), with the
    tokens/s target from the profile.

    The anomaly source stays off: it learns seasons of wall-clock time, which a compressed trace has not.
    """
    capacity = concurrency_capacity(profile, settings.slo)
    tokens = TOKENS_TARGET_SHARE * profile.decode_tokens_per_s(round(capacity), REFERENCE_CONTEXT)
    return AutoscalerConfig(
        tick_s=settings.ours_tick_s,
        min_replicas=settings.min_replicas,
        max_replicas=settings.max_replicas,
        ttft_slo_s=settings.slo.ttft_s,
        tpot_slo_s=settings.slo.tpot_s,
        target_tokens_per_s_per_replica=round(tokens, 1),
        tolerance=0.1,
        scale_down_stabilization_s=settings.stabilization_s,
        anomaly_enabled=False,
    )


REFERENCE_CONTEXT = 512  # tokens of context per sequence when sizing decode capacity
TOKENS_TARGET_SHARE = 0.6  # of the decode throughput at the capacity batch


def concurrency_capacity(profile: ReplicaProfile, slo: Slo) -> float:
    """Sequences one replica decodes together within half the TPOT SLO (the rest is prefill headroom)."""
    best = 1
    for batch in range(1, profile.max_num_seqs + 1):
        step = profile.step_time(
            num_decode=batch, num_prefill_tokens=0, context_tokens=batch * REFERENCE_CONTEXT
        )
        if step <= slo.tpot_s / 2:
            best = batch
    return float(best)


def metrics_of(obs: Observation, profile: ReplicaProfile) -> dict[str, float | None]:
    """The live loop's metrics (``controlplane.autoscale.decide.METRICS``) read off the simulated fleet."""
    ready = max(obs.ready, 1)
    idle = obs.arrivals_per_s == 0 and obs.waiting == 0 and obs.running == 0
    return {
        "waiting_per_replica": obs.waiting / ready,
        "kv_cache_usage": obs.kv_cache_usage,
        # no first token in the window: idle counts as 0 (as the live loop does), a queue as unknown
        "ttft_p95_s": obs.ttft_p95_s if obs.ttft_p95_s is not None else (0.0 if idle else None),
        "tokens_per_s_per_replica": obs.tokens_per_s / ready,
        "engine_load_per_replica": per_replica(offered_load(obs, profile), obs.ready),
    }


def offered_load(obs: Observation, profile: ReplicaProfile, *, short: bool = False) -> float | None:
    """The live loop's offered engine load (:func:`controlplane.autoscale.decide.offered_engine_load`) on the
    simulated fleet: arrivals over the metrics window (``short``: panic mode's window) times the mean tokens
    of the requests finished in the metrics window; None while requests arrive but none finished."""
    return offered_engine_load(
        profile,
        request_rate=obs.arrivals_per_s_short if short else obs.arrivals_per_s,
        mean_prompt_tokens=obs.mean_prompt_tokens,
        mean_output_tokens=obs.mean_output_tokens,
        prefix_hit_share=obs.prefix_hit_share,
    )


@dataclass(slots=True)
class LivePolicy:
    """``ours``: ``controlplane.autoscale.decide.decide`` on every tick, as the live loop calls it, with no
    anomaly source and no schedule window. The simulated fleet takes every count it is given, so each plan
    is applied."""

    config: AutoscalerConfig
    initial: int
    profile: ReplicaProfile
    state: LoopState = field(init=False)

    def __post_init__(self) -> None:
        # the fleet has been running at its initial size: that is the first recommendation in the window
        first = Recommendation(0.0, self.initial)
        self.state = LoopState(History(self.config.scale_down_stabilization_s, (first,)))

    def __call__(self, obs: Observation) -> tuple[int, str]:
        live = LiveObservation(
            now=obs.now,
            wall=obs.now,
            current=obs.desired,
            ready=obs.ready,
            starting=obs.starting,
            metrics=metrics_of(obs, self.profile),
            demand=offered_load(obs, self.profile, short=True),
            request_rate=obs.arrivals_per_s,
            panic_request_rate=obs.arrivals_per_s_short,
            mean_prompt_tokens=obs.mean_prompt_tokens,
            mean_output_tokens=obs.mean_output_tokens,
            prefix_hit_share=obs.prefix_hit_share,
            prompt_tokens_sd=obs.prompt_tokens_sd,
            rate_window_s=obs.rate_window_s,
        )
        live = with_work(live, self.state, self.config, self.profile)
        plan, state = live_decide(live, self.state, self.config, [])
        self.state = applied(state, live, plan)
        return plan.replicas, _reason(plan.decision.proposals, plan.clamps)


@dataclass(slots=True)
class HpaPolicy:
    """The Kubernetes HPA baseline: target tracking over the same metric targets, no panic mode."""

    config: PolicyConfig
    initial: int
    profile: ReplicaProfile
    history: History = field(init=False)
    state: PanicState = field(default_factory=PanicState)

    def __post_init__(self) -> None:
        self.history = History(self.config.scale_down_stabilization_s, (Recommendation(0.0, self.initial),))

    def __call__(self, obs: Observation) -> tuple[int, str]:
        snap = Snapshot(
            now=obs.now,
            current=obs.desired,
            ready=obs.ready,
            starting=obs.starting,
            metrics=metrics_of(obs, self.profile),
        )  # no demand: no panic mode
        decision, state = decide(snap, self.config, self.history.items, self.state)
        self.history = self.history.added(obs.now, decision.recommendation)
        self.state = applied_policy(state, current=decision.current, replicas=decision.replicas, now=obs.now)
        return decision.replicas, _reason(decision.proposals, decision.clamps)


def _reason(proposals: Sequence[Proposal], clamps: Sequence[str]) -> str:
    return "; ".join([*(f"{p.source}: {p.reason}" for p in proposals), *clamps])


def hpa_config(live: AutoscalerConfig, settings: SimSettings) -> PolicyConfig:
    """HPA's behaviour on the live loop's targets (waiting, KV cache, P95 TTFT, tokens/s, all sizing; no
    engine load): up by max(4 pods, 100%) per 15 s, down by 100% per period once the 300 s window allows
    it, tolerance 0.1, no panic."""
    ours = ours_policy(live)
    targets = tuple(replace(t, guard=False) for t in ours.targets if t.name != "engine_load_per_replica")
    return replace(
        ours,
        targets=targets,
        scale_down_period_s=0.0,
        panic_skips_rate_limit=False,
        tolerance=0.1,
        scale_down_stabilization_s=settings.stabilization_s,
        scale_up_max_step=4,
        scale_up_max_percent=100.0,
        scale_down_max_step=settings.max_replicas,
    )


def make_policy(
    spec: PolicySpec, profile: ReplicaProfile, settings: SimSettings
) -> tuple[Callable[[Observation], tuple[int, str]] | None, float, int]:
    """(policy, tick, initial replicas) of ``spec``."""
    if spec.kind == STATIC:
        return None, settings.hpa_tick_s, spec.replicas
    live = autoscaler_config(profile, settings)
    if spec.kind == HPA:
        return (
            HpaPolicy(hpa_config(live, settings), settings.initial_replicas, profile),
            settings.hpa_tick_s,
            settings.initial_replicas,
        )
    policy = LivePolicy(live, settings.initial_replicas, profile)
    return policy, settings.ours_tick_s, settings.initial_replicas


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
    duration_s: float
    wall_s: float
    timeline: Timeline

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
) -> PolicyReport:
    """One policy on the trace. ``speed(t)`` multiplies the replicas' step times at simulated time ``t``
    while the policy prices the work with the profile as given: a fleet whose replicas run off the profile
    it is sized by (``python -m controlplane.bench sim-vs-live``'s diagnostic); None: at the profile."""
    profile = profile or load_profile()
    policy, tick, initial = make_policy(spec, profile, settings)
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
        duration_s=round(sim.duration, 1),
        wall_s=round(wall_s, 2),
        timeline=_timeline(sim),
    )


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
        f"{'POLICY':<10} {'REQUESTS':>8} {'SLO MET':>8} {'REPLICA-S':>10} {'SCALE EV':>8} {'REVERSALS':>9} "
        f"{'P95 TTFT':>9} {'P95 TPOT':>9} {'SIM WALL':>8}"
    )
    lines = [f"SLO: TTFT <= {slo.ttft_s:g}s and TPOT <= {slo.tpot_s:g}s", head]
    for r in reports:
        lines.append(
            f"{r.policy:<10} {r.num_requests:>8} {r.slo_attainment * 100:>7.1f}% {r.replica_seconds:>10.0f} "
            f"{r.scale_events:>8} {r.reversals:>9} {_fmt_s(r.ttft_p95_s):>9} {_fmt_s(r.tpot_p95_s):>9} "
            f"{r.wall_s:>7.2f}s"
        )
    return "\n".join(lines)


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


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
