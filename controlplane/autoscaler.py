"""The autoscaler's decision loop: observe a snapshot, decide (pure), apply once, record why.

Every ``tick_s`` the loop reads the fleet (desired, ready and starting replicas) and telemetry (waiting
requests, KV-cache usage, P95 TTFT, generated tokens/s and offered engine load per ready replica; the
request rate) into an :class:`Observation`. :func:`decide` turns it into a :class:`Plan`: each source
proposes a replica count with its reason (target tracking and panic mode from ``controlplane.policies``,
the anomaly source from ``controlplane.anomaly``), the largest wins, then the clamps apply (min/max,
stabilization, rate limits, the scale-down period, and last the bounds of the active cron window from
``controlplane.windows``). The loop applies the plan once through ``fleet.scale`` (not in observe-only
mode) and stores a decision record in the store's ``decisions`` collection with every input, proposal,
clamp and the outcome.

Our policy has one definition, :func:`ours_policy` with :func:`offered_engine_load`; the what-if simulator
(``controlplane.simulator``, policy ``ours``) calls this module's :func:`decide` with them, so the benchmark
measures what runs here. The offered engine load is the request rate times the mean prompt and output
tokens of the requests that finished in the window (``vllm:prompt_tokens_total`` and
``vllm:generation_tokens_total`` over ``vllm:request_success_total``), in engine seconds per second through
the replica profile (``controlplane.sim_profile``): it sizes the fleet and is panic mode's demand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from controlplane.anomaly import AnomalyDetector, AnomalyReading, AnomalySettings
from controlplane.config import AUTOSCALER_METRICS, AutoscalerConfig, Config, ScheduleWindowConfig, validate
from controlplane.policies import (
    Decision,
    History,
    MetricTarget,
    PanicState,
    PolicyConfig,
    Proposal,
    Recommendation,
    Snapshot,
)
from controlplane.policies import decide as decide_policy
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.sim_profile import ReplicaProfile, load_profile
from controlplane.store import Store
from controlplane.telemetry import (
    GENERATION_TOKENS,
    HTTP_REQUESTS,
    INFERENCE_PATHS,
    KV_USAGE,
    NUM_WAITING,
    REQUEST_SUCCESS,
    TTFT,
    Regex,
    Telemetry,
    TelemetryError,
)
from controlplane.windows import Window, active_window, parse_windows, window_problems

logger = logging.getLogger(__name__)

COLLECTION = "decisions"
TRIM_EVERY_TICKS = 100
OVERRIDES_KEY = "autoscaler.overrides"
PAUSED_KEY = "autoscaler.paused"
WINDOWS_KEY = "autoscaler.windows"  # windows set through the API; they replace the config's
METRICS = AUTOSCALER_METRICS
PROMPT_TOKENS = "vllm:prompt_tokens_total"  # incremented when a request finishes, as generation tokens are
# Fields an operator may change at run time (PUT /api/v1/autoscaler/config).
MUTABLE = ("observe_only", "min_replicas", "max_replicas", "target_waiting_per_replica",
           "target_kv_cache_usage", "ttft_slo_s", "target_tokens_per_s_per_replica",
           "target_engine_load_per_replica", "tolerance", "scale_down_stabilization_s", "scale_down_period_s")


class ScalableFleet(Protocol):
    """What the loop needs of ``controlplane.fleet.Fleet``."""

    desired_total: int

    def endpoints(self) -> list[ReplicaEndpoint]: ...

    def scale(self, replicas: int) -> None: ...


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


@dataclass(slots=True)
class LoopState:
    """What decisions remember between ticks."""

    history: History
    panic: PanicState = field(default_factory=PanicState)
    anomaly: AnomalyDetector | None = None


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
    targets = tuple(MetricTarget(name, values[name], guard=name in cfg.guards) for name in METRICS)
    return PolicyConfig(
        min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas, targets=targets,
        tolerance=cfg.tolerance,
        scale_down_stabilization_s=cfg.scale_down_stabilization_s, scale_up_max_step=cfg.scale_up_max_step,
        scale_up_max_percent=cfg.scale_up_max_percent, scale_down_max_step=cfg.scale_down_max_step,
        panic_window_s=cfg.panic_window_s, panic_threshold=cfg.panic_threshold,
        scale_down_period_s=cfg.scale_down_period_s, panic_skips_rate_limit=cfg.panic_skips_rate_limit)


def offered_engine_load(profile: ReplicaProfile, *, request_rate: float | None,
                        mean_prompt_tokens: float | None, mean_output_tokens: float | None) -> float | None:
    """Engine seconds per second that arriving requests need: request rate x mean tokens per request,
    converted with the replica profile. Linear in the load and, unlike served token rates, it keeps growing
    past saturation; unlike the queue it counts no backlog. None when unknown (no rate, or requests arrive
    but none finished in the window to tell their size); 0 when nothing arrives."""
    if request_rate is None:
        return None
    if request_rate <= 0:
        return 0.0
    if mean_prompt_tokens is None or mean_output_tokens is None:
        return None
    return profile.engine_load(prompt_tokens_per_s=request_rate * mean_prompt_tokens,
                               generated_tokens_per_s=request_rate * mean_output_tokens)


def per_replica(value: float | None, ready: int) -> float | None:
    """A fleet-wide value averaged over ready replicas (HPA's AverageValue); None without a ready one."""
    return None if value is None or ready <= 0 else value / ready


def anomaly_settings(cfg: AutoscalerConfig) -> AnomalySettings:
    return AnomalySettings(period=cfg.anomaly_period, history=cfg.anomaly_history,
                           refit_every=cfg.anomaly_refit_every, z=cfg.anomaly_z,
                           cooldown_s=cfg.anomaly_cooldown_s, min_rate_sigma=cfg.anomaly_min_rate_sigma,
                           min_ttft_sigma_s=cfg.anomaly_min_ttft_sigma_s)


def new_state(cfg: AutoscalerConfig) -> LoopState:
    return LoopState(History(cfg.scale_down_stabilization_s),
                     anomaly=AnomalyDetector(anomaly_settings(cfg)) if cfg.anomaly_enabled else None)


def decide(obs: Observation, state: LoopState, cfg: AutoscalerConfig, windows: list[Window]) -> Plan:
    """Proposals, merge and clamps for one observation; updates ``state`` (history, panic, anomaly)."""
    extra: list[Proposal] = []
    reading = None
    if state.anomaly is not None:
        # Without requests there is no latency to judge (the target source reads it as 0).
        ttft = obs.metrics.get("ttft_p95_s") if obs.request_rate else None
        proposal, reading = state.anomaly.observe(obs.now, obs.current, obs.request_rate, ttft)
        if proposal is not None:
            extra.append(proposal)
    snapshot = Snapshot(obs.now, obs.current, obs.ready, obs.starting, obs.metrics, obs.demand,
                        cfg.target_engine_load_per_replica)
    decision = decide_policy(snapshot, ours_policy(cfg), state.history.items, state.panic, extra)
    state.history.window_s = cfg.scale_down_stabilization_s
    state.history.add(obs.now, decision.recommendation)
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
                   "request_rate": _round(obs.request_rate),
                   "panic_request_rate": _round(obs.panic_request_rate),
                   "mean_prompt_tokens": _round(obs.mean_prompt_tokens),
                   "mean_output_tokens": _round(obs.mean_output_tokens), "notes": list(obs.notes)},
        "proposals": [{"source": p.source, "replicas": p.replicas, "reason": p.reason} for p in d.proposals],
        "recommendation": d.recommendation, "panic": d.panic, "window": window,
        "bounds": list(plan.bounds), "clamps": list(plan.clamps), "final": plan.replicas,
        "applied": applied, "outcome": outcome, "error": error,
        "anomaly": None if plan.anomaly is None else plan.anomaly.as_dict(),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def observe_telemetry(telemetry: Telemetry, endpoints: list[ReplicaEndpoint], *, now: float, wall: float,
                      current: int, window_s: float | None, profile: ReplicaProfile,
                      panic_window_s: float) -> Observation:
    """Fleet-level inputs from per-replica series; averages are over ready replicas (HPA's AverageValue)."""
    ready = [e.replica_id for e in endpoints if e.state is ReplicaState.READY]
    starting = sum(1 for e in endpoints if e.state is ReplicaState.STARTING)
    notes: list[str] = []
    inference = {"path": Regex(INFERENCE_PATHS)}
    try:
        waiting = telemetry.gauge(NUM_WAITING)
        kv = telemetry.gauge(KV_USAGE, agg="max")
        tokens = telemetry.rate(GENERATION_TOKENS, window_s=window_s)
        rate = telemetry.rate(HTTP_REQUESTS, window_s=window_s, by=(), match=inference).get(())
        ttft = telemetry.quantile(TTFT, 0.95, window_s=window_s, by=()).get(())
        short = telemetry.rate(HTTP_REQUESTS, window_s=panic_window_s, by=(), match=inference).get(())
        finished = telemetry.rate(REQUEST_SUCCESS, window_s=window_s, by=()).get(())
        prompt = telemetry.rate(PROMPT_TOKENS, window_s=window_s, by=()).get(())
    except TelemetryError as exc:
        notes.append(f"telemetry unavailable: {exc}")
        return Observation(now, wall, current, len(ready), starting, dict.fromkeys(METRICS),
                           notes=tuple(notes))
    if ttft is None and rate is not None and rate == 0:
        ttft = 0.0  # no request in the window: nothing waited for a first token
        notes.append("ttft_p95_s: no request in the window, counted as 0")
    mean_prompt, mean_output = _means(finished, prompt, sum(tokens.values()) if tokens else None)
    if short is None and rate is not None:
        short = rate  # the panic window holds too few scrapes for a rate: the metrics window stands in
        notes.append(f"request rate over {panic_window_s:g}s unknown: the metrics window's used")
    load = offered_engine_load(profile, request_rate=rate, mean_prompt_tokens=mean_prompt,
                               mean_output_tokens=mean_output)
    if load is None and rate:
        notes.append("engine_load_per_replica: no request finished in the window to size the load")
    metrics = {"waiting_per_replica": _mean(waiting, ready), "kv_cache_usage": _mean(kv, ready),
               "ttft_p95_s": ttft, "tokens_per_s_per_replica": _mean(tokens, ready),
               "engine_load_per_replica": per_replica(load, len(ready))}
    demand = offered_engine_load(profile, request_rate=short, mean_prompt_tokens=mean_prompt,
                                 mean_output_tokens=mean_output)
    return Observation(now, wall, current, len(ready), starting, metrics, demand, rate, tuple(notes),
                       short, mean_prompt, mean_output)


def _means(finished: float | None, prompt: float | None,
           generated: float | None) -> tuple[float | None, float | None]:
    """Mean prompt and output tokens of the requests that finished in the window (counter rates)."""
    if not finished or prompt is None or generated is None:
        return None, None
    return prompt / finished, generated / finished


def _mean(values: Mapping[tuple[str, ...], float], replicas: list[str]) -> float | None:
    known = [values[(r,)] for r in replicas if (r,) in values and math.isfinite(values[(r,)])]
    return sum(known) / len(known) if known else None


class Autoscaler:
    """The loop; ``tick()`` is one pass, ``run()`` ticks every ``tick_s`` until ``stop()``."""

    def __init__(self, config: AutoscalerConfig, fleet: ScalableFleet, telemetry: Telemetry, store: Store, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.fleet, self.telemetry, self.store = fleet, telemetry, store
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.config = config
        self.profile = load_profile(config.replica_profile or None)  # validated with the config
        self.paused = False
        self.ticks = 0
        self.last: dict[str, Any] | None = None
        self._restore_operator_state()
        self.windows = parse_windows(self.config.windows)
        self.window_configs, self.windows_source = list(self.config.windows), "config"
        self._restore_windows()
        self.state = new_state(self.config)
        self._restore_history()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ---- operator controls ---------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return "paused" if self.paused else "observe_only" if self.config.observe_only else "active"

    def pause(self) -> None:
        self.paused = True
        self.store.kv_put(PAUSED_KEY, True)

    def resume(self) -> None:
        self.paused = False
        self.store.kv_put(PAUSED_KEY, False)

    def update(self, changes: Mapping[str, Any]) -> AutoscalerConfig:
        """Change run-time settings (``MUTABLE``); ``ValueError`` names the bad key. Kept across restarts."""
        unknown = sorted(set(changes) - set(MUTABLE))
        if unknown:
            raise ValueError(f"{unknown[0]}: cannot be changed at run time (allowed: {', '.join(MUTABLE)})")
        candidate = dataclasses.replace(self.config, **changes)
        problems = [p for p in validate(Config(autoscaler=candidate)) if p[0].startswith("autoscaler.")]
        if problems:
            key, reason = problems[0]
            raise ValueError(f"{key.removeprefix('autoscaler.')}: {reason}")
        self.config = candidate
        stored = dict(self.store.kv_get(OVERRIDES_KEY, {}) or {})
        self.store.kv_put(OVERRIDES_KEY, {**stored, **changes})
        return candidate

    def _restore_operator_state(self) -> None:
        overrides = {k: v for k, v in (self.store.kv_get(OVERRIDES_KEY, {}) or {}).items() if k in MUTABLE}
        if overrides:
            try:
                candidate = dataclasses.replace(self.config, **overrides)
                if not [p for p in validate(Config(autoscaler=candidate)) if p[0].startswith("autoscaler.")]:
                    self.config = candidate
                    logger.info("autoscaler: operator overrides restored: %s", sorted(overrides))
            except TypeError:
                logger.warning("autoscaler: stored overrides ignored (unreadable)")
        self.paused = bool(self.store.kv_get(PAUSED_KEY, False))

    def check_windows(self, cfgs: list[ScheduleWindowConfig]) -> list[Window]:
        """The windows parsed and checked as the configuration loader checks them (bad cron or time zone,
        overlaps, bounds outside min/max); ``ValueError`` names the window and the field."""
        windows = parse_windows(cfgs, now=datetime.fromtimestamp(self.wall(), UTC))
        problems = window_problems(dataclasses.replace(self.config, windows=list(cfgs)))
        if problems:
            raise ValueError(problems[0][1])
        return windows

    def set_windows(self, cfgs: list[ScheduleWindowConfig]) -> list[Window]:
        """Replace every cron window (kept in the store across restarts, over the config's); the loop uses
        them from its next tick. ``ValueError`` as :meth:`check_windows`."""
        windows = self.check_windows(cfgs)
        self.store.kv_put(WINDOWS_KEY, [dataclasses.asdict(c) for c in cfgs])
        self.window_configs, self.windows_source, self.windows = list(cfgs), "api", windows
        return windows

    def _restore_windows(self) -> None:
        stored = self.store.kv_get(WINDOWS_KEY)
        if stored is None:
            return
        try:
            cfgs = [ScheduleWindowConfig(**raw) for raw in stored]
            self.windows = self.check_windows(cfgs)
        except (TypeError, ValueError) as exc:  # e.g. a time zone this host lacks: the config's stand
            logger.warning("autoscaler: stored windows ignored, the config's used: %s", exc)
            return
        self.window_configs, self.windows_source = cfgs, "api"
        logger.info("autoscaler: %d schedule window(s) restored from the store", len(cfgs))

    def _restore_history(self) -> None:
        """Recommendations of the stabilization window survive a restart (stored wall time -> loop clock)."""
        now, wall = self.clock(), self.wall()
        since = wall - self.config.scale_down_stabilization_s
        for rec in reversed(self.store.records(COLLECTION, since=since, limit=5000)):
            at = rec.body.get("at", rec.ts)
            replicas = int(rec.body["recommendation"])
            self.state.history.items.append(Recommendation(now - (wall - at), replicas))
        latest = self.store.records(COLLECTION, limit=1)
        self.last = dict(latest[0].body, id=latest[0].id) if latest else None

    # ---- the loop ------------------------------------------------------------------------------
    async def tick(self) -> dict[str, Any] | None:
        """One pass: observe, decide, apply once, record. None while paused."""
        if self.paused:
            return None
        self.ticks += 1
        cfg, windows, current = self.config, self.windows, self.fleet.desired_total
        endpoints = self.fleet.endpoints()
        window_s = cfg.metrics_window_s or None
        obs = await asyncio.to_thread(observe_telemetry, self.telemetry, endpoints, now=self.clock(),
                                      wall=self.wall(), current=current, window_s=window_s,
                                      profile=self.profile, panic_window_s=cfg.panic_window_s)
        plan = await asyncio.to_thread(decide, obs, self.state, cfg, windows)
        body = self._apply(obs, plan, cfg)
        rec = await asyncio.to_thread(self.store.add_record, COLLECTION, body, "", obs.wall)
        if self.ticks % TRIM_EVERY_TICKS == 0:
            await asyncio.to_thread(self.store.trim_records, COLLECTION, cfg.decisions_keep)
        self.last = dict(body, id=rec.id)
        return self.last

    def _apply(self, obs: Observation, plan: Plan, cfg: AutoscalerConfig) -> dict[str, Any]:
        mode = "observe_only" if cfg.observe_only else "active"
        change = f"{obs.current} -> {plan.replicas}"
        if plan.replicas == obs.current:
            return record_body(obs, plan, tick=self.ticks, mode=mode, applied=False, outcome="no change")
        if cfg.observe_only:
            return record_body(obs, plan, tick=self.ticks, mode=mode, applied=False,
                               outcome=f"observe-only: would scale {change}")
        try:
            self.fleet.scale(plan.replicas)
        except Exception as exc:  # recorded, and the next tick tries again
            logger.warning("autoscaler: scaling %s failed: %s", change, exc)
            return record_body(obs, plan, tick=self.ticks, mode=mode, applied=False,
                               outcome=f"scale {change} failed", error=str(exc))
        logger.info("autoscaler: scaled %s (%s)", change,
                    "; ".join(p.reason for p in plan.decision.proposals))
        return record_body(obs, plan, tick=self.ticks, mode=mode, applied=True, outcome=f"scaled {change}")

    async def run(self) -> None:
        while not self._stopping:
            started = self.clock()
            try:
                await self.tick()
            except Exception:  # a failed tick is logged and retried; the loop must not die
                logger.exception("autoscaler tick failed")
            await self.sleep(max(self.config.tick_s - (self.clock() - started), 0.0))

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="autoscaler")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config)
        window = active_window(self.windows, datetime.fromtimestamp(self.wall(), UTC))
        return {"mode": self.mode, "paused": self.paused, "observe_only": self.config.observe_only,
                "ticks": self.ticks, "desired_replicas": self.fleet.desired_total,
                "window": None if window is None else {"name": window.name, "schedule": window.describe},
                "last_decision": self.last, "config": cfg,
                "replica_profile": self.profile.source,  # what converts tokens to engine load
                "enabled": self.config.enabled,  # False: the loop never runs (autoscaler.enabled = false)
                "windows_source": self.windows_source}  # "config", or "api" once set through the API
