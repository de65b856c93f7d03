"""``python -m controlplane.bench gateway``: the round plan, and a small real run (structure, no timings).

The real run starts one replica and a gateway process; it asserts what the report is made of (every
request answered on its route, counts, ordered percentiles, finite added latencies), never how fast.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from controlplane.bench import ROUTES, main, round_plan, run_gateway_bench

LEVELS = (1, 4)
REQUESTS = 20


def test_round_plan_splits_requests_evenly_in_abba_rounds_of_at_least_c() -> None:
    plan = round_plan(10, round_size=2, concurrency=1)
    assert plan == [("direct", 2), ("gateway", 2), ("gateway", 2), ("direct", 2), ("direct", 1),
                    ("gateway", 1)]
    big_c = round_plan(400, round_size=50, concurrency=64)
    assert {count for _, count in big_c[:-2]} == {64}
    totals = Counter[str]()
    for route, count in big_c:
        totals[route] += count
    assert totals == {"direct": 200, "gateway": 200}


def test_round_plan_refuses_fewer_than_one_request_per_route() -> None:
    with pytest.raises(ValueError, match="need >= 2 requests"):
        round_plan(1, round_size=50, concurrency=1)


def test_gateway_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["gateway", "--help"])
    assert exc.value.code == 0
    assert "--levels" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_small_run_answers_every_request_on_both_routes(tmp_path: Path) -> None:
    result = run_gateway_bench(LEVELS, REQUESTS, round_size=5, state_dir=tmp_path)

    assert [level.concurrency for level in result.levels] == list(LEVELS)
    assert result.gateway_counters == {"retries": 0, "resumes": 0, "rejected": 0}
    for level in result.levels:
        assert len(level.samples) == REQUESTS
        assert not level.failures, level.failures[:3]
        assert Counter(s.route for s in level.samples) == {route: REQUESTS // 2 for route in ROUTES}
        for stats in (level.direct, level.gateway):
            assert stats.num_requests == stats.num_succeeded == REQUESTS // 2
            for pair in (stats.ttft, stats.e2e, stats.overhead):
                assert pair.p50 <= pair.p99
            assert 0 < stats.ttft.p50 <= stats.e2e.p50
        for added in (level.added_ttft, level.added_overhead, level.added_e2e):
            assert math.isfinite(added.p50) and math.isfinite(added.p99)
    assert result.machine.num_cpus >= 1
