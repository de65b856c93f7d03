"""The drill benchmark's pooled figures and verdict: a figure no run measured is "not measured", never 0,
and the benchmark fails when a target of the scenario is missed or not measured."""

from __future__ import annotations

import dataclasses
from typing import Any

from chaos.drill_bench import format_table, is_pass, judge, summarize, verdict_lines
from chaos.scenarios import SCENARIOS

TARGETS = SCENARIOS["zone-outage"].targets


def report(**figures: Any) -> dict[str, Any]:
    base = {"rto_service_s": 0.2, "outages_s": [0.1, 0.2], "rto_capacity_s": 6.0, "requests_total": 40,
            "requests_failed": 0, "requests_resumed": 1, "tokens_lost": 0, "tokens_duplicated": 0,
            "writes_lost": 0}
    return {"id": 1, "status": "passed", "figures": {**base, **figures}}


def judged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarize(reports)
    summary["checks"] = [dataclasses.asdict(c) for c in judge(summary, TARGETS)]
    return {"2": summary}


def test_runs_within_the_scenarios_targets_pass() -> None:
    results = judged([report(), report(rto_service_s=0.4, outages_s=[0.4])])
    assert is_pass(results)
    summary = results["2"]
    assert summary["rto_service_max_s"] == 0.4 and summary["requests_sent"] == 80
    assert all(line.endswith("PASS") for line in verdict_lines(results))


def test_a_figure_one_run_did_not_measure_is_not_measured_and_fails() -> None:
    results = judged([report(), report(writes_lost=None, rto_capacity_s=None)])
    summary = results["2"]
    assert summary["writes_lost"] is None and summary["rto_capacity_max_s"] is None
    assert summary["rto_capacity_median_s"] is None and not is_pass(results)
    lines = verdict_lines(results)
    assert "2 req/s: writes_lost not measured (target <= 0): NOT MEASURED" in lines
    assert "| acknowledged writes lost | not measured |" in format_table(results)


def test_a_run_that_ended_in_an_error_leaves_every_pooled_figure_unmeasured() -> None:
    results = judged([report(), {"id": 2, "status": "error", "error": "LoadNotFlowing: ..."}])
    summary = results["2"]
    assert summary["measured"] == 1 and summary["requests_failed"] is None
    assert summary["rto_service_max_s"] is None and summary["errors"] == ["LoadNotFlowing: ..."]
    checks = {c["name"]: c for c in summary["checks"]}
    assert checks["runs_not_passed"]["measured"] == 1 and not checks["runs_not_passed"]["ok"]
    assert not is_pass(results)


def test_a_missed_target_fails_the_benchmark() -> None:
    slow = judged([report(rto_service_s=TARGETS.rto_service_s + 0.5, outages_s=[1.5])])
    assert not is_pass(slow)
    assert "2 req/s: rto_service_max_s 1.500 (target <= 1.000): FAIL" in verdict_lines(slow)
    lost = judged([report(requests_failed=2)])
    assert not is_pass(lost)
