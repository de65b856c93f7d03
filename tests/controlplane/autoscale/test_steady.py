"""The steady load (``controlplane.autoscale.load.steady_load``): the rate the work is sized on.

Ticks go through the same ``with_work`` and ``decide`` the live loop and the simulator call, each tick's
rate being what a 30 s window counted: Poisson noise around a steady rate is averaged away, a step is
taken at once, a ramp is followed by its trend, and a fleet that shows itself short is believed. A surge
in the 6 s panic window (``surge``) sizes the work before the 30 s window shows it, and Poisson noise
there does not.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from controlplane.autoscale.decide import (
    LoopState,
    Observation,
    decide,
    new_state,
    offered_work,
    with_work,
)
from controlplane.autoscale.load import SteadyLoad, change_z, steady_load, surge
from tests.controlplane.autoscale.test_work import CONFIG, PROFILE, QUIET

SHORT = {**QUIET, "waiting_per_replica": 9.0, "ttft_p95_s": 1.4}  # queue and TTFT over their targets
WINDOW_S, TICK_S = 30.0, 5.0


def observation(now: float, rate: float, metrics: dict[str, float] = QUIET,
                window_s: float | None = WINDOW_S) -> Observation:
    return Observation(now=now, wall=now, current=2, ready=2, starting=0, metrics=metrics, request_rate=rate,
                       mean_prompt_tokens=1400.0, mean_output_tokens=150.0, rate_window_s=window_s)


Metrics = Callable[[float], dict[str, float]]


def run(rates: Callable[[float], float], until_s: float,
        metrics: Metrics = lambda _: QUIET) -> list[tuple[float, float, SteadyLoad]]:
    """(now, the window's rate, the steady load) per tick, the state carried by ``decide``."""
    state: LoopState = new_state(CONFIG)
    seen = []
    now = TICK_S
    while now <= until_s:
        obs = observation(now, rates(now), metrics(now))
        seen.append((now, obs.request_rate or 0.0, steady_load(obs, state, CONFIG)))
        _, state = decide(with_work(obs, state, CONFIG, PROFILE), state, CONFIG, [])
        now += TICK_S
    return seen


def window_rates(arrivals: list[float]) -> Callable[[float], float]:
    """The rate a 30 s window ending at ``now`` counts."""
    return lambda now: sum(1 for a in arrivals if now - WINDOW_S < a <= now) / WINDOW_S


def window_mean(rate: Callable[[float], float]) -> Callable[[float], float]:
    """The exact mean of ``rate`` over the 30 s window ending at ``now`` (no counting noise)."""
    return lambda now: sum(rate(now - WINDOW_S + (i + 0.5) * 0.5) for i in range(60)) / 60


def test_the_change_threshold_makes_one_false_change_a_day() -> None:
    assert change_z(30.0) == pytest.approx(3.58, abs=0.01)  # 2,880 disjoint 30 s windows a day
    assert change_z(60.0) < change_z(30.0)  # fewer windows, fewer chances to read noise as a change
    assert change_z(2 * 86_400.0) == 0.0  # a window over a day: every window a change, each its own rate


def test_counting_noise_of_a_steady_load_is_averaged_away_not_its_noisiest_window_kept() -> None:
    """Poisson arrivals at 4.8 requests/s: 30 s windows read about +-8% around it (one standard error) and
    here up to 19% off; the steady load, past its first five minutes, stays within 2.5 standard errors of
    a five-minute mean (6%), less than half the windows' widest miss, and never reads a change."""
    rng = random.Random(7)
    arrivals, t = [], -WINDOW_S  # the load was there before the first tick's window
    while t < 1200.0:
        t += rng.expovariate(4.8)
        arrivals.append(t)
    seen = run(window_rates(arrivals), 1200.0)
    settled = [(raw, s) for now, raw, s in seen if now >= 330.0]
    raw_miss = max(abs(r - 4.8) for r, _ in settled) / 4.8
    steady_miss = max(abs((s.rate or 0.0) - 4.8) for _, s in settled) / 4.8
    assert raw_miss > 0.15 and steady_miss < 0.06 and steady_miss < raw_miss / 2
    assert not any(s.changed for _, s in settled)
    assert all(s.note.startswith("steady load: ") for _, s in settled)


def test_a_step_is_taken_at_once_and_the_level_starts_again_after_it() -> None:
    """From 4 to 8 requests/s at 600 s: the first window that reads the step beyond the threshold is a change
    and stands as it is, each window's own rate stands until four windows lie after the change, then the
    level is the new rate's."""
    seen = run(window_mean(lambda t: 4.0 if t < 600.0 else 8.0), 1200.0)
    change = next((now, s) for now, _, s in seen if s.changed and now > 600.0)
    assert 600.0 < change[0] <= 615.0 and "load changed" in change[1].note
    after = [(now, raw, s) for now, raw, s in seen if change[0] < now < change[0] + 4 * WINDOW_S]
    assert after and all(s.rate == raw and "the load changed" in s.note for _, raw, s in after)
    late = [s for now, _, s in seen if now >= change[0] + 4 * WINDOW_S]
    assert all(s.rate == pytest.approx(8.0) and not s.changed for s in late)


def test_a_ramp_is_followed_by_its_trend_not_lagged_by_a_mean() -> None:
    """3 to 14 requests/s over 15 minutes (a working day's start): the steady load keeps within 5% of the
    rate at each tick, where the mean of the last five minutes lags it by a sixth or more."""
    def rate(t: float) -> float:
        return 3.0 + 11.0 * min(max(t - 300.0, 0.0) / 900.0, 1.0)

    seen = run(window_mean(rate), 1200.0)
    ramp = [(now, s) for now, _, s in seen if 660.0 <= now <= 1200.0]
    assert all(abs(s.rate - rate(now)) / rate(now) < 0.05 for now, s in ramp if s.rate is not None)
    assert any("the trend of" in s.note for _, s in ramp)
    lagged_mean = sum(rate(t) for t in range(500, 800)) / 300  # five minutes up to 800 s
    assert (rate(800.0) - lagged_mean) / rate(800.0) > 0.15


def test_a_window_over_the_level_while_the_fleet_shows_itself_short_is_load_not_noise() -> None:
    """A window 6% over a steady 20 requests/s is within its noise; with the queue and P95 TTFT over their
    targets it is the rate the work is sized on."""
    def rates(now: float) -> float:
        return 20.0 if now < 600.0 else 21.2

    quiet = run(rates, 620.0)[-1][2]
    short = run(rates, 620.0, metrics=lambda now: QUIET if now < 600.0 else SHORT)[-1][2]
    assert quiet.rate == pytest.approx(20.0, abs=0.2) and not quiet.changed
    assert short.rate == 21.2 and "taken as load, not noise" in short.note


def test_without_a_rate_window_or_earlier_ticks_each_window_stands_and_the_note_joins_the_record() -> None:
    state = new_state(CONFIG)
    first = steady_load(observation(5.0, 4.0), state, CONFIG)
    assert first.rate == 4.0 and first.note == ""
    _, state = decide(with_work(observation(5.0, 4.0), state, CONFIG, PROFILE), state, CONFIG, [])
    unknown_window = steady_load(observation(10.0, 4.4, window_s=None), state, CONFIG)
    assert unknown_window.rate == 4.4
    sized = with_work(observation(10.0, 4.4), state, CONFIG, PROFILE)
    assert sized.work is not None and any(n.startswith("steady load: ") for n in sized.notes)


def settled_at(rate: float, until_s: float = 300.0) -> tuple[LoopState, float]:
    """The state after ``until_s`` of ticks whose windows read ``rate`` exactly, and the next tick's time."""
    state, now = new_state(CONFIG), TICK_S
    while now <= until_s:
        obs = replace(observation(now, rate), current=3, ready=3)
        _, state = decide(with_work(obs, state, CONFIG, PROFILE), state, CONFIG, [])
        now += TICK_S
    return state, now


def surging(now: float, rate: float, short: float | None, current: int = 3) -> Observation:
    return replace(observation(now, rate), current=current, ready=current, panic_request_rate=short)


def test_a_burst_in_the_panic_window_sizes_the_work_before_the_metrics_window_shows_it() -> None:
    """Five minutes at 4 requests/s, then 14 over the last 6 s: the 30 s window reads 5.0, within its noise
    of the steady 4 (2.7 standard errors), but the panic window's 84 arrivals against 24 expected are a
    surge, and the work is sized at 14 requests/s: 6 replicas where the steady load's need 3, applied at
    this tick."""
    state, now = settled_at(4.0)
    obs = with_work(surging(now, 5.0, 14.0), state, CONFIG, PROFILE)
    at_surge = offered_work(PROFILE, CONFIG, request_rate=14.0, mean_prompt_tokens=1400.0,
                            mean_output_tokens=150.0)
    assert obs.work is not None and at_surge is not None
    assert obs.work.replicas == at_surge.replicas == 6
    assert any(n.startswith("load surged: 14 req/s over the last 6s against the steady 4") for n in obs.notes)
    plan, _ = decide(obs, state, CONFIG, [])
    assert plan.replicas == 6
    calm = with_work(surging(now, 5.0, None), state, CONFIG, PROFILE)  # no panic window's rate: no surge
    assert calm.work is not None and calm.work.replicas == 3
    assert not any("surged" in n for n in calm.notes)


def test_a_surge_the_fleet_already_has_replicas_for_leaves_the_steady_load() -> None:
    """The same surge on a fleet of 6: the work at 14 requests/s needs no more than it has, so the steady
    load's work stands (a 6 s peak held through the stabilization window would keep the fleet at a peak
    it already served)."""
    state, now = settled_at(4.0)
    obs = with_work(surging(now, 5.0, 14.0, current=6), state, CONFIG, PROFILE)
    assert surge(obs, 4.0, CONFIG) is not None
    assert obs.work is not None and obs.work.replicas == 3
    assert not any("surged" in n for n in obs.notes)


def test_the_surge_threshold_is_the_exact_poisson_tail_not_the_normal_approximation() -> None:
    """At 3 requests/s a 6 s window expects 18 arrivals. 36 is 4.2 standard errors out, over the normal
    threshold for one false change a day of such windows (3.98), yet a Poisson count reaches it in more
    than one window in 14,400: no surge. 37 is rarer than that: a surge."""
    assert change_z(6.0) < (36 - 18) / 18**0.5
    assert surge(surging(100.0, 3.0, 36 / 6), 3.0, CONFIG) is None
    assert surge(surging(100.0, 3.0, 37 / 6), 3.0, CONFIG) is not None
    assert surge(surging(100.0, 3.0, 2.0), 3.0, CONFIG) is None  # fewer than expected: never a surge


def test_a_rate_extrapolated_from_fewer_seconds_is_tested_as_the_count_it_was_measured_from() -> None:
    """6.5 requests/s over a 6 s window at a steady 3: 39 arrivals against 18 is a surge, but from scrapes
    that spanned 4 s of it the rate is 26 arrivals against 12, which a Poisson count reaches more often
    than once a day of windows."""
    whole = surging(100.0, 3.0, 6.5)
    assert surge(whole, 3.0, CONFIG) is not None
    assert surge(replace(whole, panic_counted_s=4.0), 3.0, CONFIG) is None


def test_a_steady_poisson_load_surges_about_once_a_day_where_the_normal_threshold_reads_more() -> None:
    """Ten days of disjoint 6 s windows at 3 requests/s (144,000 Poisson counts, mean 18): the exact tail
    reads about one false surge a day; the normal approximation at the same daily rate (3.98 standard
    errors) reads several times as many."""
    counts = np.random.default_rng(11).poisson(18.0, size=144_000)
    tally = np.bincount(counts)
    exact = sum(int(n) for c, n in enumerate(tally) if surge(surging(100.0, 3.0, c / 6), 3.0, CONFIG))
    normal = int(tally[[c for c in range(len(tally)) if (c - 18) / 18**0.5 > change_z(6.0)]].sum())
    assert 3 <= exact <= 20  # at most one a day; 8.3 expected (37 or more: P 5.8e-5 a window)
    assert normal > 2.5 * exact
