"""The fleet simulator: the discrete-event core on hand-computable cases, the policies, the CLI and REST.

Replicas here are simulated on purpose (that is the feature); the profile calibration test runs one real
replica. No test asserts on wall-clock time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import httpx
import psutil
import pytest

from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.autoscale.policies import (
    MetricTarget,
    PanicState,
    PolicyConfig,
    Snapshot,
    applied,
    decide,
    target_tracking,
)
from controlplane.autoscale.profile import ReplicaProfile, load_profile
from controlplane.config import load_config
from controlplane.fleet.reconcile import Fleet
from controlplane.sim.batch import BATCH_NICE, close_idle_workers
from controlplane.sim.fleet import FleetSim, ScaleEvent
from controlplane.sim.replica import RequestOutcome
from controlplane.sim.settings import PolicySpec, SimSettings
from controlplane.sim.simulator import count_reversals, figure, format_table, simulate, worst_window
from controlplane.sim.trace import (
    BurstyConfig,
    SimRequest,
    TraceShape,
    azure_trace,
    shaped,
    synthetic_bursty,
)
from controlplane.sim.what_if import WORKER
from controlplane.store.database import Store
from inference.bench.datasets import read_trace, shipped_trace
from tests.controlplane.conftest import FakeClock
from tests.controlplane.fleet.test_reconcile import SimBackend
from tests.polling import wait_until

STEP = 0.01


def fixed(step: float = STEP, **limits: Any) -> ReplicaProfile:
    """A replica whose every step takes ``step`` seconds, whatever it holds."""
    return ReplicaProfile(
        step_base_s=step,
        per_seq_s=0.0,
        per_prefill_token_s=0.0,
        per_context_token_s=0.0,
        start_s=limits.pop("start_s", 5.0),
        **limits,
    )


def run(profile: ReplicaProfile, requests: list[SimRequest], **kwargs: Any) -> FleetSim:
    kwargs.setdefault("initial_replicas", 1)
    return FleetSim(profile, requests, policy=None, tick_s=15.0, **kwargs).run()


def req(i: int, arrival: float, prompt: int = 100, output: int = 5) -> SimRequest:
    return SimRequest(i, arrival, prompt, output)


# ---- the discrete-event core --------------------------------------------------------------------
def test_one_request_on_one_replica_gets_one_step_to_first_token_and_one_step_per_token() -> None:
    sim = run(fixed(), [req(0, 0.0, prompt=100, output=5)])
    out = sim.outcomes[0]
    assert out.ttft == pytest.approx(STEP)  # prefill fits the token budget: one step
    assert out.tpot == pytest.approx(STEP)
    assert out.finish == pytest.approx(5 * STEP)


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks() -> None:
    sim = run(fixed(max_num_batched_tokens=512), [req(0, 0.0, prompt=1200, output=2)])
    assert sim.outcomes[0].ttft == pytest.approx(3 * STEP)  # 512 + 512 + 176 tokens
    assert sim.outcomes[0].finish == pytest.approx(4 * STEP)


def test_requests_queue_when_max_num_seqs_is_reached() -> None:
    sim = run(fixed(max_num_seqs=1), [req(0, 0.0, output=3), req(1, 0.0, output=3)])
    first, second = sim.outcomes
    assert first.ttft == pytest.approx(STEP) and first.finish == pytest.approx(3 * STEP)
    assert second.ttft == pytest.approx(4 * STEP)  # waits for the first to finish, then one prefill step
    assert second.finish == pytest.approx(6 * STEP)


def test_continuous_batching_serves_concurrent_requests_in_the_same_steps() -> None:
    sim = run(fixed(max_num_seqs=8), [req(i, 0.0, prompt=100, output=10) for i in range(4)])
    # four 100-token prompts fit one step's budget: all four get their first token after one step
    assert [o.ttft for o in sim.outcomes] == pytest.approx([STEP] * 4)
    assert [o.finish for o in sim.outcomes] == pytest.approx([10 * STEP] * 4)


def test_a_request_arriving_mid_decode_joins_at_the_next_step() -> None:
    sim = run(fixed(max_num_seqs=8), [req(0, 0.0, output=100), req(1, 0.255, output=2)])
    assert sim.outcomes[1].first_token == pytest.approx(0.27)  # the step in progress ends at 0.26
    # the step holding the new prompt also decodes the running request: it still gets a token per step
    assert sim.outcomes[0].finish == pytest.approx(100 * STEP)


def test_a_replica_gets_no_request_before_it_has_started() -> None:
    sim = run(fixed(start_s=5.0), [req(0, 1.0)], initial_ready=False)
    assert sim.outcomes[0].first_token == pytest.approx(5.0 + STEP)
    assert sim.outcomes[0].ttft == pytest.approx(4.0 + STEP)


def test_a_crashed_replica_is_replaced_and_its_requests_resume_elsewhere() -> None:
    requests = [req(i, 0.0, output=400) for i in range(4)]
    sim = run(fixed(start_s=2.0), requests, initial_replicas=2, crashes=(1.0,))
    assert all(o.finish is not None for o in sim.outcomes)
    assert sum(o.retries for o in sim.outcomes) == 2  # the two on the busiest replica
    assert len(sim.replicas) == 3 and sim.replicas[2].started_at == pytest.approx(1.0)


def test_a_replica_started_beside_a_busy_one_takes_the_profiles_busy_start() -> None:
    """A replacement started while the other replica decodes is ready after the profile's start beside a
    busy replica (measured by ``controlplane calibrate``), not its start alone; a profile without that
    measurement starts it in ``start_s``."""
    # both replicas decode until about 8 s; the last arrival keeps the fleet sampled until 10 s
    requests = [*(req(i, 0.0, output=800) for i in range(4)), req(4, 10.0)]

    def ready_at(profile: ReplicaProfile) -> float:
        sim = run(profile, requests, initial_replicas=2, crashes=(1.0,), sample_s=0.25)
        return min(s.at for s in sim.samples if s.at > 1.0 and s.ready == 2)

    assert ready_at(fixed(start_s=2.0, busy_start_s=3.5)) == pytest.approx(4.5, abs=0.25)
    assert ready_at(fixed(start_s=2.0)) == pytest.approx(3.0, abs=0.25)
    with pytest.raises(ValueError, match="busy_start_s"):
        fixed(busy_start_s=-1.0)


def test_static_n_replicas_cost_n_times_the_duration() -> None:
    requests = [req(i, i * 2.0) for i in range(50)]
    report = simulate(requests, PolicySpec.parse("static:3"), profile=fixed())
    assert report.replica_seconds == pytest.approx(3 * 98.0)
    assert report.scale_events == 0 and report.slo_attainment == 1.0


def shared(i: int, arrival: float, prefix_id: int, prompt: int = 1200, output: int = 2) -> SimRequest:
    return SimRequest(i, arrival, prompt, output, prefix_id=prefix_id, prefix_len=1100)


def test_a_replica_skips_the_whole_blocks_of_a_shared_prefix_it_has_prefilled() -> None:
    requests = [shared(0, 0.0, 1), shared(1, 1.0, 1, prompt=1250), shared(2, 2.0, 2)]
    sim = run(fixed(max_num_batched_tokens=512), requests)
    first, again, other = sim.outcomes
    assert first.ttft == pytest.approx(3 * STEP)  # 512 + 512 + 176 tokens
    assert again.ttft == pytest.approx(STEP)  # 1,088 cached (68 whole blocks of 1,100): 162 left, one step
    assert other.ttft == pytest.approx(3 * STEP)  # another prefix: nothing cached
    assert sim.observe().prefix_hit_share == pytest.approx(1088 / (1200 + 1250 + 1200))


def test_a_cached_prefix_is_evicted_when_running_sequences_need_its_space() -> None:
    # prefix 1 cached (1,088 tokens), then a request of prefix 2 reserves 1,200 + 1,000 of 3,000 tokens
    requests = [shared(0, 0.0, 1), shared(1, 1.0, 2, output=1000), shared(2, 30.0, 1)]
    sim = run(fixed(max_num_batched_tokens=512, kv_capacity_tokens=3000), requests)
    assert sim.outcomes[2].ttft == pytest.approx(3 * STEP)  # evicted: prefilled in full again
    assert list(sim.replicas[0].prefix_cache) == [1]  # and prefix 2, least recently used, made room for it
    roomy = run(fixed(max_num_batched_tokens=512), requests)
    assert roomy.outcomes[2].ttft == pytest.approx(STEP)


def test_a_shared_prefix_is_scaled_with_its_prompt_and_checked() -> None:
    shape = TraceShape(token_scale=0.25, max_prompt_len=200)
    a, b = shaped([(0.0, 1200, 40, 3, 1100), (1.0, 400, 40)], shape)
    assert (a.prompt_len, a.prefix_id, a.prefix_len) == (200, 3, 200)  # capped with the prompt
    assert (b.prefix_id, b.prefix_len) == (0, 0)
    with pytest.raises(ValueError, match="shared prefix"):
        SimRequest(0, 0.0, 100, 5, prefix_id=1, prefix_len=101)
    with pytest.raises(ValueError, match="shared prefix"):
        SimRequest(0, 0.0, 100, 5, prefix_id=0, prefix_len=10)


# ---- policies ---------------------------------------------------------------------------------
def busy_then_quiet() -> list[SimRequest]:
    """60 s far over one replica's capacity, then 15 minutes of a trickle."""
    burst = [req(i, i * 0.01, prompt=900, output=20) for i in range(6000)]
    trickle = [req(6000 + i, 60.0 + i * 10.0, prompt=50, output=5) for i in range(90)]
    return burst + trickle


def test_hpa_baseline_scales_down_only_after_its_300s_window() -> None:
    report = simulate(busy_then_quiet(), PolicySpec.parse("hpa"), profile=load_profile())
    events = _events(busy_then_quiet(), "hpa")
    last_up = max(e.at for e in events if e.after > e.before)
    first_down = min(e.at for e in events if e.after < e.before and e.at > last_up)
    assert first_down - last_up >= 300 - 15  # the window, give or take one 15 s sync period
    assert all(round(e.at) % 15 == 0 for e in events)  # it decides on its sync period only
    assert report.scale_events == len(events)


def test_ours_scales_up_within_its_tick_and_down_only_after_the_window() -> None:
    events = _events(busy_then_quiet(), "ours")
    ups = [e for e in events if e.after > e.before]
    assert ups[0].at <= 10.0  # the first 5 s tick or the next one
    downs = [e for e in events if e.after < e.before]
    assert downs and downs[0].at - max(e.at for e in ups) >= 300 - 5


def _events(requests: list[SimRequest], policy: str) -> list[ScaleEvent]:
    from controlplane.sim.policies import make_policy

    profile, settings = load_profile(), SimSettings()
    fn, tick, initial = make_policy(PolicySpec.parse(policy), profile, settings)
    return FleetSim(profile, requests, initial_replicas=initial, policy=fn, tick_s=tick).run().events


def guard_config(**kw: Any) -> PolicyConfig:
    targets = (MetricTarget("load", 1.0), MetricTarget("ttft_p95_s", 1.0, guard=True))
    return PolicyConfig(
        **{"targets": targets, "scale_down_stabilization_s": 0, "scale_down_max_step": 10, **kw}
    )


def snap(now: float, *, load: float, ttft: float | None, current: int = 4) -> Snapshot:
    return Snapshot(now, current, current, 0, {"load": load, "ttft_p95_s": ttft})


def test_a_guard_metric_blocks_scale_down_but_does_not_size_the_fleet() -> None:
    config = guard_config()
    # TTFT at 3x its target does not multiply the fleet (it has a floor the fleet size does not move)
    assert target_tracking(snap(0, load=1.0, ttft=3.0), config).replicas == 4
    assert target_tracking(snap(0, load=2.0, ttft=3.0), config).replicas == 8
    held = target_tracking(snap(0, load=0.5, ttft=1.5), config)
    assert held.replicas == 4 and "ttft_p95_s at 1.50x target: no scale-down" in held.reason
    assert target_tracking(snap(0, load=0.5, ttft=0.5), config).replicas == 2
    assert target_tracking(snap(0, load=0.5, ttft=None), config).replicas == 4  # unknown: no scale-down


def test_scale_down_period_allows_one_scale_down_per_period() -> None:
    config = guard_config(scale_down_period_s=60, scale_down_max_step=1)
    state, current, moves = PanicState(), 6, []
    for now in range(0, 200, 5):
        decision, state = decide(snap(now, load=0.1, ttft=0.1, current=current), config, [], state)
        if decision.replicas != current:
            moves.append((now, decision.replicas))
            state = applied(state, current=current, replicas=decision.replicas, now=now)
        current = decision.replicas
    assert moves == [(0, 5), (60, 4), (120, 3), (180, 2)]
    up, _ = decide(snap(185, load=2.0, ttft=0.1, current=2), config, [], state)
    assert up.replicas == 4  # scaling up is not held by the period


def test_panic_may_skip_the_scale_up_rate_limit() -> None:
    base = PolicyConfig(targets=(MetricTarget("load", 1.0),), scale_up_max_step=1, scale_up_max_percent=10)
    overload = Snapshot(0, 2, 2, 0, {"load": 1.0}, demand=9.0, capacity_per_replica=1.0)
    assert decide(overload, base, [], PanicState())[0].replicas == 3  # panic wants 9, the limit allows +1
    kpa = replace(base, panic_skips_rate_limit=True)
    decision, _ = decide(overload, kpa, [], PanicState())
    assert decision.replicas == 9 and decision.panic
    assert "panic: no rate limit on scale-up (2 -> 9)" in decision.clamps
    steady = Snapshot(0, 2, 2, 0, {"load": 4.0}, demand=3.0, capacity_per_replica=1.0)  # no panic: limited
    assert decide(steady, kpa, [], PanicState())[0].replicas == 3


def sim_observation(**changes: Any) -> Any:
    from controlplane.sim.fleet import Observation

    base = Observation(
        now=60,
        desired=2,
        ready=2,
        starting=0,
        waiting=0,
        running=4,
        kv_cache_usage=0.1,
        ttft_p95_s=0.2,
        tokens_per_s=100.0,
        busy_share=0.5,
        prompt_tokens_per_s=1000.0,
        arrivals_per_s=10.0,
        arrivals_per_s_short=30.0,
        mean_prompt_tokens=100.0,
        mean_output_tokens=10.0,
    )
    return replace(base, **changes)


def test_offered_load_is_linear_in_the_request_rate_and_unknown_until_a_request_finishes() -> None:
    from controlplane.sim.policies import offered_load

    profile = fixed()
    base = sim_observation()
    one = offered_load(base, profile)
    assert one is not None
    assert one == pytest.approx(profile.engine_load(prompt_tokens_per_s=1000.0, generated_tokens_per_s=100.0))
    assert offered_load(base, profile, short=True) == pytest.approx(3 * one)  # the 6 s window saw 3x
    # as in the live loop: requests arrive but none has finished to tell their size
    assert offered_load(replace(base, mean_prompt_tokens=None, mean_output_tokens=None), profile) is None
    assert offered_load(replace(base, arrivals_per_s=0.0), profile) == 0.0


def test_ours_is_the_live_loops_decision_on_the_live_loops_defaults() -> None:
    from controlplane.autoscale.config import AutoscalerConfig
    from controlplane.autoscale.decide import Observation as LiveObservation
    from controlplane.autoscale.decide import decide as live_decide
    from controlplane.autoscale.decide import new_state, ours_policy
    from controlplane.sim.policies import LivePolicy, hpa_config, make_policy, metrics_of, offered_load

    profile, settings = load_profile(), SimSettings()
    policy, tick, _ = make_policy(PolicySpec.parse("ours"), profile, settings)
    assert isinstance(policy, LivePolicy) and tick == 5.0
    defaults = AutoscalerConfig()
    knobs = ("guards", "target_engine_load_per_replica", "scale_down_period_s", "panic_skips_rate_limit",
             "panic_window_s", "panic_threshold", "tolerance", "scale_down_stabilization_s")
    assert {k: getattr(policy.config, k) for k in knobs} == {k: getattr(defaults, k) for k in knobs}
    # a step in the load: what the simulator's "ours" decides is what the live loop's decide says
    step = sim_observation(arrivals_per_s_short=400.0, mean_prompt_tokens=300.0, mean_output_tokens=100.0)
    got, reason = policy(step)
    live, _ = live_decide(
        LiveObservation(60, 60, 2, 2, 0, metrics_of(step, profile), offered_load(step, profile, short=True),
                        10.0),
        new_state(policy.config), policy.config, [])
    assert got == live.replicas > 2 and "panic: demand " in reason
    # the HPA baseline keeps the live loop's four metrics, all sizing, and no panic or scale-down period
    hpa = hpa_config(policy.config, settings)
    assert [(t.name, t.guard) for t in hpa.targets] == [
        (t.name, False) for t in ours_policy(policy.config).targets if t.name != "engine_load_per_replica"]
    assert hpa.scale_down_period_s == 0 and not hpa.panic_skips_rate_limit


def test_reversals_count_opposite_moves_within_the_window() -> None:
    events = [
        ScaleEvent(0, 2, 4, ""),
        ScaleEvent(100, 4, 3, ""),
        ScaleEvent(500, 3, 5, ""),
        ScaleEvent(900, 5, 6, ""),
    ]
    assert count_reversals(events, 300) == 1  # up at 0, down at 100; the up at 500 is 400 s later


def test_the_worst_window_is_the_five_minutes_an_hours_attainment_hides() -> None:
    """Nine hundred requests met in the first two 5-minute windows and half of a hundred in the third:
    95% over the run, 50% in its worst window."""
    def outcome(at: float, ttft: float) -> RequestOutcome:
        return RequestOutcome(arrival=at, prompt_len=10, output_len=2, first_token=at + ttft,
                              finish=at + ttft + 0.05)

    good = [outcome(i * 0.6, 0.2) for i in range(900)]  # 0-540 s
    peak = [outcome(600 + i, 0.2 if i % 2 else 1.5) for i in range(100)]  # 600-699 s, half over 1 s TTFT
    slo = SimSettings().slo
    assert worst_window(good + peak, slo) == 0.5
    assert worst_window(good, slo) == 1.0 and worst_window([], slo) is None


def test_policy_spec_rejects_unknown_policies() -> None:
    assert PolicySpec.parse("static:4").replicas == 4
    for bad in ("static", "static:0", "kpa", "ours:2"):
        with pytest.raises(ValueError, match="policy"):
            PolicySpec.parse(bad)


def test_report_table_and_figure_show_every_policy() -> None:
    requests = synthetic_bursty(BurstyConfig(duration_s=600), TraceShape(compress=4, token_scale=0.25))
    reports = [simulate(requests, PolicySpec.parse(p)) for p in ("ours", "static:2")]
    table = format_table(reports)
    assert "ours" in table and "static:2" in table and "SLO MET" in table
    for r in reports:  # each row: attainment, its worst 5-minute window and the misses of each SLO
        row = next(line.split() for line in table.splitlines() if line.startswith(r.policy + " "))
        assert row[2] == f"{r.slo_attainment * 100:.1f}%"
        assert row[4:6] == [str(r.missed_ttft), str(r.missed_tpot)]
        assert r.worst_window_attainment is not None and row[3] == f"{r.worst_window_attainment * 100:.1f}%"
        assert r.worst_window_attainment <= r.slo_attainment
    fig = figure(reports)
    names = {trace.name for trace in fig.data}
    assert {"load", "ours replicas", "static:2 replicas", "ours P95 TTFT"} <= names


# ---- traces and profile -------------------------------------------------------------------------
def test_azure_replay_compresses_time_and_scales_tokens(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5000000,400,40\n"
        "2023-11-16 18:15:54.5000000,1000,100\n"
    )
    requests = azure_trace(csv, TraceShape(compress=4, token_scale=0.25))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in requests] == [(0.0, 100, 10), (2.0, 250, 25)]


def test_synthetic_bursty_trace_is_seeded_and_bursty() -> None:
    a = synthetic_bursty(BurstyConfig(seed=3))
    assert a == synthetic_bursty(BurstyConfig(seed=3)) and a != synthetic_bursty(BurstyConfig(seed=4))
    per_minute = [0] * 60
    for r in a:
        per_minute[min(int(r.arrival // 60), 59)] += 1
    assert max(per_minute) > 3 * sorted(per_minute)[len(per_minute) // 2]  # bursts well over the median


def test_the_shipped_profile_loads_and_predicts_positive_step_times() -> None:
    profile = load_profile()
    assert profile.start_s > 0 and profile.points
    assert profile.step_time(num_decode=8, num_prefill_tokens=0, context_tokens=4000) > 0
    with pytest.raises(ValueError, match="per_seq_s"):
        ReplicaProfile(0.01, -1.0, 0.0, 0.0, 1.0)


@pytest.mark.timeout(240)
def test_calibrate_measures_a_real_replica_and_prints_its_fit(tmp_path: Path) -> None:
    """``controlplane calibrate --quick``: the table of points, the fit error, a profile file (installed, or
    beside it as .rejected when the held-out error is over the bound on a busy host: both are honest)."""
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "controlplane", "calibrate", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    written = out if done.returncode == 0 else out.with_name(out.name + ".rejected")
    assert written.exists(), f"exit {done.returncode}, no profile written: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    profile = load_profile(written)
    assert profile.start_s > 0 and len(profile.points) == 6 and len(profile.held_out) == 2
    # a second replica started while the first decoded a steady batch: a scale-up's start
    assert profile.busy_start_s is not None and profile.busy_start_s > 0
    starts = f"start {profile.start_s:.2f}s alone, {profile.busy_start_s:.2f}s beside a busy replica"
    assert starts in done.stdout
    prefill_64, prefill_1024 = profile.points[0], profile.points[2]
    assert prefill_1024.seconds > prefill_64.seconds  # a longer prefill takes longer
    assert profile.kv_capacity_tokens > 1000 and profile.max_num_seqs >= 1
    # what it printed is what it wrote: each point measured against the fit, and the errors
    assert profile.fit_error().describe() in done.stdout
    for point in (*profile.points, *profile.held_out):
        assert f"{point.seconds * 1e3:7.1f}ms {profile.predict(point) * 1e3:7.1f}ms" in done.stdout
    assert str(written) in done.stdout


# ---- CLI and REST -------------------------------------------------------------------------------
def test_cli_prints_the_table_for_each_policy() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "controlplane",
            "simulate",
            "--trace",
            "synthetic-bursty",
            "--duration",
            "900",
            "--compress",
            "4",
            "--policy",
            "ours",
            "--compare",
            "hpa",
            "--compare",
            "static:2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("POLICY") and "REPLICA-S" in line for line in lines)
    assert {line.split()[0] for line in lines if line.split()} >= {"ours", "hpa", "static:2"}


def test_cli_refuses_a_bad_policy_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "controlplane", "simulate", "--trace", "synthetic-bursty", "--policy", "kpa"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2  # a usage error: nothing ran
    assert out.stderr.strip().splitlines()[-1].startswith("controlplane: simulate: policy:")


def _post(store: Store, role: str, body: dict[str, Any]) -> httpx.Response:
    fleet = Fleet(load_config().fleet, SimBackend(), store, secret=b"k" * 32)
    tokens = TokenAuthority(store)
    app = create_api(Services(fleet, store, tokens, Auditor(store)))
    name = f"{role}-{secrets.token_hex(4)}"  # token names are unique
    headers = {"Authorization": f"Bearer {tokens.issue(name, Role(role))}"}

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp") as http:
            return await http.post("/api/v1/simulate", json=body, headers=headers, timeout=60)

    return asyncio.run(go())


INLINE = {
    "trace": "inline",
    "compress": 1,
    "token_scale": 1,
    "policies": ["ours", "static:1"],
    "requests": [{"arrival": i * 0.5, "prompt_len": 200, "output_len": 20} for i in range(200)],
}


def test_rest_what_if_returns_the_table_and_timelines_and_is_audited(store: Store, clock: FakeClock) -> None:
    resp = _post(store, "operator", INLINE)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [p["policy"] for p in body["policies"]] == ["ours", "static:1"]
    static = body["policies"][1]
    assert static["num_requests"] == 200 and static["replica_seconds"] == pytest.approx(99.5)
    assert len(static["timeline"]["at"]) == len(static["timeline"]["replicas"]) > 5
    audit = store.audit(limit=10)
    assert audit[0].action == "simulate.run" and audit[0].outcome == "ok"
    assert audit[0].actor.startswith("operator-")


def test_rest_what_if_needs_an_operator_and_valid_input(store: Store, clock: FakeClock) -> None:
    assert _post(store, "viewer", INLINE).status_code == 403
    bad = _post(store, "operator", {**INLINE, "policies": ["kpa"]})
    assert bad.status_code == 400
    assert set(bad.json()["error"]) == {"message", "type", "param", "code"}
    assert "policy" in bad.json()["error"]["message"]
    too_long = _post(store, "operator", {**INLINE, "compress": 0})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "compress"


def test_rest_what_if_replays_the_shipped_azure_trace_or_the_servers_own(
    store: Store, clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONTROLPLANE_AZURE_TRACE", raising=False)
    shipped = _post(store, "operator", {"trace": "azure", "policies": ["hpa"], "duration_s": 30})
    assert shipped.status_code == 200, shipped.text
    first_30s = [r for r in read_trace(shipped_trace()) if r.offset < 30.0]
    assert shipped.json()["policies"][0]["num_requests"] == len(first_30s) == 59
    csv = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.0000000,400,40" for i in range(120)]
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    monkeypatch.setenv("CONTROLPLANE_AZURE_TRACE", str(csv))
    resp = _post(store, "operator", {"trace": "azure", "policies": ["hpa"], "compress": 2})
    assert resp.status_code == 200, resp.text
    report = resp.json()["policies"][0]
    assert report["num_requests"] == 120 and report["duration_s"] == pytest.approx(59.5)


# ---- what-if runs as background jobs ------------------------------------------------------------
class Api:
    """The control plane's REST API in process on ``store`` (building another on the same store is what a
    restarted control plane does), with a token per role."""

    def __init__(self, store: Store, what_if_priority: str = "idle") -> None:
        fleet = Fleet(load_config().fleet, SimBackend(), store, secret=b"k" * 32)
        self.tokens = TokenAuthority(store)
        self.app = create_api(Services(fleet, store, self.tokens, Auditor(store),
                                       what_if_priority=what_if_priority))
        self.headers: dict[str, dict[str, str]] = {}

    def call(self, method: str, path: str, *, role: str = "operator", body: Any = None) -> httpx.Response:
        if role not in self.headers:
            token = self.tokens.issue(f"{role}-{secrets.token_hex(4)}", Role(role))
            self.headers[role] = {"Authorization": f"Bearer {token}"}

        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://cp") as http:
                return await http.request(method, path, json=body, headers=self.headers[role], timeout=120)

        return asyncio.run(go())

    def follow(self, job_id: int, timeout: float = 180.0) -> tuple[dict[str, Any], list[tuple[float, str]]]:
        """Poll a job as the console does until it ends: the last answer and the progress seen on the way."""
        seen: list[tuple[float, str]] = []

        def ended() -> dict[str, Any] | None:
            resp = self.call("GET", f"/api/v1/simulations/{job_id}", role="viewer")
            assert resp.status_code == 200, resp.text
            job: dict[str, Any] = resp.json()
            seen.append((job["progress"]["fraction"], job["progress"]["policy"]))
            return None if job["status"] == "running" else job

        return wait_until(ended, timeout=timeout, what=f"simulation {job_id} to end"), seen


# Long enough (a few seconds of simulation on this machine) to be seen running, polled and refused.
LONG = {"trace": "synthetic-bursty", "duration_s": 3600, "compress": 1, "policies": ["ours", "hpa"],
        "seed": 3}


def _without_wall_time(result: dict[str, Any]) -> dict[str, Any]:
    """A result less each policy's measured wall time (the only figure that differs between equal runs)."""
    return {**result, "policies": [{k: v for k, v in p.items() if k != "wall_s"} for p in result["policies"]]}


def _is_openai_error(resp: httpx.Response) -> bool:
    return set(resp.json().get("error", {})) == {"message", "type", "param", "code"}


def test_a_simulation_job_reports_rising_progress_and_ends_with_the_synchronous_result(
    store: Store, clock: FakeClock
) -> None:
    api = Api(store)
    started = api.call("POST", "/api/v1/simulations", body=LONG)
    assert started.status_code == 202, started.text
    job = started.json()
    assert job["status"] == "running" and job["progress"] == {"fraction": 0.0, "policy": "ours"}
    job_id = job["id"]

    second = api.call("POST", "/api/v1/simulations", body=LONG)  # one run at a time, across both endpoints
    assert second.status_code == 409 and _is_openai_error(second), second.text
    assert f"simulation {job_id}" in second.json()["error"]["message"]
    assert api.call("POST", "/api/v1/simulate", body=LONG).status_code == 409

    done, seen = api.follow(job_id)
    assert done["status"] == "done", done
    assert done["progress"]["fraction"] == 1.0 and done["progress"]["policy"] == "hpa"
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions), fractions
    assert any(0.0 < f < 1.0 for f in fractions), f"never seen mid-run: {seen}"
    order = [["ours", "hpa"].index(p) for _, p in seen]
    assert order == sorted(order) and 0 in order, seen  # ours, then hpa

    sync = api.call("POST", "/api/v1/simulate", body=LONG)  # the lock is free again
    assert sync.status_code == 200, sync.text
    assert _without_wall_time(done["result"]) == _without_wall_time(sync.json())
    assert [p["policy"] for p in done["result"]["policies"]] == ["ours", "hpa"]

    listed = api.call("GET", "/api/v1/simulations", role="viewer").json()
    assert [j["id"] for j in listed][:1] == [job_id] and "result" not in listed[0]
    assert listed[0]["status"] == "done" and listed[0]["policies"] == ["ours", "hpa"]

    audit = [(a.action, a.outcome, a.actor.split("-")[0]) for a in reversed(store.audit(limit=20))]
    assert [a for a in audit if a[0].startswith("simulate.")] == [
        ("simulate.start", "ok", "operator"),
        ("simulate.start", "denied", "operator"),
        ("simulate.run", "denied", "operator"),  # the synchronous endpoint while the job ran
        ("simulate.run", "ok", "operator"),  # the job's outcome
        ("simulate.run", "ok", "operator"),  # the synchronous run after it
    ], audit
    start_detail = next(a.detail for a in store.audit(limit=20)
                        if a.action == "simulate.start" and a.outcome == "ok")
    assert start_detail == f"simulation {job_id}"


@contextlib.contextmanager
def cpu_hogs() -> Iterator[None]:
    """A busy loop of normal priority on every CPU, as replicas serving flat out are; gone afterwards."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.exclusive  # it fills every core for a few seconds
def test_a_what_if_on_a_saturated_host_leaves_the_api_answering(store: Store, clock: FakeClock) -> None:
    """The what-if runs at idle priority: on a host whose cores are all busy it waits for a gap. In a thread
    of the control plane it would hold the interpreter lock meanwhile, and every API call (and loop) of the
    control plane would wait for that gap too: 1.35 s per hand-over of the lock on this machine. In a worker
    process it holds nothing the API needs."""
    api = Api(store)
    job_id = api.call("POST", "/api/v1/simulations", body=LONG).json()["id"]

    def computing() -> bool:
        job = api.call("GET", f"/api/v1/simulations/{job_id}", role="viewer").json()
        assert job["status"] == "running", job  # still running when the cores fill up
        return bool(job["progress"]["fraction"] > 0)

    wait_until(computing, timeout=60, what="the what-if to be computing", interval=0.05)
    took: list[float] = []
    with cpu_hogs():
        for _ in range(20):
            time.sleep(0.02)  # as the control plane's loops do between ticks: the lock is free meanwhile
            started = time.perf_counter()
            resp = api.call("GET", f"/api/v1/simulations/{job_id}", role="viewer")
            took.append(time.perf_counter() - started)
            assert resp.status_code == 200 and resp.json()["status"] == "running", resp.text
    assert statistics.median(took) < 0.25, took  # milliseconds; over a second each with the lock held
    done, _ = api.follow(job_id)  # and the what-if finishes once the cores are free again
    assert done["status"] == "done", done


@pytest.mark.parametrize(("priority", "policy"), [("idle", "SCHED_IDLE"), ("low", "SCHED_OTHER")])
def test_the_api_runs_each_what_if_in_a_worker_at_the_configured_priority(
        store: Store, clock: FakeClock, priority: str, policy: str) -> None:
    api = Api(store, what_if_priority=priority)
    job_id = api.call("POST", "/api/v1/simulations", body=LONG).json()["id"]

    def worker() -> psutil.Process | None:
        found = [p for p in psutil.Process().children() if WORKER in " ".join(p.cmdline())]
        return found[0] if found else None

    def computing() -> bool:  # past reading its request: its priority is set
        job = api.call("GET", f"/api/v1/simulations/{job_id}", role="viewer").json()
        return bool(job["progress"]["fraction"])

    wait_until(computing, timeout=60, what="the what-if to be computing", interval=0.05)
    running = worker()
    assert running is not None
    assert os.sched_getscheduler(running.pid) == getattr(os, policy) and running.nice() >= BATCH_NICE
    done, _ = api.follow(job_id)
    assert done["status"] == "done", done
    kept = worker()  # kept, blocked on its stdin, for the next what-if at this priority
    assert kept is not None and kept.pid == running.pid and kept.status() == psutil.STATUS_SLEEPING
    close_idle_workers()  # as the control plane's exit does, or its idle time
    assert worker() is None


def test_simulation_jobs_are_started_by_operators_and_read_by_viewers(store: Store, clock: FakeClock) -> None:
    api = Api(store)
    denied = api.call("POST", "/api/v1/simulations", role="viewer", body=INLINE)
    assert denied.status_code == 403 and _is_openai_error(denied)
    bad_policy = api.call("POST", "/api/v1/simulations", body={**INLINE, "policies": ["kpa"]})
    assert bad_policy.status_code == 400 and _is_openai_error(bad_policy)
    error = bad_policy.json()["error"]
    assert error["param"] == "policies" and "policy" in error["message"]
    bad_body = api.call("POST", "/api/v1/simulations", body={**INLINE, "compress": 0})
    assert bad_body.status_code == 400 and bad_body.json()["error"]["param"] == "compress"
    assert api.call("GET", "/api/v1/simulations", role="viewer").json() == []  # nothing refused was started

    job_id = api.call("POST", "/api/v1/simulations", body=INLINE).json()["id"]
    done, _ = api.follow(job_id)
    assert done["status"] == "done"
    assert done["result"]["policies"][1]["replica_seconds"] == pytest.approx(99.5)
    assert api.call("GET", f"/api/v1/simulations/{job_id}", role="viewer").status_code == 200
    missing = api.call("GET", f"/api/v1/simulations/{job_id + 1000}", role="viewer")
    assert missing.status_code == 404 and _is_openai_error(missing)
    starts = [(a.outcome, a.role) for a in store.audit(limit=20) if a.action == "simulate.start"]
    assert sorted(starts) == [("error", "operator"), ("ok", "operator")], starts


def test_a_bad_trace_ends_the_job_in_error_with_the_reason(
    store: Store, clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTROLPLANE_AZURE_TRACE", str(tmp_path / "gone.csv"))  # the server's own: missing
    api = Api(store)
    started = api.call("POST", "/api/v1/simulations", body={"trace": "azure", "policies": ["hpa"]})
    assert started.status_code == 202, started.text
    failed, _ = api.follow(started.json()["id"])
    assert failed["status"] == "error" and "gone.csv" in failed["error"], failed
    assert "result" not in failed

    empty = api.call("POST", "/api/v1/simulations", body={**INLINE, "requests": []})
    assert empty.status_code == 202  # the lock went with the failed job
    failed_too, _ = api.follow(empty.json()["id"])
    assert failed_too["status"] == "error" and "no request" in failed_too["error"]
    runs = [(a.outcome, a.detail) for a in store.audit(limit=20) if a.action == "simulate.run"]
    assert [o for o, _ in runs] == ["error", "error"] and "no request" in runs[0][1], runs


def test_a_job_survives_a_restart_and_one_left_running_is_interrupted(store: Store, clock: FakeClock) -> None:
    before = Api(store)
    job_id = before.call("POST", "/api/v1/simulations", body=INLINE).json()["id"]
    done, _ = before.follow(job_id)
    # a job acknowledged by a control plane that was killed during the run: its record says running
    orphan = store.add_record("simulations", {"status": "running", "trace": "inline", "policies": ["ours"],
                                              "progress": {"fraction": 0.4, "policy": "ours"}}, key="inline")

    after = Api(store)  # the restarted control plane
    kept = after.call("GET", f"/api/v1/simulations/{job_id}", role="viewer").json()
    assert kept["status"] == "done" and kept["result"] == done["result"]
    cut = after.call("GET", f"/api/v1/simulations/{orphan.id}", role="viewer").json()
    assert cut["status"] == "interrupted" and "stopped" in cut["error"], cut
    listed = after.call("GET", "/api/v1/simulations", role="viewer").json()
    assert [(j["id"], j["status"]) for j in listed] == [(orphan.id, "interrupted"), (job_id, "done")]
    again = after.call("POST", "/api/v1/simulations", body=INLINE)
    assert again.status_code == 202, again.text  # nothing holds the lock
    assert after.follow(again.json()["id"])[0]["status"] == "done"


def test_a_decode_batch_that_never_ran_whole_is_tried_again_then_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a busy host the first streams of a decode point may finish before the last are admitted: that
    try measures nothing and is taken again; three such tries end the calibration with one clear error.
    (The replica is replaced by token arrival times: what is checked is the retry, not a measurement.)"""
    from controlplane.autoscale import calibrate

    apart = [[0.1, 0.2, 0.3], [0.5, 0.6, 0.7]]  # never both decoding
    together = [[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]]
    answers: list[list[float]] = [*apart, *together]

    async def stream(client: Any, prompt: list[int], max_tokens: int) -> list[float]:
        return answers.pop(0)

    monkeypatch.setattr(calibrate, "_stream", stream)
    rng, client, point = calibrate.random.Random(0), cast(httpx.AsyncClient, None), calibrate.Decode(2, 8)
    median, tokens = asyncio.run(calibrate._decode_once(client, rng, point, 4))
    assert median == pytest.approx(0.1) and tokens == [1, 2, 3, 1, 2, 3] and answers == []
    answers.extend(apart * calibrate.DECODE_TRIES)
    with pytest.raises(calibrate.CalibrationFailed, match="no step with the whole batch decoding in 3 tries"):
        asyncio.run(calibrate._decode_once(client, rng, point, 4))


def test_cli_runs_on_the_profile_the_control_plane_runs_on(tmp_path: Path) -> None:
    """Without --profile, `controlplane simulate --config FILE` prices steps as that control plane's
    autoscaler does: the profile calibrated into its state folder, else the shipped one for its fleet (the
    torch path's reference when the fleet runs without the CPU decode kernel)."""
    from controlplane.autoscale.profile import load_reference_profile

    def simulate_with(config: Path) -> str:
        out = subprocess.run([sys.executable, "-m", "controlplane", "simulate", "--config", str(config),
                              "--trace", "synthetic-bursty", "--duration", "120"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[0]

    plain, torch_path = tmp_path / "plain.toml", tmp_path / "torch.toml"
    plain.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    torch_path.write_text(f'state_dir = "{tmp_path / "state"}"\n[fleet]\ncpu_decode_kernel = false\n')
    assert simulate_with(plain).startswith(f"profile: shipped ({load_profile().source};")
    assert f"({load_reference_profile().source};" in simulate_with(torch_path)
    calibrated = replace(load_profile(), source="measured here, for this test")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "replica_profile.json").write_text(json.dumps(calibrated.to_json()))
    for config in (plain, torch_path):
        line = simulate_with(config)
        assert line.startswith(f"profile: {tmp_path / 'state' / 'replica_profile.json'} (measured here"), line
