"""Sizing by work (``controlplane.autoscale.work``): prefill, decode, KV cache and the TPOT tail each drive
scale-up.

Synthetic snapshots through the same ``decide`` the live loop and the simulator call: at one request rate,
long prompts, long outputs and a small KV cache each ask for more replicas than short requests do, the reason
says which term and with what inputs, and a rate hovering at a step of the count does not flip the fleet.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import replace

import pytest
from scipy.stats import poisson

from controlplane.autoscale.config import AutoscalerConfig
from controlplane.autoscale.decide import Observation, decide, new_state, offered_work, with_work
from controlplane.autoscale.profile import ReplicaProfile
from controlplane.autoscale.work import (
    TpotTail,
    WorkNeeds,
    decode_batch,
    erlang_c,
    erlang_c_servers,
    output_quantiles,
    poisson_at_least,
    prefill_added,
    prefill_occupancy,
    prefill_seconds,
    prefill_variability,
    work_needs,
)

PROFILE = ReplicaProfile(step_base_s=0.005, per_seq_s=0.0004, per_prefill_token_s=0.00015,
                         per_context_token_s=2e-7, per_prefill_pair_s=6e-8, start_s=3.0)
CONFIG = AutoscalerConfig(min_replicas=1, max_replicas=20, anomaly_enabled=False)
QUIET = {"waiting_per_replica": 0.0, "kv_cache_usage": 0.1, "ttft_p95_s": 0.2,
         "tokens_per_s_per_replica": 50.0, "engine_load_per_replica": 0.3}


def plan_for(rate: float, prompt: float, output: float, *, current: int = 2,
             profile: ReplicaProfile = PROFILE) -> tuple[int, str]:
    work = offered_work(profile, CONFIG, request_rate=rate, mean_prompt_tokens=prompt,
                        mean_output_tokens=output)
    obs = Observation(now=1000.0, wall=1000.0, current=current, ready=current, starting=0, metrics=QUIET,
                      request_rate=rate, mean_prompt_tokens=prompt, mean_output_tokens=output, work=work)
    plan, _ = decide(obs, new_state(CONFIG), CONFIG, [])
    reasons = [p.reason for p in plan.decision.proposals if p.source == "work"]
    return plan.replicas, reasons[0] if reasons else ""


def test_erlang_c_matches_the_textbook() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: an arrival waits with probability rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0  # unstable: everyone waits
    # one server at rho 0.5 and a 1 s service: P(wait > t) = 0.5 exp(-0.5 t) <= 5% needs t >= 4.6 s
    assert erlang_c_servers(0.5, 1.0, 4.7, 0.95) == 1 and erlang_c_servers(0.5, 1.0, 4.5, 0.95) == 2


def test_prefill_times_of_one_length_wait_half_as_long_as_exponential_ones() -> None:
    """Allen-Cunneen: an M/G/c queue waits (1 + cs^2) / 2 times as long as M/M/c. At 1.4 Erlangs of 0.3 s
    prefills and a 0.7 s wait budget, M/M/c needs 3 servers; prefills all of one length need 2."""
    assert erlang_c_servers(1.4, 0.3, 0.7, 0.95) == 3 == erlang_c_servers(1.4, 0.3, 0.7, 0.95, 1.0)
    assert erlang_c_servers(1.4, 0.3, 0.7, 0.95, 0.5) == 2
    assert erlang_c_servers(1.4, 0.3, 0.7, 0.95, 3.0) > 3  # a long tail of prompts waits longer


def test_the_spread_of_prompt_lengths_sizes_the_prefill_queue() -> None:
    assert prefill_variability(PROFILE, 1500, 0, decoding=0, context=0) == 0.0
    narrow = prefill_variability(PROFILE, 1500, 150, decoding=0, context=0)
    wide = prefill_variability(PROFILE, 1500, 1500, decoding=0, context=0)
    assert 0 < narrow < 0.05 < 0.5 < wide

    def prefill(sd: float | None) -> tuple[int, str]:
        needs = work_needs(PROFILE, rate=4.0, mean_prompt=1500, mean_output=50, ttft_slo_s=1.0,
                           tpot_slo_s=0.1, prompt_sd=sd)
        assert needs is not None
        return needs.prefill, needs.reason

    unknown, reason = prefill(None)
    assert "prefill times taken as exponential" in reason
    same, reason = prefill(0.0)
    assert same < unknown and "cs^2 0.00, Allen-Cunneen x0.50" in reason
    assert prefill(3000.0)[0] > unknown  # prompts from 1 to several thousand tokens


def test_prefill_in_chunks_costs_what_one_chunk_would_plus_the_extra_steps() -> None:
    one = prefill_seconds(PROFILE, 1000, decoding=0, context=0)
    assert one == pytest.approx(PROFILE.step_time(num_decode=0, num_prefill_tokens=1000, context_tokens=0))
    two = prefill_seconds(PROFILE, 2000, decoding=0, context=0)  # two chunks of the 1024-token budget
    assert two > 2 * one  # the second chunk attends to the first: super-linear


def test_a_short_prefill_occupies_its_share_of_a_step_and_a_long_one_its_steps() -> None:
    """Prefills waiting together share a step: a 48-token suffix behind a cached system prompt takes what
    its tokens add plus its share of the step by tokens, a fraction of the step it rides on; a prompt that
    fills whole steps occupies them, less its last chunk's unfilled share."""
    decoding, context = 40, 600.0
    budget = PROFILE.max_num_batched_tokens - decoding
    ride = prefill_seconds(PROFILE, 465, decoding=decoding, context=context, cached=417)
    occupied = prefill_occupancy(PROFILE, 465, decoding=decoding, context=context, cached=417)
    added = prefill_added(PROFILE, 465, cached=417, budget=budget)
    fixed = PROFILE.step_time(num_decode=decoding, num_prefill_tokens=0,
                              context_tokens=round(decoding * context))
    assert ride == pytest.approx(fixed + added)  # alone, it waits out the whole step
    assert occupied == pytest.approx(added + fixed * 48 / budget)
    assert occupied < ride / 3
    # two whole chunks: occupancy is the two steps, the same as riding them
    whole = 2 * budget
    assert prefill_occupancy(PROFILE, whole, decoding=decoding, context=context) == pytest.approx(
        prefill_seconds(PROFILE, whole, decoding=decoding, context=context))
    # a chunk and a bit: between one and two steps, not two
    more = prefill_occupancy(PROFILE, budget + 10, decoding=decoding, context=context)
    assert more < prefill_seconds(PROFILE, budget + 10, decoding=decoding, context=context) - 0.9 * fixed


def test_short_suffixes_at_a_high_rate_are_sized_by_the_steps_they_share_not_one_step_each() -> None:
    """Behind a 90% prefix hit share, 120 requests/s of 47 computed tokens: priced a whole step each (the
    decode batch's and all), the prefill queue alone would ask for five replicas or more; what the suffixes
    occupy is a small share of the steps, and the engine time they add is taken from the decode slots'
    time, which then sizes the fleet."""
    rate, prompt, output = 120.0, 465, 44
    needs = work_needs(PROFILE, rate=rate, mean_prompt=prompt, mean_output=output, ttft_slo_s=1.0,
                       tpot_slo_s=0.1, prefix_hit_share=0.9)
    assert needs is not None
    context = prompt + output / 2
    batch, step = decode_batch(PROFILE, context, 0.1)
    in_decode = rate * output * step
    carried = math.ceil(in_decode / math.ceil(in_decode / batch))
    a_step_each = rate * prefill_seconds(PROFILE, prompt, decoding=carried, context=context, cached=418)
    assert a_step_each > 4.5 and needs.prefill <= 2
    budget = PROFILE.max_num_batched_tokens - carried
    prefilling = rate * prefill_added(PROFILE, prompt, cached=418, budget=budget)
    assert prefilling > 0.5  # half a replica's time or more goes to the suffixes
    assert needs.decode == math.ceil(in_decode / batch + prefilling) > math.ceil(in_decode / batch)
    assert needs.replicas == needs.decode
    shares = f"{in_decode / batch:.2f} replicas, plus {prefilling:.2f} of prefill in their steps"
    assert shares in needs.reason


def test_long_prompts_scale_up_where_short_ones_at_the_same_rate_do_not() -> None:
    short, _ = plan_for(4.0, prompt=200, output=50)
    long, reason = plan_for(4.0, prompt=1500, output=50)
    assert short <= 2 < long
    assert reason.startswith(f"prefill {long} (Erlang C: 4 req/s x ") and "1500 tokens" in reason


def test_prompt_tokens_a_prefix_cache_holds_cost_no_prefill_but_still_count_as_context() -> None:
    uncached = work_needs(PROFILE, rate=6.0, mean_prompt=1500, mean_output=50, ttft_slo_s=1.0, tpot_slo_s=0.1)
    cached = work_needs(PROFILE, rate=6.0, mean_prompt=1500, mean_output=50, ttft_slo_s=1.0, tpot_slo_s=0.1,
                        prefix_hit_share=0.9)
    assert uncached is not None and cached is not None
    assert cached.prefill < uncached.prefill
    assert "1500 tokens, 1350 of them cached (90% prefix hits)" in cached.reason
    # the 150 computed tokens attend to the 1,350 cached ones: dearer than a 150-token prompt alone
    assert prefill_seconds(PROFILE, 1500, decoding=0, context=0, cached=1350) > prefill_seconds(
        PROFILE, 150, decoding=0, context=0)
    assert cached.kv == uncached.kv  # the cached tokens still sit in the KV cache
    every = work_needs(PROFILE, rate=6.0, mean_prompt=1500, mean_output=50, ttft_slo_s=1.0, tpot_slo_s=0.1,
                       prefix_hit_share=1.0)
    assert every is not None and "1499 of them cached" in every.reason  # one token is always computed


def test_with_prefix_hits_the_spread_of_whole_prompts_does_not_narrow_the_prefill_queue() -> None:
    """Whole prompts all of one length (a system prompt) say nothing of the uncached suffixes' spread:
    M/M/c stands where the prefix caches hold part of the prompts."""
    def needs(hits: float | None, sd: float | None) -> tuple[int, str]:
        found = work_needs(PROFILE, rate=30.0, mean_prompt=1500, mean_output=50, ttft_slo_s=1.0,
                           tpot_slo_s=0.1, prefix_hit_share=hits, prompt_sd=sd)
        assert found is not None
        return found.prefill, found.reason

    cached_mmc, _ = needs(0.8, None)
    cached_sd, reason = needs(0.8, 0.0)
    assert cached_sd == cached_mmc and "the spread of the uncached part is unknown" in reason
    assert needs(None, 0.0)[0] < needs(None, None)[0]  # without hits the spread still counts


def test_long_outputs_scale_up_by_the_decode_slots_they_hold() -> None:
    short, _ = plan_for(3.0, prompt=200, output=20)
    long, reason = plan_for(3.0, prompt=200, output=2000)
    needs = work_needs(PROFILE, rate=3.0, mean_prompt=200, mean_output=2000, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert needs is not None and needs.decode > needs.prefill
    assert short <= 2 < long == needs.decode
    assert f"decode {long} (" in reason


def test_decode_slots_near_full_add_a_replica_for_the_wait_for_one() -> None:
    """Short prompts and answers of 40 tokens at the rate where the slots' floor (``L / b`` plus the
    prefills' share) just fits one replica: its 64 slots would run nearly full, and a sequence that finds
    them taken waits for one, so the decode term asks for a second and says why. Well under that rate the
    wait is short and the floor stands."""
    batch, step = decode_batch(PROFILE, 100 + 20, 0.1)
    prefill = prefill_added(PROFILE, 100)
    edge = 0.98 / (40 * step / batch + prefill)  # the rate at which the floor is 0.98 of one replica
    near = work_needs(PROFILE, rate=edge, mean_prompt=100, mean_output=40, ttft_slo_s=1.0, tpot_slo_s=0.1,
                      output_sd=30.0)
    under = work_needs(PROFILE, rate=0.7 * edge, mean_prompt=100, mean_output=40, ttft_slo_s=1.0,
                       tpot_slo_s=0.1, output_sd=30.0)
    assert near is not None and under is not None
    assert near.decode == 2 and under.decode == 1
    assert f"1 would keep their {batch} slots" in near.reason and "TTFT budget needs 2" in near.reason
    assert "slots" not in under.reason.split("; KV")[0].split("decode 1 (")[1]


def test_short_answers_behind_long_prompts_scale_up_for_their_tpot_tail() -> None:
    """A 1,000-token prompt adds about 0.2 s to the step it rides on, twice the 0.1 s TPOT SLO. At 2
    requests/s one replica holds the prefill queue (TTFT) and the mean step (decode), yet a 4-token answer
    whose three steps carry the prompts queued behind it misses: the TPOT tail asks a second replica.
    40-token answers spread the same chunks over ten times the steps, and one replica holds them."""
    def needs(output: float) -> WorkNeeds:
        work = work_needs(PROFILE, rate=2.0, mean_prompt=1000, mean_output=output, ttft_slo_s=1.0,
                          tpot_slo_s=0.1, output_sd=0.7 * output)
        assert work is not None
        return work

    short, long = needs(4), needs(40)
    assert (short.prefill, short.decode, short.kv) == (1, 1, 1) and short.tpot == short.replicas == 2
    assert long.replicas == long.tpot == 1
    assert "TPOT tail 2 (" in short.reason and "outputs log-normal, sd 3" in short.reason
    assert short.tail is not None and short.tail.miss_share(1) > 0.05 >= short.tail.miss_share(2)


def test_the_tpot_tail_falls_with_replicas_and_is_nil_where_no_chunk_can_take_a_request_over() -> None:
    def tail(profile: ReplicaProfile = PROFILE, outputs: tuple[int, ...] = output_quantiles(4, 2.8)
             ) -> TpotTail:
        return TpotTail(profile, rate=4.0, prompt=1000, cached=0, context=1002, in_decode=0.5,
                        outputs=outputs, tpot_slo_s=0.1)

    shares = [tail().miss_share(c) for c in range(1, 6)]
    assert all(a > b for a, b in itertools.pairwise(shares)) and shares[-1] < 0.001
    assert tail().miss_share(1) > 0.2
    # prefill at a tenth of the price: a full 1,024-token chunk adds 15 ms, within any request's slack
    cheap = replace(PROFILE, per_prefill_token_s=0.000015, per_prefill_pair_s=0.0)
    assert tail(cheap).miss_share(1) == 0.0
    assert tail(outputs=(1,) * 64).miss_share(1) == 0.0  # one-token answers have no TPOT
    # one replica 90% busy with prefill: 20-token answers mostly miss, 2,000-token ones (a Poisson count
    # of about 970 prompts routed to them while they decode) average the chunks out and mostly do not
    rate = 0.9 / prefill_occupancy(PROFILE, 1000, decoding=1, context=2000)
    busy = [TpotTail(PROFILE, rate=rate, prompt=1000, cached=0, context=2000, in_decode=1,
                     outputs=(n,) * 64, tpot_slo_s=0.1).miss_share(1) for n in (20, 2000)]
    assert busy[0] > 0.5 > 0.05 > busy[1] > 0.0
    # the same prompts with nine tenths of them in the prefix cache add a tenth to the steps
    cached = TpotTail(PROFILE, rate=4.0, prompt=1000, cached=900, context=1002, in_decode=0.5,
                      outputs=output_quantiles(4, 2.8), tpot_slo_s=0.1)
    assert cached.miss_share(1) < 0.01


def test_output_lengths_keep_their_mean_log_normal_with_a_spread_and_geometric_without() -> None:
    lognormal = output_quantiles(40, 28)
    assert statistics.fmean(lognormal) == pytest.approx(40, rel=0.02)
    assert statistics.pstdev(lognormal) == pytest.approx(28, rel=0.1)
    geometric = output_quantiles(40, None)  # the most spread a mean of 40 allows: sd about 39.5
    assert statistics.fmean(geometric) == pytest.approx(40, rel=0.02)
    assert statistics.pstdev(geometric) == pytest.approx(math.sqrt(40 * 39), rel=0.1)
    assert set(output_quantiles(6.4, 0.0)) == {6} and set(output_quantiles(0.5, None)) == {1}
    assert min(geometric) == 1 < min(lognormal)  # without a spread, more answers are short


def test_kv_demand_scales_up_when_the_cache_is_small() -> None:
    small_cache = ReplicaProfile(**{**PROFILE.to_json(), "kv_capacity_tokens": 8_192, "points": ()})
    replicas, reason = plan_for(2.0, prompt=1000, output=400, profile=small_cache, current=4)
    needs = work_needs(small_cache, rate=2.0, mean_prompt=1000, mean_output=400, ttft_slo_s=1.0,
                       tpot_slo_s=0.1)
    assert needs is not None and needs.kv > max(needs.prefill, needs.decode)
    assert replicas == needs.kv > 4 and f"KV {replicas} (" in reason


def test_a_rate_at_a_step_of_the_count_does_not_scale_down_within_the_tolerance() -> None:
    # find the rate at which prefill needs 3 instead of 2 replicas, then sit just under it
    rate = 0.5
    while (work_needs(PROFILE, rate=rate, mean_prompt=1500, mean_output=50, ttft_slo_s=1.0,
                      tpot_slo_s=0.1) or pytest.fail("unknown")).replicas < 3:
        rate += 0.05
    under = rate - 0.05
    assert plan_for(under, prompt=1500, output=50, current=2)[0] == 2
    held, _ = plan_for(under * (1 - CONFIG.tolerance / 2), prompt=1500, output=50, current=3)
    assert held == 3  # within the tolerance of the step: no scale-down
    down, _ = plan_for(under * 0.5, prompt=1500, output=50, current=3)
    assert down < 3  # well under it: the work no longer holds the fleet


def test_unknown_sizes_or_no_traffic_propose_nothing_from_work() -> None:
    unknown = offered_work(PROFILE, CONFIG, request_rate=2.0, mean_prompt_tokens=None,
                           mean_output_tokens=None)
    assert unknown is None
    _, reason = plan_for(0.0, prompt=500, output=50)
    assert reason == ""


def test_a_prefill_longer_than_the_slo_holds_its_queue_to_its_own_length_not_to_max_replicas() -> None:
    slow = ReplicaProfile(**{**PROFILE.to_json(), "per_prefill_token_s": 0.002, "points": ()})
    replicas, reason = plan_for(0.5, prompt=1000, output=20, profile=slow)
    assert replicas < CONFIG.max_replicas and "it alone is over the 1s TTFT SLO" in reason


def backlog_plan(waitings: list[float], ttft: float, *, starting: int = 0, window_s: float | None = None,
                 readies: list[int] | None = None) -> list[tuple[int, str]]:
    """Ticks 5 s apart of a 1-replica fleet (a rate the work sizes at 1 replica) whose queue reads
    ``waitings``, with P95 TTFT ``ttft`` over a metrics window of ``window_s``: the final count and the
    backlog proposal's reason at each tick. ``readies``: the ready replicas at each tick (the fleet is at
    the last of them), else all of them."""
    rate, prompt, output = 2.0, 300.0, 50.0
    work = offered_work(PROFILE, CONFIG, request_rate=rate, mean_prompt_tokens=prompt,
                        mean_output_tokens=output)
    assert work is not None and work.replicas == 1
    readies = readies or [1 - starting] * len(waitings)
    state, out = new_state(CONFIG), []
    for tick, (waiting, ready) in enumerate(zip(waitings, readies, strict=True)):
        metrics = {**QUIET, "waiting_per_replica": waiting, "ttft_p95_s": ttft}
        obs = Observation(now=1000.0 + 5 * tick, wall=1000.0 + 5 * tick, current=ready + starting,
                          ready=ready, starting=starting, metrics=metrics, request_rate=rate,
                          mean_prompt_tokens=prompt, mean_output_tokens=output, work=work,
                          rate_window_s=window_s)
        plan, state = decide(obs, state, CONFIG, [])
        reasons = [p.reason for p in plan.decision.proposals if p.source == "backlog"]
        out.append((plan.replicas, reasons[0] if reasons else ""))
    return out


def test_a_growing_queue_over_the_slo_adds_a_replica_the_work_model_does_not_see() -> None:
    # the work says 1 replica is enough, yet requests pile up and wait past the SLO: the model
    # under-prices what this fleet serves, and what the fleet shows wins, one replica at a time
    first, grown = backlog_plan([20.0, 40.0], ttft=3.0)
    assert first == (1, "")  # one reading is no trend
    assert grown[0] == 2
    assert "40 waiting per replica (10.0x target, 20 a tick before)" in grown[1]
    assert "P95 TTFT 3.00s (3.0x SLO)" in grown[1] and "the work sizes 1" in grown[1]


def test_a_queue_under_its_target_that_grows_past_the_slo_adds_a_replica() -> None:
    # long prompts: two waiting per replica already take a request past the SLO, well under the target of 4
    assert backlog_plan([1.0, 2.0], ttft=1.4)[-1][0] == 2


def test_a_backlog_replica_waits_for_a_ttft_window_measured_with_the_last_replica_ready() -> None:
    # a replica became ready at the second tick; P95 TTFT over the 30 s window still holds requests that
    # waited for the smaller fleet, so a short queue growing under its target is not yet this fleet's
    ticks = 8  # the window has passed since the replica became ready (5 s) at the last tick (35 s)
    short = backlog_plan([float(i % 2) for i in range(ticks)], ttft=1.4, window_s=30.0,
                         readies=[1] + [2] * (ticks - 1))
    assert [n for n, _ in short[1:-1]] == [2] * 6, "within the window: no replica on a short queue"
    assert short[-1][0] == 3 and "while the work sizes 1" in short[-1][1]
    # a queue over its target and growing shows this fleet short at once
    deep = backlog_plan([8.0, 12.0, 16.0], ttft=1.4, window_s=30.0, readies=[1, 2, 2])
    assert deep[-1][0] == 3


@pytest.mark.parametrize(("waitings", "ttft", "starting", "why"), [
    ([40.0, 20.0], 3.0, 0, "a queue that shrinks is being served"),
    ([40.0, 40.0], 3.0, 0, "a queue that holds is not a growing backlog"),
    ([0.0, 0.0], 3.0, 0, "no queue: TTFT is the prompts' own prefill, not waiting"),
    ([20.0, 40.0], 1.05, 0, "TTFT within the tolerance of the SLO: long prompts, not a backlog"),
    ([20.0, 40.0], 3.0, 1, "a replica still starting is capacity on its way"),
])
def test_no_backlog_replica_without_a_growing_queue_a_missed_slo_and_every_replica_ready(
        waitings: list[float], ttft: float, starting: int, why: str) -> None:
    assert backlog_plan(waitings, ttft, starting=starting)[-1] == (1, ""), why


@pytest.mark.parametrize(("count", "mean"), [(0, 3.0), (1, 1.0), (5, 18.0), (18, 18.0), (37, 18.0),
                                             (91, 60.0), (1200, 970.0), (3, 0.0)])
def test_the_poisson_tail_is_exact_on_either_side_of_the_mean(count: int, mean: float) -> None:
    """P(K >= count): scipy's survival function is the reference, from the bulk to far out in the tail
    and past ``exp(-mean)``'s underflow."""
    assert poisson_at_least(count, mean) == pytest.approx(poisson.sf(count - 1, mean), rel=1e-9, abs=1e-300)


def test_the_gateways_in_flight_limit_caps_the_decode_batch_the_work_is_sized_on() -> None:
    """Short requests at 20 per second fit one replica decoding at batch 64. Gateways that let a replica
    hold one request at a time (``max_inflight_per_replica = 1``) make every replica decode one sequence:
    the decode term counts the sequences decoding at once as replicas, and the note says why. A limit at or
    over the engine's batch changes nothing."""
    obs = Observation(now=100.0, wall=100.0, current=1, ready=1, starting=0, metrics=QUIET,
                      request_rate=20.0, mean_prompt_tokens=8.0, mean_output_tokens=48.0, rate_window_s=4.0)
    state = new_state(CONFIG)
    free = with_work(obs, state, CONFIG, PROFILE)
    assert free.work is not None and free.work.replicas == 1
    for limit in (None, PROFILE.max_num_seqs, 1000):
        same = with_work(obs, state, CONFIG, PROFILE, inflight_limit=limit)
        assert same.work == free.work and same.notes == free.notes
    capped = with_work(obs, state, CONFIG, PROFILE, inflight_limit=1)
    step = decode_batch(replace(PROFILE, max_num_seqs=1), 8.0 + 24.0, CONFIG.tpot_slo_s)[1]
    assert capped.work is not None and capped.work.decode == math.ceil(20.0 * 48 * step) > 1
    assert "at batch 1," in capped.work.reason
    assert any(n.startswith("the gateways let a replica hold 1 request(s) at once") for n in capped.notes)
    plan, _ = decide(capped, state, CONFIG, [])
    assert plan.replicas > 1
