"""The drill figures derived from a synthetic client timeline, with every expected value worked out by hand.

The timeline (wall clock, t0 = 100.0; replica r1 is the fault's target, r2 survives):

    A  r1  sent 98.0, tokens 98.2 98.3 98.4, done 98.5         baseline: ITL 0.1, TTFT 0.2
    B  r2  sent 98.5, tokens 98.7 98.8 98.9, done 99.0         baseline
    C  r1  sent 99.6, tokens 99.8 99.9 100.0 | 100.5 100.6     in flight on the target, 0.5 s gap: resumed
    D  r2  sent 99.7, tokens 99.9 100.0 100.1 100.2            undisturbed (2 tokens too many in usage)
    E  r1  sent 100.2, fails at 100.4 without a token          failed
    F  r2  sent 100.3, tokens 100.45 100.55                    first new request on a survivor (1 token short)
    G  r1  sent 99.8, tokens 100.0 100.1 | 100.35 100.45       in flight on the target, 0.25 s gap
    H  r2  sent 100.9, tokens 101.0 101.1
    I  r2  sent 101.6, tokens 101.7 101.8

Thresholds from the baseline: detect 1.5 x 0.1 = 0.15 s, disrupt 3 x 0.1 = 0.3 s (first token: 3 x 0.2 = 0.6).
"""

from __future__ import annotations

import pytest

from chaos.drill_figures import client_loss
from chaos.drills import (
    ClientRequest,
    Figures,
    FleetSample,
    Thresholds,
    Timings,
    client_timeline,
    derive_figures,
    percentile,
    predict,
    verdict,
)
from chaos.scenarios import SCENARIOS, SloTarget, Targets, scenario
from inference.bench.report import RequestRecord

T0 = 100.0
SLO = SloTarget(ttft_p99_s=0.4, error_rate=0.0, window_s=0.5, windows=2)


def req(index: int, replica: str, send: float, tokens: list[float], *, ok: bool = True,
        end: float | None = None, owed: int | None = None, got: int | None = None) -> ClientRequest:
    owed = len(tokens) if owed is None else owed
    return ClientRequest(index=index, send=send, first_token=tokens[0] if tokens else None,
                         token_times=tuple(tokens), end=end if end is not None else (tokens[-1] + 0.05),
                         ok=ok, replica_id=replica, output_len=owed,
                         completion_tokens=(len(tokens) if got is None else got) if ok else None,
                         error_kind=None if ok else "stream_cut")


TIMELINE = [
    req(0, "r1", 98.0, [98.2, 98.3, 98.4]),
    req(1, "r2", 98.5, [98.7, 98.8, 98.9]),
    req(2, "r1", 99.6, [99.8, 99.9, 100.0, 100.5, 100.6]),
    req(3, "r2", 99.7, [99.9, 100.0, 100.1, 100.2], got=6),
    req(4, "r1", 100.2, [], ok=False, end=100.4, owed=3),
    req(5, "r2", 100.3, [100.45, 100.55], got=1),
    req(6, "r1", 99.8, [100.0, 100.1, 100.35, 100.45]),
    req(7, "r2", 100.9, [101.0, 101.1]),
    req(8, "r2", 101.6, [101.7, 101.8]),
]
SAMPLES = [FleetSample(99.0, 2, 2), FleetSample(100.2, 2, 2), FleetSample(100.6, 1, 2),
           FleetSample(101.0, 1, 2), FleetSample(103.0, 2, 2), FleetSample(104.0, 2, 2)]


@pytest.fixture
def figures() -> Figures:
    return derive_figures(TIMELINE, SAMPLES, t0=T0, slo=SLO, fault_targets=["r1"])


def test_thresholds_come_from_the_requests_that_ended_before_t0() -> None:
    th = Thresholds.from_baseline(TIMELINE, T0)
    assert th.detect_gap_s == pytest.approx(0.15)
    assert th.disrupt_gap_s == pytest.approx(0.3)
    assert th.disrupt_ttft_s == pytest.approx(0.6)


def test_detection_is_the_first_moment_a_client_waited_past_the_threshold(figures: Figures) -> None:
    # C stalled from 100.0: seen at 100.15; G from 100.1: at 100.25; E failed at 100.4 (seen at 100.35)
    assert figures.t_detect == pytest.approx(100.15)
    assert figures.requests_affected == 3  # C, E, G


def test_switch_is_the_first_token_of_a_new_request_on_a_survivor(figures: Figures) -> None:
    assert figures.t_switch == pytest.approx(100.45)  # F, sent at 100.3 >= t_detect, served by r2


def test_service_rto_runs_to_the_last_affected_stream_flowing_again(figures: Figures) -> None:
    assert figures.t_first_ok == pytest.approx(100.35)  # G's token after its gap
    assert figures.t_service == pytest.approx(100.5)  # C's token after its gap
    assert figures.rto_service_s == pytest.approx(0.5)
    assert figures.outages_s == pytest.approx([0.25, 0.5])
    assert figures.rto_service_p99_s == pytest.approx(0.25 + 0.25 * 0.99)


def test_slo_is_back_at_the_first_of_two_consecutive_met_windows(figures: Figures) -> None:
    # [100.0, 100.5): E's failure; [100.5, 101.0): C's 0.5 s gap > 0.4; [101.0, 101.5) H; [101.5, 102) I
    assert figures.t_slo == pytest.approx(101.0)
    assert figures.rto_slo_s == pytest.approx(1.0)
    assert figures.baseline_slo_met is True


def test_capacity_is_back_from_the_sample_after_which_it_never_dropped(figures: Figures) -> None:
    assert figures.t_capacity == pytest.approx(103.0)
    assert figures.rto_capacity_s == pytest.approx(3.0)


def test_capacity_never_back_within_the_samples_is_none() -> None:
    fig = derive_figures(TIMELINE, SAMPLES[:4], t0=T0, slo=SLO, fault_targets=["r1"])
    assert fig.t_capacity is None and fig.rto_capacity_s is None


def test_a_rollout_in_progress_is_not_capacity_restored() -> None:
    samples = [FleetSample(100.5, 3, 3, changing=True), FleetSample(110.0, 3, 3, changing=False)]
    fig = derive_figures(TIMELINE, samples, t0=T0, slo=SLO)
    assert fig.rto_capacity_s == pytest.approx(10.0)


def test_rpo_counts_failures_and_tokens_against_what_each_stream_was_owed(figures: Figures) -> None:
    assert figures.requests_total == 9
    assert figures.requests_failed == 1
    assert figures.tokens_lost == 1  # F: 1 of 2
    assert figures.tokens_duplicated == 2  # D: 6 for 4


def test_relative_figures_are_seconds_after_t0(figures: Figures) -> None:
    rel = figures.relative()
    assert rel["t_detect"] == pytest.approx(0.15)
    assert rel["t_capacity"] == pytest.approx(3.0)
    assert rel["t0"] == T0


def test_a_slow_gap_on_the_target_after_its_capacity_came_back_is_not_the_fault_s(figures: Figures) -> None:
    """Capacity is back at 103.0 (SAMPLES): a request the restarted target served after that, with a gap
    past the threshold, leaves the service RTO and the affected count as they were."""
    later = req(9, "r1", 104.5, [104.6, 104.7, 106.0, 106.1])
    fig = derive_figures([*TIMELINE, later], SAMPLES, t0=T0, slo=SLO, fault_targets=["r1"])
    assert fig.t_capacity == pytest.approx(103.0)
    assert fig.rto_service_s == figures.rto_service_s and fig.requests_affected == figures.requests_affected
    during = req(9, "r1", 101.5, [101.6, 101.7, 103.0, 103.1])  # sent before capacity was back: counted
    assert derive_figures([*TIMELINE, during], SAMPLES, t0=T0, slo=SLO, fault_targets=["r1"]).rto_service_s \
        > figures.rto_service_s


def test_an_invisible_fault_has_no_detection_and_zero_service_rto() -> None:
    calm = [TIMELINE[0], TIMELINE[1], TIMELINE[3], TIMELINE[7], TIMELINE[8]]
    fig = derive_figures(calm, [FleetSample(100.1, 2, 2)], t0=T0, slo=SLO, fault_targets=["r1"])
    assert fig.t_detect is None and fig.t_first_ok is None
    assert fig.rto_service_s == 0.0 and fig.requests_affected == 0
    assert fig.rto_capacity_s == pytest.approx(0.1)


def test_verdict_fails_only_the_targets_that_were_missed(figures: Figures) -> None:
    checks = {c.name: c for c in verdict(figures, Targets(rto_service_s=1.0, rto_capacity_s=2.0))}
    assert checks["rto_service_s"].ok
    assert not checks["rto_capacity_s"].ok  # 3.0 > 2.0
    assert not checks["requests_failed"].ok and checks["requests_failed"].measured == 1
    assert not checks["writes_lost"].ok  # not measured on a synthetic timeline: a failed check
    assert "rto_slo_s" not in checks


def test_client_timeline_puts_offsets_on_the_wall_clock() -> None:
    record = RequestRecord(index=3, request_id="x-3", prompt_len=8, output_len=2, send_time=1.0,
                           send_wall=1000.0, first_token_time=1.5, token_times=[1.5, 1.75], end_time=2.0,
                           status=200, completion_tokens=2, replica_id="az-a-1")
    [c] = client_timeline([record])
    assert (c.send, c.first_token, c.token_times, c.end) == (1000.0, 1000.5, (1000.5, 1000.75), 1001.0)
    assert c.ok and c.replica_id == "az-a-1"


def test_prediction_adds_detection_reprefill_and_backlog() -> None:
    timings = Timings(replica_start_s=10.0, health_interval_s=1.0, reconcile_interval_s=0.5,
                      stall_timeout_s=2.0, first_byte_timeout_s=3.0, restart_backoff_s=0.5,
                      rollout_observe_s=10.0, replicas=3)
    crash = predict(scenario("replica-crash"), timings, num_hit=1, ttft_s=0.2, e2e_s=1.0)
    # displaced = 4 req/s x 1.0 s x 1/3; backlog = displaced x 0.2 s / 2 survivors
    assert crash.rto_service_s == pytest.approx(0.2 + 4 / 3 * 0.2 / 2, abs=1e-4)
    assert crash.rto_capacity_s == pytest.approx(0.5 + 0.5 + 10.0)
    hang = predict(scenario("replica-hang"), timings, num_hit=1, ttft_s=0.2, e2e_s=1.0)
    # open streams stall after 2 s; the gateway then moves the requests waiting on the silent replica too
    assert hang.rto_service_s == pytest.approx(2.0 + 0.2 + 4 / 3 * 0.2 / 2, abs=1e-4)
    assert hang.rto_capacity_s == pytest.approx(6.0 + 1.0)  # back at revert and the next probe
    roll = predict(scenario("rolling-update"), timings, num_hit=0, ttft_s=0.2, e2e_s=1.0)
    assert roll.rto_service_s == 0.0 and roll.rto_capacity_s == pytest.approx(3 * (10.0 + 10.0))


def test_every_shipped_scenario_is_there_with_targets() -> None:
    assert set(SCENARIOS) == {"replica-crash", "replica-hang", "zone-outage", "link-partition",
                              "device-failure", "kv-pressure", "rolling-update", "control-plane-crash",
                              "gateway-crash", "node-loss", "slice-error-rate"}
    # A killed gateway takes its clients' streams with it: that drill reports the loss, it cannot forbid it;
    # a slice experiment fails its experiment colour's requests on purpose, and forbids it to the rest.
    lossless = {k: s for k, s in SCENARIOS.items() if k not in ("gateway-crash", "slice-error-rate")}
    sliced = SCENARIOS["slice-error-rate"].targets
    assert (sliced.max_failed_requests, sliced.max_uncoloured_failed, sliced.max_slice_sides_missing) == \
        (None, 0, 0)
    assert sliced.max_slice_stop_s is not None
    assert all(s.targets.max_failed_requests == 0 for s in lossless.values())
    crash = SCENARIOS["control-plane-crash"].targets
    assert (crash.max_writes_lost, crash.max_faults_past_expiry, crash.max_orphans) == (0, 0, 0)
    assert crash.rto_api_s is not None and SCENARIOS["gateway-crash"].targets.rto_service_s is not None


def test_client_loss_tells_what_a_retry_recovers() -> None:
    """A killed gateway: one request failed before its first token (a retry recovers it), one mid-stream
    after two tokens (a retry would repeat them), and service is back with the next request sent."""
    t0 = 100.0
    before = ClientRequest(0, 99.0, 99.1, (99.1, 99.2), 99.3, True, "r0", 2, 2)
    cut = ClientRequest(1, 99.5, 99.6, (99.6, 99.7), 100.0, False, "r0", 4, None, "ServerDisconnected")
    refused = ClientRequest(2, 100.2, None, (), 100.2, False, None, 4, None, "ConnectError")
    back = ClientRequest(3, 101.5, 101.6, (101.6, 101.7), 101.8, True, "r1", 2, 2)
    loss = client_loss([before, cut, refused, back], t0)
    assert (loss.failed, loss.failed_before_first_token, loss.failed_mid_stream) == (2, 1, 1)
    assert loss.tokens_delivered_to_failed == 2
    assert loss.rto_service_s == pytest.approx(1.5)
    assert client_loss([before, back], t0).rto_service_s == 0.0


def test_overrides_are_checked_by_name_and_value() -> None:
    overrides = {"rate": 2, "targets.rto_service_s": 0.5, "max_tokens": 8.0}
    sc = scenario("replica-crash").with_overrides(overrides)
    assert (sc.rate, sc.targets.rto_service_s, sc.max_tokens) == (2, 0.5, 8)
    with pytest.raises(ValueError, match="bogus: unknown override"):
        scenario("replica-crash").with_overrides({"bogus": 1})
    with pytest.raises(ValueError, match="fault_at_s"):
        scenario("replica-crash").with_overrides({"fault_at_s": 99})
    with pytest.raises(KeyError, match="unknown 'nope'"):
        scenario("nope")


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([], 99) is None


def test_a_survivor_slowing_down_is_degradation_not_an_affected_request() -> None:
    slow = req(9, "r2", 100.1, [100.2, 100.9, 101.0])  # a 0.7 s gap on the survivor
    fig = derive_figures([*TIMELINE, slow], SAMPLES, t0=T0, slo=SLO, fault_targets=["r1"])
    assert fig.requests_affected == 3 and fig.rto_service_s == pytest.approx(0.5)
    # the SLO is about TTFT and errors: its TTFT (0.1 s at 100.2) leaves t_slo where it was
    assert fig.t_slo == pytest.approx(101.0)


def test_a_request_the_gateway_moved_off_the_target_before_its_first_token_is_affected() -> None:
    """It reached the client from a survivor, only late: the gateway said which replica it tried first."""
    moved = ClientRequest(index=9, send=100.1, first_token=101.2, token_times=(101.2, 101.3), end=101.35,
                          ok=True, replica_id="r2", output_len=2, completion_tokens=2, tried=("r1",))
    fig = derive_figures([*TIMELINE, moved], SAMPLES, t0=T0, slo=SLO, fault_targets=["r1"])
    assert fig.requests_affected == 4  # E, C, G and the moved one
    assert fig.rto_service_s == pytest.approx(1.2)  # its first token is the last affected one to flow
    assert fig.requests_failed == 1
    untouched = derive_figures([*TIMELINE, moved], SAMPLES, t0=T0, slo=SLO, fault_targets=["r3"])
    assert untouched.requests_affected == 1  # only the failure counts when r1 was not the target


def test_client_timeline_carries_what_the_gateway_tried() -> None:
    record = RequestRecord(index=0, request_id="r-0", prompt_len=4, output_len=2, send_time=1.0,
                           send_wall=1000.0)
    record.tried = ("az-a-1",)
    assert client_timeline([record])[0].tried == ("az-a-1",)
    assert RequestRecord.from_json(record.to_json()).tried == ("az-a-1",)


def test_an_rto_no_affected_stream_came_back_from_is_not_measured_and_fails_its_check() -> None:
    """Every stream the fault hit ended in an error: no recovery to time. The RTO is None, never 0, and
    the verdict says "not measured"."""
    cut = [TIMELINE[0], TIMELINE[1], req(2, "r1", 99.6, [99.8, 99.9, 100.0], ok=False, end=100.3),
           TIMELINE[4]]
    fig = derive_figures(cut, [FleetSample(100.1, 2, 2)], t0=T0, slo=SLO, fault_targets=["r1"])
    assert fig.requests_affected == 2 and fig.t_service is None
    assert fig.rto_service_s is None and fig.rto_service_p99_s is None
    check = next(c for c in verdict(fig, Targets(rto_service_s=1.0)) if c.name == "rto_service_s")
    assert (check.ok, check.outcome, check.measured) == (False, "not measured", None)


def test_a_drill_with_no_token_after_t0_measures_no_rto() -> None:
    before = [TIMELINE[0], TIMELINE[1]]  # the load ended before the fault: nothing seen after it
    fig = derive_figures(before, [FleetSample(100.1, 2, 2)], t0=T0, slo=SLO, fault_targets=["r1"])
    assert fig.requests_affected == 0 and fig.rto_service_s is None
