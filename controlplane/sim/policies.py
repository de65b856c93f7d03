"""The policies as they see the simulated fleet: ``ours`` (:class:`LivePolicy`, the live loop's own
:func:`controlplane.autoscale.decide.decide` on the live loop's configuration, :func:`autoscaler_config`)
and ``hpa`` (:class:`HpaPolicy`, the Kubernetes HPA baseline, :func:`hpa_config`), each reading the live
loop's metrics off a :class:`controlplane.sim.fleet.Observation` (:func:`metrics_of`, :func:`offered_load`);
:func:`make_policy` builds one from a :class:`~controlplane.sim.settings.PolicySpec`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

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
from controlplane.autoscale.profile import ReplicaProfile
from controlplane.sim.fleet import Observation
from controlplane.sim.settings import PolicySpec, SimSettings, Slo
from controlplane.vocabulary import HPA, STATIC


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
    # what the loop remembers from before the trace's start (its load samples, the last queue, the ready
    # replicas since when: python -m controlplane.bench sim-vs-live, from the live loop's decision records);
    # None: a loop that starts with the trace
    prior: LoopState | None = None
    state: LoopState = field(init=False)

    def __post_init__(self) -> None:
        # the fleet has been running at its initial size: that is the first recommendation in the window
        first = Recommendation(0.0, self.initial)
        history = History(self.config.scale_down_stabilization_s, (first,))
        self.state = LoopState(history) if self.prior is None else replace(self.prior, history=history)

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
            panic_counted_s=obs.panic_counted_s,
            mean_prompt_tokens=obs.mean_prompt_tokens,
            mean_output_tokens=obs.mean_output_tokens,
            prefix_hit_share=obs.prefix_hit_share,
            prompt_tokens_sd=obs.prompt_tokens_sd,
            output_tokens_sd=obs.output_tokens_sd,
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
    spec: PolicySpec, profile: ReplicaProfile, settings: SimSettings, *, prior: LoopState | None = None
) -> tuple[Callable[[Observation], tuple[int, str]] | None, float, int]:
    """(policy, tick, initial replicas) of ``spec``; ``prior``: what ``ours`` remembers from before the
    trace (:class:`LivePolicy`)."""
    if spec.kind == STATIC:
        return None, settings.hpa_tick_s, spec.replicas
    live = autoscaler_config(profile, settings)
    if spec.kind == HPA:
        return (
            HpaPolicy(hpa_config(live, settings), settings.initial_replicas, profile),
            settings.hpa_tick_s,
            settings.initial_replicas,
        )
    policy = LivePolicy(live, settings.initial_replicas, profile, prior)
    return policy, settings.ours_tick_s, settings.initial_replicas
