"""The gateway bench's verdict and report on synthetic samples: no replica, no gateway, no load."""

from __future__ import annotations

import json
import math

import pytest

from controlplane.bench.layout import SHARED
from controlplane.bench.load import RequestSample, Route
from controlplane.bench.report import (
    TARGET_ADDED_P50_S,
    GatewayBenchResult,
    LevelResult,
    MachineNote,
    format_report,
    judge_interval,
    sample_lines,
)
from controlplane.bench.stats import Interval


def samples(route: Route, ttft_s: float, *, rounds: int = 8, per_round: int = 10) -> list[RequestSample]:
    """Steady requests: TTFT ``ttft_s`` (a little spread), 1 ms of it queued and 4 ms prefilling."""
    return [RequestSample(route, r, ttft_s=ttft_s + 0.0001 * i, e2e_s=ttft_s + 0.05, replica_queue_s=0.001,
                          replica_prefill_s=0.004)
            for r in range(rounds) for i in range(per_round)]


def level(concurrency: int, direct_s: float, gateway_s: float) -> LevelResult:
    return LevelResult(concurrency, (*samples("direct", direct_s), *samples("gateway", gateway_s)), 12.0,
                       gateway_cpu_s=0.08)


def result(*levels: LevelResult, counters: dict[str, float] | None = None) -> GatewayBenchResult:
    return GatewayBenchResult(levels, MachineNote(2, 2, (0.5, 0.4, 0.3), (1.5, 0.9, 0.4)), "process", 50, 16,
                              1, 128, SHARED, counters or {"retries": 0.0, "resumes": 0.0})


def test_a_level_passes_when_the_added_ttft_is_within_both_targets() -> None:
    fast = level(1, direct_s=0.010, gateway_s=0.011)
    assert fast.added_ttft.p50 == pytest.approx(0.001) and fast.is_pass
    assert fast.gateway_cpu_per_request_s == 0.08 / 80
    slow = level(16, direct_s=0.010, gateway_s=0.025)
    assert not slow.is_pass and not result(fast, slow).is_pass
    assert result(fast).is_pass and not result(fast, counters={"retries": 3.0}).is_pass


def test_the_report_says_what_ran_each_levels_verdict_and_the_overall_one() -> None:
    report = format_report(result(level(1, 0.010, 0.011), level(16, 0.010, 0.025)))
    lines = report.splitlines()
    assert lines[0].startswith("gateway bench: 1 replica (1 torch threads, max 128 seqs), gateway in its own "
                               "process; streaming /v1/completions, max_tokens 16")
    assert "CPU layout: shared (replica, gateway and load client on any CPU)" in lines
    assert any(line.startswith("C=1: added TTFT p50 1.00 ms") and line.endswith("PASS") for line in lines)
    assert any(line.startswith("C=16: added TTFT p50 15.00 ms") and line.endswith("FAIL") for line in lines)
    assert "gateway CPU per request relayed: C=1 1.00 ms, C=16 1.00 ms" in lines
    assert lines[-2].startswith("machine: 2 CPUs (2 usable); load average 1/5/15 min before 0.50 0.40 0.30")
    assert lines[-1] == "overall: FAIL"


def drifting(route: Route, ttft_s: float, swing_s: float, *, rounds: int = 8,
             per_round: int = 10) -> list[RequestSample]:
    """Rounds whose TTFT swings by ``swing_s`` from one round to the next: the interval is wide."""
    return [RequestSample(route, r, ttft_s=ttft_s + swing_s * (r % 2) + 0.0001 * i, e2e_s=ttft_s + 0.05,
                          replica_queue_s=0.001, replica_prefill_s=0.004)
            for r in range(rounds) for i in range(per_round)]


def test_the_verdict_judges_the_upper_end_of_each_interval() -> None:
    """An estimate under the target whose interval reaches past it is not a pass."""
    assert judge_interval(Interval(0.0005, 0.0015), 0.002) == "pass"
    assert judge_interval(Interval(0.0025, 0.004), 0.002) == "fail"
    assert judge_interval(Interval(0.001, 0.003), 0.002) == "not resolved"
    assert judge_interval(Interval(math.nan, math.nan), 0.002) == "not resolved"
    wide = LevelResult(16, (*samples("direct", 0.010), *drifting("gateway", 0.010, 0.004)), 12.0)
    interval = wide.added_ttft_interval.p50
    assert wide.added_ttft.p50 < TARGET_ADDED_P50_S < interval.high and interval.low < TARGET_ADDED_P50_S
    assert wide.outcome == "not resolved" and not wide.is_pass
    fast = level(1, direct_s=0.010, gateway_s=0.011)
    run = result(fast, wide)
    assert run.outcome == "not resolved"
    lines = format_report(run).splitlines()
    assert any(line.startswith("C=16: added TTFT p50") and "not resolved" in line
               and line.endswith("NOT RESOLVED") for line in lines)
    assert lines[-1] == "overall: NOT RESOLVED"
    assert result(fast, level(16, 0.010, 0.025), wide).outcome == "fail"  # a miss outranks it


def test_too_few_rounds_to_draw_an_interval_is_not_a_pass() -> None:
    one_round = LevelResult(1, (*samples("direct", 0.010, rounds=1), *samples("gateway", 0.0101, rounds=1)),
                            1.0)
    assert math.isnan(one_round.added_ttft_interval.p50.low)
    assert one_round.outcome == "not resolved"
    assert "[95% CI: too few rounds]" in format_report(result(one_round))


def test_every_request_of_a_run_is_one_json_line_to_analyse_it_again() -> None:
    ran = result(level(1, 0.010, 0.011), level(16, 0.010, 0.012))
    rows = [json.loads(line) for line in sample_lines(ran)]
    assert len(rows) == sum(len(lv.samples) for lv in ran.levels) == 320
    first = rows[0]
    assert first == {"control_plane": "idle", "concurrency": 1, "route": "direct", "round": 0,
                     "counted": True, "ttft_s": 0.010, "e2e_s": pytest.approx(0.060),
                     "replica_queue_s": 0.001, "replica_prefill_s": 0.004, "error": None}
    assert {(r["concurrency"], r["route"]) for r in rows} == {(c, route) for c in (1, 16)
                                                            for route in ("direct", "gateway")}
