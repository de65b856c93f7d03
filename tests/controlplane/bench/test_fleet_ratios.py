"""The fleet benchmark's forked-over-exec'd line (``python -m controlplane.bench fleet --backend
local,local-exec``): medians of the same run's figures, "-" where a side measured nothing, and the verdict
on a replica's addition and restart."""

from __future__ import annotations

from controlplane.bench.fleet import FORK_TARGET, FleetBenchResult, FleetRun, fork_ratios, format_fork_ratios


def run(backend: str, n: int, added: float, rto: float | None, error: str | None = None) -> FleetRun:
    return FleetRun(backend, n, up_to_3_ready_s=10.0, spawn_to_3_ready_s=None, per_added_replica_s=added,
                    rto_capacity_s=rto, error=error)


def test_forked_over_exec_d_is_the_ratio_of_medians_and_says_what_it_did_not_measure() -> None:
    result = FleetBenchResult(runs=[
        run("local", 1, 1.0, 1.5), run("local-exec", 1, 3.0, 3.0),
        run("local", 2, 1.2, 1.7), run("local-exec", 2, 3.4, 4.0),
        run("local", 3, 9.0, 9.0, error="TimeoutError: a failed run counts for nothing"),
    ])
    ratios = fork_ratios(result)
    assert ratios == {"up_to_3_ready_s": 1.0, "per_added_replica_s": round(1.1 / 3.2, 3),
                      "rto_capacity_s": round(1.6 / 3.5, 3)}
    line = format_fork_ratios(ratios)
    assert "spawn->3 ready -," in line and "per added 0.34" in line and "RTO_capacity 0.46" in line
    assert line.endswith(f"target <= {FORK_TARGET:g}: per_added_replica_s met, rto_capacity_s met")


def test_a_restart_no_faster_than_an_exec_misses_and_one_side_alone_gives_no_ratio() -> None:
    slow = FleetBenchResult(runs=[run("local", 1, 1.0, 3.0), run("local-exec", 1, 3.0, 3.0)])
    assert "rto_capacity_s NOT MET" in format_fork_ratios(fork_ratios(slow))
    assert fork_ratios(FleetBenchResult(runs=[run("local", 1, 1.0, 1.0)])) == {}
    assert format_fork_ratios({}).endswith("not measured")
