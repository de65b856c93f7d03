"""Where the live loop stood at the load's start (``controlplane.bench.live_loop``), rebuilt from its decision
records as the API hands them out, and the simulated loop started there.

The bench probes the data path before the slice: that probe is a change of load the live loop remembers
for four windows, within which it takes each window's own rate. A simulated loop that starts fresh fits a
trend to the slice's ramp instead and scales sooner; started from the rebuilt state it reads the ramp as
the live loop did.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from controlplane.autoscale.decide import (
    LoopState,
    Observation,
    applied,
    decide,
    new_state,
    record_body,
    with_work,
)
from controlplane.bench.live_loop import loop_start
from controlplane.client import Decision
from controlplane.sim.fleet import FleetSim, histogram_p95
from controlplane.sim.fleet import Observation as SimObservation
from controlplane.sim.policies import LivePolicy, autoscaler_config
from controlplane.sim.settings import SimSettings
from controlplane.sim.trace import SimRequest
from controlplane.views.decoder import decode
from tests.controlplane.autoscale.test_work import CONFIG, PROFILE, QUIET

START = 1_000.0  # the load's start, in the loop's seconds (wall = now here)


def probe_then_ramp(now: float) -> float:
    """What a 30 s window counts: a probe of 5 req/s over [START - 60, START - 45], quiet, then a ramp."""
    probe = max(0.0, min(now, START - 45) - max(now - 30, START - 60)) * 5.0 / 30
    ramp_from = max(now - 30, START)
    ramp = 0.0 if now <= START else ((now - START) ** 2 - (ramp_from - START) ** 2) * 0.2 / 30
    return probe + ramp


def live_ticks(until: float) -> tuple[list[Decision], dict[float, LoopState]]:
    """The records a live loop writes ticking every 5 s from START - 120 s (1 replica, then 2 from START -
    50 s: a replica that became ready), as the API decodes them, and its state after each tick."""
    state, records, states = new_state(CONFIG), [], {}
    now = START - 119.0
    while now <= until:
        ready = 1 if now < START - 50 else 2
        waiting = 3.0 if now > START - 30 else 0.0
        obs = Observation(now=now, wall=now, current=ready, ready=ready, starting=0,
                          metrics={**QUIET, "waiting_per_replica": waiting},
                          request_rate=probe_then_ramp(now), mean_prompt_tokens=400.0,
                          mean_output_tokens=60.0, rate_window_s=30.0, panic_counted_s=5.0)
        obs = with_work(obs, state, CONFIG, PROFILE)
        plan, state = decide(obs, state, CONFIG, [])
        body = record_body(obs, plan, tick=len(records) + 1, mode="observe_only", applied=False, outcome="")
        records.append(decode(Decision, json.loads(json.dumps(body))))
        if plan.replicas != obs.current:
            state = applied(state, obs, plan)
        states[now] = state
        now += 5.0
    return records, states


def test_the_rebuilt_state_is_the_one_the_loop_held_at_the_loads_start() -> None:
    records, states = live_ticks(START + 40)
    held = states[max(t for t in states if t < START)]
    assert any(r.inputs.load_changed for r in records if r.at < START)  # the probe was a change
    begin = loop_start(records, START, keep_s=CONFIG.scale_down_stabilization_s)
    # the same samples, in seconds since the load's start
    assert [(s.at + START, s.rate, s.mean_prompt_tokens, s.change) for s in begin.prior.load] == \
        [(s.at, pytest.approx(s.rate, abs=1e-6), pytest.approx(s.mean_prompt_tokens), s.change)
         for s in held.load]
    assert held.load and held.load[0].change
    assert begin.prior.waiting == held.waiting == 3.0
    assert held.ready is not None and begin.prior.ready == (2, held.ready[1] - START)
    assert begin.first_tick_s == pytest.approx(1.0)  # START - 119 + 24 x 5 = START + 1
    assert begin.panic_counted_s == 5.0  # what its panic window's rate counted, for the simulated loop
    assert "since its last change at" in begin.describe()
    # nothing after the start counts, and a loop that never ticked before it starts fresh
    assert loop_start(records, START - 200, keep_s=300.0).prior.load == ()


def test_a_simulated_loop_started_there_takes_each_windows_rate_as_the_live_one_did() -> None:
    records, _ = live_ticks(START + 40)
    begin = loop_start(records, START, keep_s=CONFIG.scale_down_stabilization_s)
    requests = [SimRequest(i, a, 200, 40) for i, a in enumerate(ramp_arrivals(60.0))]
    config = autoscaler_config(PROFILE, SimSettings(min_replicas=1, initial_replicas=2, max_replicas=4))

    def priced(prior: LoopState | None) -> dict[float, float]:
        """The rate each tick's work was priced at (its Erlang C term), by tick."""
        policy, rates = LivePolicy(config, 2, PROFILE, prior), {}

        def tick(obs: SimObservation) -> tuple[int, str]:
            replicas, reason = policy(obs)
            if (found := re.search(r"Erlang C: ([0-9.]+) req/s", reason)) is not None:
                rates[obs.now] = float(found.group(1))
            return replicas, reason

        FleetSim(PROFILE, requests, initial_replicas=2, policy=tick, tick_s=5.0,
                 first_tick_s=begin.first_tick_s).run()
        return rates

    fresh, from_live = priced(None), priced(begin.prior)
    late = [t for t in from_live if t >= 40]
    assert late and all(t in fresh for t in late)
    window = {t: sum(1 for a in ramp_arrivals(60.0) if t - 30 < a <= t) / 30 for t in late}
    # within four windows of the probe's change the live loop prices each window's own rate; a fresh loop
    # fits the ramp's trend and prices where it has got to, ahead of the window's mean
    assert all(from_live[t] == pytest.approx(window[t], rel=0.02) for t in late)
    assert all(fresh[t] > 1.15 * window[t] for t in late)


def ramp_arrivals(until: float) -> list[float]:
    """Arrivals whose rate rises 0.4 req/s each second (the integral of the ramp in probe_then_ramp)."""
    return [math.sqrt(k / 0.2) for k in range(1, int(0.2 * until**2))]


def test_the_simulator_reads_p95_ttft_through_the_replicas_histogram_as_the_live_loop_does() -> None:
    # 100 first tokens, the 95th at 1.05 s: exact P95 1.05 s, past the SLO by less than the 10% tolerance
    ttfts = sorted([0.2] * 90 + [1.05] * 10)
    p95 = histogram_p95(ttfts)
    # the rank falls 5 of 10 observations into the (1, 2.5] bucket: 1 + 1.5 x 5/10
    assert p95 == pytest.approx(1.75)
    assert histogram_p95([0.03] * 20) == pytest.approx(0.02 + 0.02 * 19 / 20)  # in (0.02, 0.04]
    assert histogram_p95([]) is None


def test_the_first_tick_comes_at_the_live_loops_phase() -> None:
    seen: list[float] = []

    def policy(obs: SimObservation) -> tuple[int, str]:
        seen.append(obs.now)
        return 1, ""

    FleetSim(PROFILE, [SimRequest(i, i * 0.5, 50, 5) for i in range(40)], initial_replicas=1, policy=policy,
             tick_s=5.0, first_tick_s=1.5).run()
    assert seen[:3] == [1.5, 6.5, 11.5]
    with pytest.raises(ValueError, match="first_tick_s"):
        FleetSim(PROFILE, [], initial_replicas=1, policy=policy, tick_s=5.0, first_tick_s=-1.0)


def test_the_simulated_panic_window_counts_the_span_a_live_loops_scrapes_count() -> None:
    # a ramp: the last 5 s of a 6 s window hold more than 5/6 of its arrivals
    requests = [SimRequest(i, a, 50, 5) for i, a in enumerate(ramp_arrivals(30.0))]
    seen: dict[float | None, tuple[float, float | None]] = {}

    def reading(counted: float | None) -> None:
        def policy(obs: SimObservation) -> tuple[int, str]:
            if obs.now == 20.0:
                seen[counted] = (obs.arrivals_per_s_short, obs.panic_counted_s)
            return 1, ""

        FleetSim(PROFILE, requests, initial_replicas=1, policy=policy, tick_s=5.0,
                 panic_counted_s=counted).run()

    reading(None)
    reading(5.0)
    arrivals = ramp_arrivals(30.0)
    assert seen[None] == (pytest.approx(sum(1 for a in arrivals if 14 <= a <= 20) / 6), None)
    assert seen[5.0] == (pytest.approx(sum(1 for a in arrivals if 15 <= a <= 20) / 5), 5.0)
    assert seen[5.0][0] > seen[None][0]
    with pytest.raises(ValueError, match="panic_counted_s"):
        FleetSim(PROFILE, requests, initial_replicas=1, policy=None, tick_s=5.0, panic_counted_s=7.0)
