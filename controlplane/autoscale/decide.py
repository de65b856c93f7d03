"""The autoscaler's decision: one observation and the remembered state in, a plan with its reasons out.

Each source proposes a replica count with its reason (target tracking and panic mode from
:mod:`controlplane.autoscale.policies`, the anomaly source from :mod:`controlplane.autoscale.anomaly`), the
largest wins, then the clamps apply (min/max, stabilization, rate limits, the scale-down period, and last the
bounds of the active cron window from :mod:`controlplane.autoscale.windows`). No I/O, no clock, no change
to its arguments: :func:`decide` takes the remembered :class:`LoopState` and returns the plan with the
next state, and :func:`applied` records a scale that happened (not in observe-only mode, not when the
scale call failed). The live loop (:mod:`controlplane.autoscale.loop`) and the what-if simulator
(:mod:`controlplane.sim.simulator`, policy ``ours``) call the same functions, so the benchmark measures
what runs live.

Our policy has one definition, :func:`ours_policy` with :func:`offered_work` and
:func:`offered_engine_load`, both from the request rate and the mean prompt and output tokens of the
requests that finished in the window, priced by the replica profile (:mod:`controlplane.autoscale.profile`;
the work at the steady load, :func:`controlplane.autoscale.load.steady_load`, which :func:`with_work`
applies for both callers):
the work's prefill, decode, KV and TPOT-tail terms (:mod:`controlplane.autoscale.work`) size the fleet
(the ``work`` proposal), checked against the fleet's own queue and TTFT (the ``backlog`` proposal); the
offered engine load, in engine seconds per second, is panic mode's demand and, with sizing by work off,
sizes the fleet through target tracking.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from controlplane.autoscale.anomaly import AnomalyReading, AnomalySettings, AnomalyState
from controlplane.autoscale.anomaly import observe as observe_anomaly
from controlplane.autoscale.config import AUTOSCALER_METRICS, AutoscalerConfig
from controlplane.autoscale.drift import ProfileDrift
from controlplane.autoscale.load import LoadSample, load_after, steady_load, surge
from controlplane.autoscale.policies import (
    Decision,
    History,
    MetricTarget,
    PanicState,
    PolicyConfig,
    Proposal,
    Recommendation,
    Snapshot,
)
from controlplane.autoscale.policies import applied as applied_policy
from controlplane.autoscale.policies import decide as decide_policy
from controlplane.autoscale.profile import ReplicaProfile
from controlplane.autoscale.windows import Window, active_window
from controlplane.autoscale.work import WorkNeeds, cached_share, work_needs

METRICS = AUTOSCALER_METRICS
WORK_SUPERSEDES = ("engine_load_per_replica", "tokens_per_s_per_replica")  # guards when sizing by work


@dataclass(slots=True, frozen=True)
class Observation:
    """One tick's inputs. ``now`` is the loop's monotonic clock, ``wall`` POSIX seconds."""

    now: float
    wall: float
    current: int
    ready: int
    starting: int
    metrics: Mapping[str, float | None]  # per name in METRICS; None: unknown
    demand: float | None = None  # offered engine load over the panic window, fleet-wide (engine s per s)
    request_rate: float | None = None  # inference requests per second, fleet-wide
    notes: tuple[str, ...] = ()
    panic_request_rate: float | None = None  # over the panic window
    mean_prompt_tokens: float | None = None  # of the requests finished in the metrics window
    mean_output_tokens: float | None = None
    prompt_tokens_sd: float | None = None  # the spread of those prompts' lengths (None: unknown)
    output_tokens_sd: float | None = None  # and of their outputs' lengths (None: unknown)
    work: WorkNeeds | None = None  # replicas the offered work needs (controlplane.autoscale.work)
    refused_rate: float | None = None  # of request_rate, refused at the gateways for want of capacity
    drift: ProfileDrift | None = None  # the replicas' engine time against the profile's (autoscale.drift)
    # of the prompt tokens the replicas admitted in the metrics window, the share their prefix caches held
    # (vllm:prefix_cache_hits over vllm:prefix_cache_queries); None: unknown or none admitted
    prefix_hit_share: float | None = None
    rate_window_s: float | None = None  # what request_rate was measured over (None: unknown, no steady load)
    # the seconds of arrivals panic_request_rate counts: a rate from scraped counters counts the increase
    # between the window's first and last samples, about a scrape interval less than the window, and
    # extrapolates it (None: the whole panic window, as the simulator counts)
    panic_counted_s: float | None = None
    load_changed: bool = False  # this tick's rate is a change of load (with_work, steady_load)


@dataclass(slots=True, frozen=True)
class LoopState:
    """What decisions remember between ticks: each tick's :func:`decide` returns the next one."""

    history: History  # recent recommendations, for the scale-down stabilization window
    panic: PanicState = field(default_factory=PanicState)  # panic mode's end, the last scale-down applied
    anomaly: AnomalyState | None = None  # None: the anomaly source is off
    waiting: float | None = None  # waiting_per_replica at the last tick (the backlog proposal's trend)
    load: tuple[LoadSample, ...] = ()  # the ticks' offered load since it last changed (steady_load)
    # the ready replicas at the last tick and since when there were no fewer (the backlog proposal reads
    # P95 TTFT only once its window holds no request from before the last replica became ready)
    ready: tuple[int, float] | None = None


@dataclass(slots=True, frozen=True)
class Plan:
    decision: Decision
    replicas: int  # the final count, after the window's bounds
    clamps: tuple[str, ...]
    window: Window | None
    bounds: tuple[int, int]
    anomaly: AnomalyReading | None


def ours_policy(cfg: AutoscalerConfig) -> PolicyConfig:
    """Our policy, for the live loop and the simulator alike: HPA target tracking on every metric of
    ``METRICS``, where ``cfg.guards`` only forbid scale-down, the offered engine load sizes the fleet and is
    panic mode's demand (capacity ``target_engine_load_per_replica`` per ready replica), panic may skip the
    scale-up rate limit and scale-down goes one step per ``scale_down_period_s``."""
    values = {"waiting_per_replica": cfg.target_waiting_per_replica,
              "kv_cache_usage": cfg.target_kv_cache_usage, "ttft_p95_s": cfg.ttft_slo_s,
              "tokens_per_s_per_replica": cfg.target_tokens_per_s_per_replica,
              "engine_load_per_replica": cfg.target_engine_load_per_replica}
    # Sizing by work replaces the sizing by engine load and by generated tokens: both price decode at a
    # fixed reference batch, so long answers decoded in large batches read as up to twice the work they
    # are. They stay guards (no scale-down while over their targets).
    guards = {*cfg.guards, *(WORK_SUPERSEDES if cfg.work_sizing else ())}
    targets = tuple(MetricTarget(name, values[name], guard=name in guards) for name in METRICS)
    return PolicyConfig(
        min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas, targets=targets,
        tolerance=cfg.tolerance,
        scale_down_stabilization_s=cfg.scale_down_stabilization_s, scale_up_max_step=cfg.scale_up_max_step,
        scale_up_max_percent=cfg.scale_up_max_percent, scale_down_max_step=cfg.scale_down_max_step,
        panic_window_s=cfg.panic_window_s, panic_threshold=cfg.panic_threshold,
        scale_down_period_s=cfg.scale_down_period_s, panic_skips_rate_limit=cfg.panic_skips_rate_limit)


def offered_engine_load(profile: ReplicaProfile, *, request_rate: float | None,
                        mean_prompt_tokens: float | None, mean_output_tokens: float | None,
                        prefix_hit_share: float | None = None) -> float | None:
    """Engine seconds per second that arriving requests need: request rate x mean tokens per request (the
    prompt's less the share prefix caches hold), converted with the replica profile. Linear in the load
    and, unlike served token rates, it keeps growing past saturation; unlike the queue it counts no
    backlog. None when unknown (no rate, or requests arrive but none finished in the window to tell their
    size); 0 when nothing arrives."""
    if request_rate is None:
        return None
    if request_rate <= 0:
        return 0.0
    if mean_prompt_tokens is None or mean_output_tokens is None:
        return None
    computed = mean_prompt_tokens * (1.0 - cached_share(prefix_hit_share))
    return profile.engine_load(prompt_tokens_per_s=request_rate * computed,
                               generated_tokens_per_s=request_rate * mean_output_tokens,
                               mean_prompt_tokens=max(computed, 1.0))


def offered_work(profile: ReplicaProfile, cfg: AutoscalerConfig, *, request_rate: float | None,
                 mean_prompt_tokens: float | None, mean_output_tokens: float | None,
                 prefix_hit_share: float | None = None,
                 prompt_tokens_sd: float | None = None,
                 output_tokens_sd: float | None = None) -> WorkNeeds | None:
    """Replicas the offered work needs (:func:`controlplane.autoscale.work.work_needs`) at the SLOs, and
    (``with_margin``) at the rate plus the tolerance, which bounds a scale-down."""
    def needs(rate: float | None) -> WorkNeeds | None:
        return work_needs(profile, rate=rate, mean_prompt=mean_prompt_tokens, mean_output=mean_output_tokens,
                          ttft_slo_s=cfg.ttft_slo_s, tpot_slo_s=cfg.tpot_slo_s, quantile=cfg.slo_quantile,
                          kv_headroom=cfg.target_kv_cache_usage, prefix_hit_share=prefix_hit_share,
                          prompt_sd=prompt_tokens_sd, output_sd=output_tokens_sd)

    now = needs(request_rate)
    margin = needs(None if request_rate is None else request_rate * (1 + cfg.tolerance))
    if now is None or margin is None:
        return now
    return replace(now, with_margin=margin.replicas)


def with_work(obs: Observation, state: LoopState, cfg: AutoscalerConfig, profile: ReplicaProfile, *,
              inflight_limit: int | None = None) -> Observation:
    """The observation with the work it offers (:func:`offered_work`) sized on its steady load
    (:func:`steady_load`), whose note joins the observation's: what the live loop and the simulator hand
    to :func:`decide`. Where the panic window shows a :func:`surge` and the work at its rate needs more
    replicas than the steady load's and than the fleet has, that work stands instead (the scale-up comes
    up to a metrics window sooner); where it needs no more, the steady load's stands, since a 6 s peak held
    through the stabilization window would keep the fleet at a peak it already served.

    ``inflight_limit``: the most requests the gateways let one replica hold (``max_inflight_per_replica``).
    Below the profile's ``max_num_seqs`` it is the largest batch a replica runs, so the decode term sizes
    on it: a fleet whose gateways shed at one stream per replica holds one sequence per replica, however
    large a batch its engines could decode."""
    notes = obs.notes
    if inflight_limit is not None and 0 < inflight_limit < profile.max_num_seqs:
        profile = replace(profile, max_num_seqs=inflight_limit)
        notes = (*notes, f"the gateways let a replica hold {inflight_limit} request(s) at once "
                         f"(max_inflight_per_replica): decode batches of {inflight_limit} at most")
    steady = steady_load(obs, state, cfg)

    def sized(rate: float | None, prompt: float | None, output: float | None) -> WorkNeeds | None:
        return offered_work(profile, cfg, request_rate=rate, mean_prompt_tokens=prompt,
                            mean_output_tokens=output, prefix_hit_share=obs.prefix_hit_share,
                            prompt_tokens_sd=obs.prompt_tokens_sd, output_tokens_sd=obs.output_tokens_sd)

    work, note = sized(steady.rate, steady.mean_prompt_tokens, steady.mean_output_tokens), steady.note
    if work is not None and (surging := surge(obs, steady.rate, cfg)) is not None:
        surged = sized(surging[0], obs.mean_prompt_tokens, obs.mean_output_tokens)
        if surged is not None and surged.replicas > max(work.replicas, obs.current):
            work, note = surged, surging[1]
    return replace(obs, work=work, notes=(*notes, note) if note else notes, load_changed=steady.changed)


def backlog_proposal(obs: Observation, cfg: AutoscalerConfig, before: float | None,
                     ready_since: float | None) -> Proposal | None:
    """The work model checked against what the fleet shows: one replica more when every replica is ready,
    the work sizes the fleet at no more than it has, and yet P95 TTFT misses the SLO beyond the tolerance
    while the queue grows (``before``: the last tick's queue). Requests then wait for want of capacity the
    model does not see (replicas slower than their profile, a host whose cores they share, requests unlike
    the window's means, routing that is not one shared queue). The queue need not be over its target: at
    0.3 s prefills two or three waiting per replica already take a request past a 1 s TTFT. One at a time,
    each measured before the next: a replica still starting is capacity on its way, and a queue that
    shrinks is being served. Until a window has passed since the last replica became ready
    (``ready_since``), P95 TTFT is partly the smaller fleet's: then only a queue over its target as well
    shows this fleet short. None otherwise."""
    if obs.work is None or obs.starting or obs.ready < obs.current or obs.current < 1:
        return None
    if obs.work.proposal(obs.current) > obs.current:
        return None  # the model already asks for more
    limit = 1 + cfg.tolerance
    waiting, ttft = obs.metrics.get("waiting_per_replica"), obs.metrics.get("ttft_p95_s")
    if waiting is None or ttft is None or before is None or waiting <= before \
            or ttft <= cfg.ttft_slo_s * limit:
        return None
    settled = ready_since is not None and obs.now - ready_since >= (obs.rate_window_s or 0.0)
    if not settled and waiting <= cfg.target_waiting_per_replica * limit:
        return None
    return Proposal("backlog", obs.current + 1,
                    f"{waiting:.3g} waiting per replica ({waiting / cfg.target_waiting_per_replica:.1f}x "
                    f"target, {before:.3g} a tick before) and P95 TTFT {ttft:.2f}s "
                    f"({ttft / cfg.ttft_slo_s:.1f}x SLO) with every replica ready, while the work sizes "
                    f"{obs.work.replicas}: one replica more")


def per_replica(value: float | None, ready: int) -> float | None:
    """A fleet-wide value averaged over ready replicas (HPA's AverageValue); None without a ready one."""
    return None if value is None or ready <= 0 else value / ready


def anomaly_settings(cfg: AutoscalerConfig) -> AnomalySettings:
    return AnomalySettings(period=cfg.anomaly_period, history=cfg.anomaly_history,
                           refit_every=cfg.anomaly_refit_every, z=cfg.anomaly_z,
                           cooldown_s=cfg.anomaly_cooldown_s, min_rate_sigma=cfg.anomaly_min_rate_sigma,
                           min_ttft_sigma_s=cfg.anomaly_min_ttft_sigma_s)


def new_state(cfg: AutoscalerConfig, *, history: tuple[Recommendation, ...] = ()) -> LoopState:
    return LoopState(History(cfg.scale_down_stabilization_s, history),
                     anomaly=AnomalyState(anomaly_settings(cfg)) if cfg.anomaly_enabled else None)


def decide(obs: Observation, state: LoopState, cfg: AutoscalerConfig,
           windows: list[Window]) -> tuple[Plan, LoopState]:
    """Proposals, merge and clamps for one observation: the plan, and the state after this observation
    (history, panic window, anomaly model). It does not assume the plan was applied: see :func:`applied`."""
    extra: list[Proposal] = []
    since = ready_since(obs.ready, obs.now, state.ready)
    if cfg.work_sizing and obs.work is not None and obs.request_rate:
        extra.append(Proposal("work", obs.work.proposal(obs.current), obs.work.reason))
        if (backlog := backlog_proposal(obs, cfg, state.waiting, since)) is not None:
            extra.append(backlog)
    reading, anomaly = None, state.anomaly
    if anomaly is not None:
        # Without requests there is no latency to judge (the target source reads it as 0).
        ttft = obs.metrics.get("ttft_p95_s") if obs.request_rate else None
        proposal, reading, anomaly = observe_anomaly(anomaly, obs.now, obs.current, obs.request_rate, ttft)
        if proposal is not None:
            extra.append(proposal)
    snapshot = Snapshot(obs.now, obs.current, obs.ready, obs.starting, obs.metrics, obs.demand,
                        cfg.target_engine_load_per_replica)
    decision, panic = decide_policy(snapshot, ours_policy(cfg), state.history.items, state.panic, extra)
    # the window follows the configuration, which an operator may change between ticks
    history = replace(state.history, window_s=cfg.scale_down_stabilization_s).added(obs.now,
                                                                                    decision.recommendation)
    waiting = obs.metrics.get("waiting_per_replica")
    return _bounded(obs, decision, cfg, windows, reading), LoopState(history, panic, anomaly, waiting,
                                                                     load_after(obs, state, cfg),
                                                                     (obs.ready, since))


def ready_since(ready: int, now: float, last: tuple[int, float] | None) -> float:
    """Since when the fleet has had no fewer ready replicas than ``ready`` at ``now``, given the last
    tick's (ready, since): now when more are ready than then, or when there was none (a loop that starts
    knows nothing older)."""
    if last is None or ready > last[0]:
        return now
    return last[1]


def applied(state: LoopState, obs: Observation, plan: Plan) -> LoopState:
    """The state once the fleet was scaled as ``plan`` says at ``obs.now``. Call it only for a scale that
    happened: a plan that was not applied must not start a scale-down period."""
    return replace(state, panic=applied_policy(state.panic, current=obs.current, replicas=plan.replicas,
                                               now=obs.now))


def _bounded(obs: Observation, decision: Decision, cfg: AutoscalerConfig, windows: list[Window],
             reading: AnomalyReading | None) -> Plan:
    """The plan: the decision within the bounds of the active cron window (or min/max)."""
    window = active_window(windows, datetime.fromtimestamp(obs.wall, UTC))
    low, high = window.bounds(cfg.min_replicas, cfg.max_replicas) if window else (cfg.min_replicas,
                                                                                    cfg.max_replicas)
    replicas = min(max(decision.replicas, low), high)
    clamps = list(decision.clamps)
    if replicas != decision.replicas:  # bounds are hard, as in HPA: they win over stabilization
        what = f"schedule window {window.name!r}" if window else "min/max"
        clamps.append(f"{what}: {decision.replicas} -> {replicas} (bounds {low}..{high})")
    return Plan(decision, replicas, tuple(clamps), window, (low, high), reading)


def record_body(obs: Observation, plan: Plan, *, tick: int, mode: str, applied: bool, outcome: str,
                error: str | None = None) -> dict[str, Any]:
    """The decision record: enough to recompute every number from its inputs."""
    d = plan.decision
    window = None if plan.window is None else {"name": plan.window.name, "schedule": plan.window.describe}
    return {
        "at": obs.wall, "tick": tick, "mode": mode,
        "inputs": {"current": obs.current, "ready": obs.ready, "starting": obs.starting,
                   "metrics": {k: _round(v) for k, v in obs.metrics.items()}, "demand": _round(obs.demand),
                   "request_rate": _round(obs.request_rate), "refused_rate": _round(obs.refused_rate),
                   "panic_request_rate": _round(obs.panic_request_rate),
                   "panic_counted_s": _round(obs.panic_counted_s),
                   "rate_window_s": _round(obs.rate_window_s), "load_changed": obs.load_changed,
                   "mean_prompt_tokens": _round(obs.mean_prompt_tokens),
                   "mean_output_tokens": _round(obs.mean_output_tokens),
                   "prompt_tokens_sd": _round(obs.prompt_tokens_sd),
                   "output_tokens_sd": _round(obs.output_tokens_sd),
                   "prefix_hit_share": _round(obs.prefix_hit_share), "notes": list(obs.notes),
                   "work": None if obs.work is None else {"prefill": obs.work.prefill,
                                                          "decode": obs.work.decode, "kv": obs.work.kv,
                                                          "tpot": obs.work.tpot},
                   "profile_drift": None if obs.drift is None else obs.drift.as_dict()},
        "proposals": [{"source": p.source, "replicas": p.replicas, "reason": p.reason} for p in d.proposals],
        "recommendation": d.recommendation, "panic": d.panic, "window": window,
        "bounds": list(plan.bounds), "clamps": list(plan.clamps), "final": plan.replicas,
        "applied": applied, "outcome": outcome, "error": error,
        "anomaly": None if plan.anomaly is None else plan.anomaly.as_dict(),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
