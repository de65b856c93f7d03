"""The autoscaler's decision loop on synthetic inputs with a fake clock: no replicas, no sleeps. Its cron
windows and anomaly source have their own test_windows.py and test_anomaly.py; the live behaviour on a
real fleet is in tests/controlplane/up/test_autoscale_live.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.autoscale.config import AutoscalerConfig, ScheduleWindowConfig
from controlplane.autoscale.decide import Observation, Plan, applied, decide, new_state, ours_policy
from controlplane.autoscale.loop import COLLECTION, Autoscaler
from controlplane.autoscale.observe import (
    GENERATION_TOKENS_SQUARED,
    PREFIX_HITS,
    PREFIX_QUERIES,
    PROMPT_TOKENS,
    PROMPT_TOKENS_SQUARED,
    observe_telemetry,
)
from controlplane.autoscale.policies import MetricTarget
from controlplane.autoscale.profile import ReplicaProfile
from controlplane.autoscale.windows import parse_window
from controlplane.config import ConfigError, load_config
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import Store
from controlplane.telemetry.base import (
    GENERATION_TOKENS,
    HTTP_REQUESTS,
    KV_USAGE,
    NUM_RUNNING,
    NUM_WAITING,
    REQUEST_SUCCESS,
    TTFT,
    Group,
    Series,
    Telemetry,
    TelemetryError,
)
from tests.controlplane.conftest import FakeClock

from .test_anomaly import seasonal

MONDAY_NOON_UTC = datetime(2026, 11, 30, 12, 0, tzinfo=UTC).timestamp()  # a Monday


def obs(now: float = 0.0, *, current: int = 2, ready: int | None = None, waiting: float | None = 1.0,
        kv: float | None = 0.1, ttft: float | None = 0.2, tokens: float | None = 10.0,
        load: float | None = 0.3, demand: float | None = None, rate: float | None = 1.0,
        wall: float = MONDAY_NOON_UTC) -> Observation:
    metrics = {"waiting_per_replica": waiting, "kv_cache_usage": kv, "ttft_p95_s": ttft,
               "tokens_per_s_per_replica": tokens, "engine_load_per_replica": load}
    ready = current if ready is None else ready
    return Observation(now, wall + now, current, ready, 0, metrics, demand, rate)


def first(o: Observation, cfg: AutoscalerConfig) -> Plan:
    """The plan of a loop's first tick (no history, no panic, no anomaly model yet)."""
    plan, _ = decide(o, new_state(cfg), cfg, [])
    return plan


def config(**changes: Any) -> AutoscalerConfig:
    """The defaults of our policy (guards, scale-down period, panic without rate limit), round targets.
    Sizing by work is off: these tests drive target tracking, panic mode and the clamps through the metrics
    (tests/controlplane/autoscale/test_work.py drives the work source)."""
    base = {"min_replicas": 1, "max_replicas": 10, "target_waiting_per_replica": 4.0,
            "target_kv_cache_usage": 0.8, "ttft_slo_s": 1.0, "target_tokens_per_s_per_replica": 100.0,
            "target_engine_load_per_replica": 1.0, "anomaly_enabled": False,
            "scale_down_stabilization_s": 60.0, "work_sizing": False}
    return AutoscalerConfig(**{**base, **changes})


# A replica whose costs are powers of two, so that loads come out exact: a prefill token costs 2^-10 engine
# seconds and a generated token 2^-9 (a 2^-5 s step over the reference batch of 16).
PROFILE = ReplicaProfile(step_base_s=2.0**-5, per_seq_s=0.0, per_prefill_token_s=2.0**-10,
                         per_context_token_s=0.0, start_s=1.0)


@pytest.fixture
def profile_file(tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE.to_json()))
    return str(path)


# ---- our policy: one definition for the live loop and the simulator --------------------------------
def test_our_policy_sizes_by_work_and_guards_ttft_the_queue_and_the_reference_loads_by_default() -> None:
    defaults = AutoscalerConfig()
    assert defaults.work_sizing
    policy = ours_policy(defaults)
    assert {t.name: (t.target, t.guard) for t in policy.targets} == {
        "waiting_per_replica": (4.0, True), "kv_cache_usage": (0.8, False), "ttft_p95_s": (1.0, True),
        "tokens_per_s_per_replica": (400.0, True), "engine_load_per_replica": (0.7, True)}
    # without sizing by work, the engine load and the generated tokens size the fleet
    by_load = ours_policy(AutoscalerConfig(work_sizing=False))
    assert {t.name for t in by_load.targets if not t.guard} == {"kv_cache_usage", "tokens_per_s_per_replica",
                                                                "engine_load_per_replica"}
    assert policy.scale_down_period_s == 60.0 and policy.panic_skips_rate_limit
    plain = ours_policy(AutoscalerConfig(guards=[], scale_down_period_s=0, panic_skips_rate_limit=False,
                                         work_sizing=False))
    assert not any(t.guard for t in plain.targets) and plain.scale_down_period_s == 0
    assert MetricTarget("ttft_p95_s", 1.0) in plain.targets


# ---- decide: sources, merge, clamps ---------------------------------------------------------------
def test_target_tracking_takes_the_metric_furthest_over_its_target_and_says_so() -> None:
    cfg = config()
    plan = first(obs(current=2, waiting=2.0, ttft=2.5, tokens=150.0, load=2.5), cfg)
    target = plan.decision.proposals[0]
    assert (target.source, target.replicas) == ("target", 5)  # ceil(2 x 2.5)
    assert target.reason == "engine_load_per_replica at 2.50x target: ceil(2 x 2.50) = 5"
    assert plan.replicas == 5 and plan.clamps == ()


def test_guards_hold_scale_down_but_do_not_size_the_fleet() -> None:
    cfg = config(scale_down_stabilization_s=0)
    slow = first(obs(current=2, waiting=8.0, ttft=2.5, load=0.3), cfg)
    assert slow.replicas == 2  # TTFT at 2.5x and the queue at 2x do not multiply the fleet
    assert slow.decision.proposals[0].reason == ("waiting_per_replica at 2.00x target, ttft_p95_s at 2.50x "
                                                 "target: no scale-down")
    calm = first(obs(current=2, waiting=1.0, ttft=0.2, load=0.3), cfg)
    assert calm.replicas == 1  # ceil(2 x 0.3): the guards are under their targets


def test_merge_takes_the_largest_proposal_then_rate_limit_and_max_bound_it() -> None:
    cfg = config(max_replicas=6, scale_up_max_step=2, scale_up_max_percent=0, panic_skips_rate_limit=False)
    # panic: offered engine load 9 over the panic window > 2 x (2 ready x 1.0 per replica)
    plan = first(obs(current=2, load=2.0, demand=9.0), cfg)
    assert [(p.source, p.replicas) for p in plan.decision.proposals] == [("target", 4), ("panic", 9)]
    assert plan.decision.panic
    assert plan.decision.proposals[1].reason == "demand 9 vs ready capacity 2: panic for 6s more, 9 replicas"
    assert plan.clamps == ("min/max: 9 -> 6 (bounds 1..6)", "rate limit: 6 -> 4")
    assert plan.replicas == 4
    kpa = config(max_replicas=6, scale_up_max_step=2, scale_up_max_percent=0)  # the default: KPA's panic
    plan = first(obs(current=2, load=2.0, demand=9.0), kpa)
    assert plan.clamps == ("min/max: 9 -> 6 (bounds 1..6)", "panic: no rate limit on scale-up (2 -> 6)")
    assert plan.replicas == 6


def test_scale_down_goes_one_step_per_period_after_the_window() -> None:
    cfg = config(scale_down_stabilization_s=0, scale_down_period_s=60.0)
    state, current, moves = new_state(cfg), 5, []
    for t in range(0, 190, 5):
        o = obs(t, current=current, load=0.1)
        plan, state = decide(o, state, cfg, [])
        if plan.replicas != current:
            moves.append((t, current, plan.replicas))
            state = applied(state, o, plan)
        current = plan.replicas
    assert moves == [(0, 5, 4), (60, 4, 3), (120, 3, 2), (180, 2, 1)]
    held, _ = decide(obs(185, current=3, load=0.1), state, cfg, [])
    assert held.clamps[-1] == "scale-down period: 2 -> 3 (last scale-down 5s ago, one per 60s)"


def test_a_scale_down_starts_the_scale_down_period_only_once_it_was_applied() -> None:
    cfg = config(scale_down_stabilization_s=0, scale_down_period_s=60.0)
    o = obs(0, current=5, load=0.1)
    plan, state = decide(o, new_state(cfg), cfg, [])
    assert plan.replicas == 4 and state.panic.last_scale_down is None
    again, _ = decide(obs(5, current=5, load=0.1), state, cfg, [])  # not applied: proposed again
    assert again.replicas == 4
    held, _ = decide(obs(5, current=4, load=0.1), applied(state, o, plan), cfg, [])
    assert held.replicas == 4 and held.clamps[-1].startswith("scale-down period: 3 -> 4")


def test_decide_leaves_the_state_it_was_given_as_it_was() -> None:
    cfg = config(anomaly_enabled=True, anomaly_period=12, anomaly_history=48)
    state = new_state(cfg)
    first_plan, after = decide(obs(0, current=2, load=2.0, demand=9.0), state, cfg, [])
    second_plan, again = decide(obs(0, current=2, load=2.0, demand=9.0), state, cfg, [])
    assert first_plan == second_plan and after == again and after != state
    assert state == new_state(cfg)  # no recommendation, panic or anomaly point was written into it
    assert after.panic.until == 6.0 and [r.replicas for r in after.history.items] == [9]


def test_scale_down_waits_out_the_stabilization_window_on_the_loop_clock() -> None:
    cfg = config(scale_down_stabilization_s=60.0, scale_down_max_step=5)
    state = new_state(cfg)
    busy, state = decide(obs(0, current=4, waiting=4.0, load=1.0), state, cfg, [])
    assert busy.replicas == 4
    quiet = []
    for t in range(5, 70, 5):
        plan, state = decide(obs(t, current=4, waiting=0.4, ttft=0.1, tokens=1.0, kv=0.05, load=0.1), state,
                             cfg, [])
        quiet.append(plan)
    held = [p for t, p in zip(range(5, 70, 5), quiet, strict=True) if t <= 60]
    assert all(p.replicas == 4 for p in held)
    assert all(any(c.startswith("stabilization: 1 -> 4") for c in p.clamps) for p in held)
    assert quiet[-1].replicas == 1  # t=65: the busy recommendation at t=0 has left the 60 s window


def test_unknown_metric_holds_scale_down_and_the_record_says_which() -> None:
    cfg = config(scale_down_stabilization_s=0)
    plan = first(obs(current=3, waiting=0.1, ttft=None, tokens=1.0, kv=0.01), cfg)
    assert plan.replicas == 3
    assert plan.decision.proposals[0].reason == "ttft_p95_s unknown: no scale-down"


def test_window_bounds_are_applied_last_and_named_in_the_clamps() -> None:
    cfg = config(scale_down_stabilization_s=300)
    day = parse_window(ScheduleWindowConfig(name="day", cron="0 8 * * 1-5", duration_s=10 * 3600,
                                            timezone="Europe/Berlin", min_replicas=6))
    night = parse_window(ScheduleWindowConfig(name="night", cron="0 20 * * *", end_cron="0 6 * * *",
                                              timezone="Europe/Berlin", max_replicas=2))
    state = new_state(cfg)
    noon, state = decide(obs(0, current=3), state, cfg, [day, night])  # Monday 13:00 in Berlin: day window
    assert noon.window is day and noon.replicas == 6 and noon.bounds == (6, 10)
    assert noon.clamps[-1] == "schedule window 'day': 2 -> 6 (bounds 6..10)"
    # 21:00 UTC is 22:00 in Berlin: the night window caps the fleet at once, stabilization or not.
    late, state = decide(obs(9 * 3600, current=6, waiting=4.0, load=1.0), state, cfg, [day, night])
    assert late.window is night and late.replicas == 2
    assert late.clamps[-1] == "schedule window 'night': 6 -> 2 (bounds 1..2)"


def test_anomaly_proposal_joins_the_merge_with_its_reason() -> None:
    cfg = config(anomaly_enabled=True, anomaly_period=12, anomaly_history=48)
    state = new_state(cfg)
    plans, rng = [], np.random.default_rng(7)
    points = [seasonal(t, rng) for t in range(74)]
    points[70:] = [(r + 60, q) for r, q in points[70:]]  # demand only: no latency metric over target
    for t, (rate, ttft) in enumerate(points):
        plan, state = decide(obs(t * 5.0, current=2, rate=rate, ttft=ttft), state, cfg, [])
        plans.append(plan)
    fired = [p for p in plans if any(q.source == "anomaly" for q in p.decision.proposals)]
    assert fired, [p.anomaly for p in plans[48:]]
    first = next(q for q in fired[0].decision.proposals if q.source == "anomaly")
    assert first.replicas == 3 and first.reason.startswith("3 anomalous points in a row")
    assert fired[0].replicas == 3 and fired[0].anomaly is not None and fired[0].anomaly.score is not None


# ---- observe: telemetry to an observation -------------------------------------------------------
class FixedTelemetry(Telemetry):
    """Answers preset values. A fake: these unit tests need exact metric values on demand, which no real
    replica produces; the live test reads real replicas through the real sources."""

    name, window_s = "fixed", 30.0

    def __init__(self, gauges: Mapping[str, dict[Group, float]] | None = None,
                 rates: Mapping[str, dict[Group, float]] | None = None,
                 quantiles: Mapping[str, dict[Group, float]] | None = None, fail: bool = False,
                 panic_rates: Mapping[str, dict[Group, float]] | None = None) -> None:
        self.gauges, self.quantiles, self.fail = gauges or {}, quantiles or {}, fail
        self.rate_values = rates or {}  # not "rates": that is Telemetry.rates, which reads these
        self.panic_rates = panic_rates or {}  # answers for the panic window (6 s), where given

    def gauge(self, metric: str, **_: Any) -> dict[Group, float]:  # type: ignore[override]
        if self.fail:
            raise TelemetryError("prometheus at 127.0.0.1:9 did not answer")
        return dict(self.gauges.get(metric, {}))

    def rate(self, metric: str, *, window_s: float | None = None,  # type: ignore[override]
             by: tuple[str, ...] = ("replica",), **_: Any) -> dict[Group, float]:
        if window_s == 6.0 and metric in self.panic_rates:
            got = dict(self.panic_rates[metric])
        else:
            got = dict(self.rate_values.get(metric, {}))
        if by == () and got:  # per-replica answers summed, as "sum by ()" does
            return {(): sum(got.values())}
        return got

    def quantile(self, histogram: str, q: float, **_: Any) -> dict[Group, float]:  # type: ignore[override]
        return dict(self.quantiles.get(histogram, {}))

    def range(self, *_: Any, **__: Any) -> list[Series]:  # type: ignore[override]
        return []


def endpoint(rid: str, state: ReplicaState = ReplicaState.READY) -> ReplicaEndpoint:
    return ReplicaEndpoint(rid, "az-a", "127.0.0.1", 1, state, "default")


def busy_telemetry(waiting: float = 6.0) -> FixedTelemetry:
    """4 requests/s arrive; those that finished had 128 prompt and 256 output tokens on average: with
    ``PROFILE`` that is 4 x (128 x 2^-10 + 256 x 2^-9) = 2.5 engine seconds per second, 1.25 per ready
    replica."""
    return FixedTelemetry(
        gauges={NUM_WAITING: {("r1",): waiting, ("r2",): waiting + 2, ("r3",): 50.0},
                NUM_RUNNING: {("r1",): 2.0, ("r2",): 2.0}, KV_USAGE: {("r1",): 0.2, ("r2",): 0.4}},
        rates={GENERATION_TOKENS: {("r1",): 24.0, ("r2",): 40.0}, HTTP_REQUESTS: {(): 4.0},
               REQUEST_SUCCESS: {(): 0.25}, PROMPT_TOKENS: {(): 32.0}},
        quantiles={TTFT: {(): 0.7}})


def observe(telemetry: Telemetry, eps: list[ReplicaEndpoint], current: int) -> Observation:
    return observe_telemetry(telemetry, eps, now=1.0, wall=2.0, current=current, window_s=None,
                             profile=PROFILE, panic_window_s=6.0)


def test_observation_averages_over_ready_replicas_and_sizes_the_offered_engine_load() -> None:
    eps = [endpoint("r1"), endpoint("r2"), endpoint("r3", ReplicaState.STARTING)]
    o = observe(busy_telemetry(), eps, 3)
    assert (o.ready, o.starting, o.current) == (2, 1, 3)
    assert o.metrics == {"waiting_per_replica": 7.0, "kv_cache_usage": pytest.approx(0.3),
                         "ttft_p95_s": 0.7, "tokens_per_s_per_replica": 32.0, "engine_load_per_replica": 1.25}
    assert (o.mean_prompt_tokens, o.mean_output_tokens) == (128.0, 256.0)
    assert o.request_rate == 4.0 and o.demand == 2.5 and o.notes == ()
    assert o.prompt_tokens_sd is None  # replicas without the sum of squares: the spread is unknown
    assert o.output_tokens_sd is None


def test_the_spread_of_prompt_and_output_lengths_comes_from_the_rate_of_their_squares() -> None:
    telemetry = busy_telemetry()
    # 0.25 requests/s finished, 32 prompt tokens/s: a mean of 128; squares at 0.25 x (128^2 + 48^2) a second
    squares = 0.25 * (128.0**2 + 48.0**2)
    # 64 generated tokens/s over the fleet: a mean of 256 output tokens, here 100 apart
    outputs = 0.25 * (256.0**2 + 100.0**2)
    telemetry.rate_values = {**telemetry.rate_values, PROMPT_TOKENS_SQUARED: {(): squares},
                             GENERATION_TOKENS_SQUARED: {(): outputs}}
    o = observe(telemetry, [endpoint("r1"), endpoint("r2")], 2)
    assert o.mean_prompt_tokens == 128.0 and o.prompt_tokens_sd == pytest.approx(48.0)
    assert o.mean_output_tokens == 256.0 and o.output_tokens_sd == pytest.approx(100.0)


def test_prompt_tokens_the_prefix_caches_held_are_not_counted_as_prefill_work() -> None:
    telemetry = busy_telemetry()
    # of the prompt tokens the replicas looked up, 75% were in their prefix caches
    telemetry.rate_values = {**telemetry.rate_values, PREFIX_HITS: {(): 24.0}, PREFIX_QUERIES: {(): 32.0}}
    o = observe(telemetry, [endpoint("r1"), endpoint("r2")], 2)
    assert o.prefix_hit_share == 0.75
    # 4 x (128 x 25% x 2^-10 + 256 x 2^-9) = 2.125 engine seconds per second, against 2.5 uncached
    assert o.demand == pytest.approx(2.125) and o.metrics["engine_load_per_replica"] == pytest.approx(1.0625)
    assert observe(busy_telemetry(), [endpoint("r1")], 1).prefix_hit_share is None  # no counter: unknown


def test_the_panic_windows_arrivals_are_counted_over_its_scrapes_span_not_the_whole_window() -> None:
    """Scraped every 2 s, a 6 s window's rate is the increase between samples about 4 s apart: that is
    what was counted. A source that does not say how often it samples leaves the whole window."""
    telemetry = busy_telemetry()
    telemetry.scrape_interval_s = 2.0
    assert observe(telemetry, [endpoint("r1")], 1).panic_counted_s == 4.0
    telemetry.scrape_interval_s = 5.0  # at most two samples in the window: one interval is what they span
    assert observe(telemetry, [endpoint("r1")], 1).panic_counted_s == 5.0
    assert observe(busy_telemetry(), [endpoint("r1")], 1).panic_counted_s is None


def test_panic_demand_is_the_engine_load_of_the_panic_windows_request_rate() -> None:
    telemetry = busy_telemetry()
    telemetry.panic_rates = {HTTP_REQUESTS: {(): 16.0}}  # a step: 4x the metrics window's rate
    o = observe(telemetry, [endpoint("r1"), endpoint("r2")], 2)
    assert o.demand == 10.0 and o.panic_request_rate == 16.0 and o.metrics["engine_load_per_replica"] == 1.25
    cfg = config()
    plan = first(o, cfg)
    panic = next(p for p in plan.decision.proposals if p.source == "panic")
    assert panic.replicas == 10 and panic.reason.startswith("demand 10 vs ready capacity 2: panic")
    assert plan.replicas == 10 and plan.decision.panic  # no rate limit in panic mode (KPA)


def test_requests_that_have_not_finished_leave_the_load_unknown_and_hold_scale_down() -> None:
    arriving = FixedTelemetry(gauges={NUM_WAITING: {("r1",): 0.0}, KV_USAGE: {("r1",): 0.1}},
                              rates={HTTP_REQUESTS: {(): 2.0}, GENERATION_TOKENS: {("r1",): 0.0},
                                     REQUEST_SUCCESS: {(): 0.0}, PROMPT_TOKENS: {(): 0.0}},
                              quantiles={TTFT: {(): 0.1}})
    o = observe(arriving, [endpoint("r1"), endpoint("r2")], 2)
    assert o.metrics["engine_load_per_replica"] is None and o.demand is None
    assert o.notes == ("engine_load_per_replica: no request finished in the window to size the load",)
    cfg = config(scale_down_stabilization_s=0)
    plan = first(o, cfg)
    assert plan.replicas == 2
    assert plan.decision.proposals[0].reason == "engine_load_per_replica unknown: no scale-down"


def test_no_request_in_the_window_reads_as_zero_latency_and_load_with_a_note() -> None:
    idle = FixedTelemetry(gauges={NUM_WAITING: {("r1",): 0.0}, NUM_RUNNING: {("r1",): 0.0}},
                          rates={HTTP_REQUESTS: {(): 0.0}})
    o = observe(idle, [endpoint("r1")], 1)
    assert o.metrics["ttft_p95_s"] == 0.0 and o.metrics["engine_load_per_replica"] == 0.0
    assert o.demand == 0.0
    assert o.notes == ("ttft_p95_s: no request in the window, counted as 0",)


# ---- the loop -----------------------------------------------------------------------------------
class RecordingFleet:
    """The fleet's scaling surface; a fake because these tests check the loop's bookkeeping tick by tick
    (the live test scales a real fleet)."""

    def __init__(self, replicas: int, endpoints: list[ReplicaEndpoint]) -> None:
        self.desired_total, self._endpoints = replicas, endpoints
        self.calls: list[int] = []

    def endpoints(self) -> list[ReplicaEndpoint]:
        return list(self._endpoints)

    def scale(self, replicas: int) -> None:
        self.calls.append(replicas)
        self.desired_total = replicas


@pytest.fixture
def loop_parts(store: Store, clock: FakeClock) -> tuple[RecordingFleet, FixedTelemetry]:
    return RecordingFleet(2, [endpoint("r1"), endpoint("r2")]), busy_telemetry()


def make(store: Store, clock: FakeClock, fleet: RecordingFleet, telemetry: Telemetry,
         **changes: Any) -> Autoscaler:
    """The loop on ``PROFILE``, measured as if by ``python -m controlplane.sim profile``."""
    path = store.path.parent / "profile.json"
    path.write_text(json.dumps(PROFILE.to_json()))
    return Autoscaler(config(replica_profile=str(path), **changes), fleet, telemetry, store, clock=clock,
                      wall=clock)


def test_tick_applies_once_and_records_inputs_proposals_clamps_and_outcome(
        store: Store, clock: FakeClock, loop_parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = loop_parts
    scaler = make(store, clock, fleet, telemetry)
    record = asyncio.run(scaler.tick())
    assert record is not None and fleet.calls == [3]  # engine load 1.25x: ceil(2 x 1.25)
    assert record["outcome"] == "scaled 2 -> 3" and record["applied"] and record["final"] == 3
    inputs = record["inputs"]
    assert inputs["metrics"]["waiting_per_replica"] == 7.0  # a guard: 1.75x its target sizes nothing
    assert inputs["metrics"]["engine_load_per_replica"] == 1.25
    # the load's inputs are in the record: 4 requests/s x (128 prompt, 256 output tokens) through the profile
    assert (inputs["request_rate"], inputs["mean_prompt_tokens"], inputs["mean_output_tokens"]) == (
        4, 128, 256)
    assert record["proposals"][0] == {"source": "target", "replicas": 3,
                                      "reason": "engine_load_per_replica at 1.25x target: ceil(2 x 1.25) = 3"}
    stored = store.records(COLLECTION)
    assert len(stored) == 1 and stored[0].body["final"] == 3 and stored[0].ts == clock.now


def test_requests_the_gateways_refuse_for_want_of_capacity_count_as_load_and_scale_up(
        store: Store, clock: FakeClock) -> None:
    """Two replicas at the gateways' in-flight limit: what reaches them (3 requests/s, engine load 0.94x
    per replica) sizes no change, while the gateways refuse as many requests again. Counted as offered
    load, the same tick sizes four replicas, and the record says why."""
    telemetry = busy_telemetry()
    telemetry.rate_values = {**telemetry.rate_values, HTTP_REQUESTS: {(): 3.0}}
    unaware = RecordingFleet(2, [endpoint("r1"), endpoint("r2")])
    record = asyncio.run(make(store, clock, unaware, telemetry).tick())
    assert record is not None and unaware.calls == [] and record["inputs"]["refused_rate"] is None

    asked: list[float] = []

    def refused(window_s: float) -> float:
        asked.append(window_s)
        return 3.0

    fleet = RecordingFleet(2, [endpoint("r1"), endpoint("r2")])
    scaler = make(store, clock, fleet, telemetry)
    scaler.refused = refused
    record = asyncio.run(scaler.tick())
    assert record is not None and fleet.calls == [4], record["proposals"]
    inputs = record["inputs"]
    assert (inputs["request_rate"], inputs["refused_rate"]) == (6.0, 3.0)
    assert inputs["metrics"]["engine_load_per_replica"] == 1.875
    assert "3 requests/s refused by the gateways for want of capacity: counted in the request rate" in (
        inputs["notes"])
    assert asked == [30.0, 6.0]  # the metrics window (the telemetry's own) and the panic window


def test_observe_only_records_what_it_would_do_and_never_scales(
        store: Store, clock: FakeClock, loop_parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = loop_parts
    scaler = make(store, clock, fleet, telemetry, observe_only=True)
    record = asyncio.run(scaler.tick())
    assert record is not None and fleet.calls == [] and fleet.desired_total == 2
    assert record["mode"] == "observe_only" and not record["applied"]
    assert record["outcome"] == "observe-only: would scale 2 -> 3"


def quiet_telemetry() -> FixedTelemetry:
    """Three idle replicas: no request, empty queues and KV caches."""
    idle = {("r1",): 0.0, ("r2",): 0.0, ("r3",): 0.0}
    return FixedTelemetry(gauges={NUM_WAITING: idle, KV_USAGE: idle},
                          rates={GENERATION_TOKENS: idle, HTTP_REQUESTS: {(): 0.0}})


class FailingFleet(RecordingFleet):
    def scale(self, replicas: int) -> None:
        self.calls.append(replicas)
        raise RuntimeError("fleet store is read-only")


@pytest.mark.parametrize("mode", ["observe_only", "scale_fails"])
def test_a_scale_that_did_not_happen_is_not_recorded_as_applied_and_holds_nothing_back(
        store: Store, clock: FakeClock, mode: str) -> None:
    """Neither observe-only nor a failed scale call counts as a scale-down: the next tick proposes (and
    tries) the same step again instead of waiting out a scale-down period that never started."""
    eps = [endpoint("r1"), endpoint("r2"), endpoint("r3")]
    fleet = RecordingFleet(3, eps) if mode == "observe_only" else FailingFleet(3, eps)
    scaler = make(store, clock, fleet, quiet_telemetry(), observe_only=mode == "observe_only",
                  scale_down_stabilization_s=0, scale_down_period_s=60.0)
    records = []
    for _ in range(2):
        record = asyncio.run(scaler.tick())
        assert record is not None
        records.append(record)
        clock.now += 5
    assert [r["applied"] for r in records] == [False, False] and fleet.desired_total == 3
    assert [r["final"] for r in records] == [2, 2]
    if mode == "observe_only":
        assert [r["outcome"] for r in records] == ["observe-only: would scale 3 -> 2"] * 2
        assert fleet.calls == []
    else:
        assert [r["outcome"] for r in records] == ["scale 3 -> 2 failed"] * 2
        assert fleet.calls == [2, 2] and records[0]["error"] == "fleet store is read-only"
    assert scaler.state.panic.last_scale_down is None


def test_paused_loop_neither_decides_nor_records_until_resumed(
        store: Store, clock: FakeClock, loop_parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = loop_parts
    scaler = make(store, clock, fleet, telemetry)
    scaler.pause()
    assert asyncio.run(scaler.tick()) is None and store.records(COLLECTION, limit=5) == []
    again = make(store, clock, fleet, telemetry)  # paused survives a restart
    assert again.mode == "paused"
    again.resume()
    assert asyncio.run(again.tick()) is not None and fleet.calls == [3]


def test_telemetry_outage_holds_the_count_and_says_why(store: Store, clock: FakeClock) -> None:
    fleet = RecordingFleet(3, [endpoint("r1")])
    record = asyncio.run(make(store, clock, fleet, FixedTelemetry(fail=True)).tick())
    assert record is not None and record["final"] == 3 and fleet.calls == []
    assert record["inputs"]["notes"] == ["telemetry unavailable: prometheus at 127.0.0.1:9 did not answer"]
    assert "no metric known" in record["proposals"][0]["reason"]


def test_stabilization_survives_a_restart_of_the_loop(store: Store, clock: FakeClock) -> None:
    fleet = RecordingFleet(2, [endpoint("r1"), endpoint("r2")])
    asyncio.run(make(store, clock, fleet, busy_telemetry()).tick())  # recommends 3
    assert fleet.desired_total == 3
    clock.now += 30
    quiet = FixedTelemetry(gauges={NUM_WAITING: {("r1",): 0.0, ("r2",): 0.0},
                                   NUM_RUNNING: {("r1",): 0.0, ("r2",): 0.0}, KV_USAGE: {("r1",): 0.0,
                                                                                        ("r2",): 0.0}},
                           rates={GENERATION_TOKENS: {("r1",): 0.0, ("r2",): 0.0}, HTTP_REQUESTS: {(): 0.0}})
    restarted = make(store, clock, fleet, quiet)
    held = asyncio.run(restarted.tick())
    assert held is not None and held["final"] == 3 and any("stabilization" in c for c in held["clamps"])
    clock.now += 31  # the recommendation of 3 is now 61 s old: outside the 60 s window
    down = asyncio.run(restarted.tick())
    assert down is not None and down["final"] == 2 and down["outcome"] == "scaled 3 -> 2"


def test_decision_records_stay_bounded(store: Store, clock: FakeClock,
                                       loop_parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = loop_parts
    scaler = make(store, clock, fleet, telemetry, decisions_keep=100)
    for _ in range(200):
        clock.now += 1
        asyncio.run(scaler.tick())
    assert len(store.records(COLLECTION, limit=1000)) == 100
    assert store.records(COLLECTION, limit=1)[0].body["tick"] == 200


def test_run_ticks_on_the_injected_sleep(store: Store, clock: FakeClock,
                                         loop_parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = loop_parts
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds
        if len(slept) == 3:
            scaler._stopping = True

    scaler = Autoscaler(config(tick_s=5.0), fleet, telemetry, store, clock=clock, wall=clock, sleep=sleep)
    asyncio.run(scaler.run())
    assert slept == [5.0, 5.0, 5.0] and scaler.ticks == 3


def test_runtime_update_is_validated_and_kept_across_restarts(
        store: Store, clock: FakeClock, loop_parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = loop_parts
    scaler = make(store, clock, fleet, telemetry)
    with pytest.raises(ValueError, match=r"^min_replicas: need 0 <= min_replicas <= max_replicas"):
        scaler.update({"min_replicas": 20})
    with pytest.raises(ValueError, match=r"^tick_s: cannot be changed at run time"):
        scaler.update({"tick_s": 1.0})
    scaler.update({"max_replicas": 3, "observe_only": True})
    again = make(store, clock, fleet, telemetry)
    assert again.config.max_replicas == 3 and again.mode == "observe_only"


# ---- REST API -----------------------------------------------------------------------------------
@pytest.fixture
def api(store: Store, clock: FakeClock,
        loop_parts: tuple[RecordingFleet, FixedTelemetry]) -> Iterator[tuple[TestClient, Autoscaler, Any]]:
    fleet, telemetry = loop_parts
    tokens = TokenAuthority(store)
    scaler = make(store, clock, fleet, telemetry)
    services = Services(fleet, store, tokens, Auditor(store), autoscaler=scaler)  # type: ignore[arg-type]
    heads = {role.value: {"Authorization": f"Bearer {tokens.issue(role.value, role)}"} for role in Role}
    with TestClient(create_api(services)) as client:
        yield client, scaler, heads  # type: ignore[misc]


def test_api_status_and_decisions_for_a_viewer(api: Any) -> None:
    client, scaler, heads = api
    asyncio.run(scaler.tick())
    status = client.get("/api/v1/autoscaler/status", headers=heads["viewer"]).json()
    assert status["mode"] == "active" and status["last_decision"]["final"] == 3
    assert status["config"]["target_waiting_per_replica"] == 4.0
    assert status["replica_profile"] == "hand-written"  # the test's PROFILE, from replica_profile
    got = client.get("/api/v1/autoscaler/decisions", params={"limit": 5}, headers=heads["viewer"]).json()
    assert [d["outcome"] for d in got] == ["scaled 2 -> 3"]
    assert client.get("/api/v1/autoscaler/status").status_code == 401


def test_api_config_change_needs_an_operator_is_audited_and_bad_values_get_the_openai_error(
        api: Any, store: Store) -> None:
    client, scaler, heads = api
    body = {"observe_only": True, "targets": {"ttft_p95_s": 2.5}}
    assert client.put("/api/v1/autoscaler/config", json=body, headers=heads["viewer"]).status_code == 403
    ok = client.put("/api/v1/autoscaler/config", json=body, headers=heads["operator"])
    assert ok.status_code == 200 and ok.json()["mode"] == "observe_only" and scaler.config.ttft_slo_s == 2.5
    bad = client.put("/api/v1/autoscaler/config", json={"min_replicas": 50}, headers=heads["operator"])
    assert bad.status_code == 400
    assert bad.json() == {"error": {"message": "min_replicas: need 0 <= min_replicas <= max_replicas, got "
                                               "50/10", "type": "invalid_request_error",
                                    "param": "min_replicas", "code": None}}
    unknown = client.put("/api/v1/autoscaler/config", json={"tick_s": 1}, headers=heads["operator"])
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tick_s"
    audit = [(a.action, a.outcome) for a in store.audit(limit=10)]
    assert ("autoscaler.config", "ok") in audit and ("autoscaler.config", "error") in audit


def test_api_pause_and_resume(api: Any, store: Store) -> None:
    client, scaler, heads = api
    assert client.post("/api/v1/autoscaler/pause", headers=heads["operator"]).json() == {"mode": "paused"}
    assert scaler.paused
    assert client.post("/api/v1/autoscaler/resume", headers=heads["operator"]).json() == {"mode": "active"}
    assert [a.action for a in store.audit(limit=2)] == ["autoscaler.resume", "autoscaler.pause"]


def test_our_policys_knobs_load_from_toml_and_bad_ones_fail_with_file_key_and_reason(
        tmp_path: Path, profile_file: str) -> None:
    good = tmp_path / "good.toml"
    good.write_text(f'[autoscaler]\ntarget_engine_load_per_replica = 0.5\nguards = ["ttft_p95_s"]\n'
                    f'scale_down_period_s = 30\nreplica_profile = "{profile_file}"\n')
    cfg = load_config(good).autoscaler
    assert (cfg.target_engine_load_per_replica, cfg.scale_down_period_s) == (0.5, 30)
    assert cfg.guards == ["ttft_p95_s"] and cfg.replica_profile == profile_file
    cases = {
        'guards = ["p99"]': "autoscaler.guards: unknown metric 'p99' (known: waiting_per_replica,",
        'guards = ["waiting_per_replica", "kv_cache_usage", "ttft_p95_s", "tokens_per_s_per_replica", '
        '"engine_load_per_replica"]': "autoscaler.guards: at least one metric must size the fleet",
        "scale_down_period_s = -1": "autoscaler.scale_down_period_s: must be >= 0",
        "target_engine_load_per_replica = 0": "autoscaler.target_engine_load_per_replica: must be > 0",
        f'replica_profile = "{tmp_path / "missing.json"}"': "autoscaler.replica_profile: cannot be read: ",
        f'replica_profile = "{good}"': "autoscaler.replica_profile: cannot be read: ",
    }
    for i, (line, expected) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.toml"
        path.write_text(f"[autoscaler]\n{line}\n")
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert str(err.value).startswith(f"{path}: {expected}"), str(err.value)


