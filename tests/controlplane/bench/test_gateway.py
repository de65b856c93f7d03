"""``python -m controlplane.bench gateway``: the round plan, and a small real run (structure, no timings).

The real run starts one replica and a gateway process; it asserts what the report is made of (every
request answered on its route, counts, ordered percentiles, finite added latencies), never how fast.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from controlplane.bench.__main__ import main
from controlplane.bench.gateway import format_report, run_gateway_bench
from controlplane.bench.load import ROUTES, round_plan, ticket_plan
from controlplane.config import STATE_DIR_ENV

pytestmark = pytest.mark.exclusive

LEVELS = (1, 4)
REQUESTS = 20


def test_round_plan_splits_requests_evenly_in_abba_rounds_of_at_least_4_c() -> None:
    plan = round_plan(20, round_size=5, concurrency=1)
    assert plan == [("direct", 5), ("gateway", 5), ("gateway", 5), ("direct", 5)]
    big_c = round_plan(2048, round_size=50, concurrency=64)
    assert [count for _, count in big_c] == [256] * 8
    totals = Counter[str]()
    for route, count in big_c:
        totals[route] += count
    assert totals == {"direct": 1024, "gateway": 1024}


def test_ticket_plan_warms_both_routes_and_skips_the_first_c_of_each_round() -> None:
    tickets = ticket_plan(16, round_size=4, concurrency=2)  # rounds of 8: direct 8, gateway 8
    assert [(t.route, t.round_index, t.counted) for t in tickets[:4]] == \
        [("direct", -1, False), ("direct", -1, False), ("gateway", -1, False), ("gateway", -1, False)]
    rounds = [[t for t in tickets if t.round_index == i] for i in (0, 1)]
    assert [t.route for t in rounds[0]] == ["direct"] * 8 and [t.route for t in rounds[1]] == ["gateway"] * 8
    for round_ in rounds:
        assert [t.counted for t in round_] == [False, False] + [True] * 6


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
        c = level.concurrency
        assert len(level.samples) == REQUESTS + 2 * c  # a warm-up of C per route
        assert not level.failures, level.failures[:3]
        assert Counter(s.route for s in level.samples) == {route: REQUESTS // 2 + c for route in ROUTES}
        counted = REQUESTS // 2 - len(round_plan(REQUESTS, round_size=5, concurrency=c)) // 2 * c
        for stats in (level.direct, level.gateway):
            assert stats.num_requests == stats.num_succeeded == counted > 0
            for pair in (stats.ttft, stats.e2e, stats.overhead):
                assert pair.p50 <= pair.p99
            assert 0 < stats.ttft.p50 <= stats.e2e.p50
        for added in (level.added_ttft, level.added_overhead, level.added_e2e):
            assert math.isfinite(added.p50) and math.isfinite(added.p99)
        cpu = level.gateway_cpu_per_request_s  # the gateway runs in its own process: /proc has its time
        assert cpu is not None and 0 <= cpu < level.wall_s
    assert result.machine.num_cpus >= 1
    report = format_report(result)
    assert result.client_policy == "SCHED_BATCH" or result.client_policy.startswith("default (SCHED_BATCH "
                                                                                    "unavailable: ")
    assert f"load client scheduling: {result.client_policy}" in report
    assert "gateway CPU per request relayed: C=1 " in report and "unknown" not in report


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    return [child.pid for child in psutil.Process(pid).children() if _alive(child.pid)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_mid_run_stops_the_replica_and_the_gateway(tmp_path: Path) -> None:
    """Stopped by ``kill`` (or a CI timeout) in the middle of a level, the benchmark stops what it started:
    before, SIGTERM ended it without its ``finally`` blocks and left the replica and the gateway running."""
    env = {**os.environ, STATE_DIR_ENV: str(tmp_path)}
    bench = subprocess.Popen([sys.executable, "-m", "controlplane.bench", "gateway", "--levels", "1",
                              "--requests", "100000"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert bench.stderr is not None
        for line in bench.stderr:  # the replica and the gateway are up once this is logged
            if "gateway (process) on" in line:
                break
        else:
            pytest.fail(f"the benchmark exited before it started its processes (rc {bench.wait()})")
        time.sleep(1.0)  # into the level
        started = _children(bench.pid)
        assert len(started) >= 2, started  # the replica and the gateway (and any helper of theirs)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130
    assert "interrupted: the benchmark stopped what it started" in err
    deadline = time.monotonic() + 10  # an exiting child may take a moment to be reaped
    while (left := [pid for pid in started if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], [" ".join(psutil.Process(pid).cmdline())[:200] for pid in left]
