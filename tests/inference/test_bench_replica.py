"""The replica benchmark's search for the sustained rate (``python -m inference.bench replica --sustained``),
on a made-up replica whose p99 TTFT jumps past the SLO above a known rate: the search's arithmetic, not a
measurement (the benchmark itself measures a real replica; its figures are in the README)."""

from __future__ import annotations

import argparse

import pytest

from inference.bench import replica
from inference.bench.datasets import DatasetConfig
from inference.bench.replica import Probe, search_sustained, sustained_line
from inference.bench.report import Distribution, LoadSummary


def summary(rate: float, ttft_p99_ms: float, failed: int = 0) -> LoadSummary:
    return LoadSummary(num_requests=40, num_completed=40 - failed, num_failed=failed, duration=40 / rate,
                       total_input_tokens=0, total_output_tokens=2_560, request_throughput=rate,
                       output_throughput=64 * rate, ttft=Distribution(count=40, p99=ttft_p99_ms),
                       tpot=Distribution(count=40, p99=20.0), itl=Distribution(), e2el=Distribution(),
                       goodput=None, errors={}, replicas={}, server_timings={})


def args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replica.add_arguments(parser)
    return parser.parse_args(["--sustained", "--num-requests", "40"])


@pytest.fixture
def capacity(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """A replica that holds up to 7.3 req/s; records each probe's rate and request count."""
    asked: list[tuple[float, int]] = []

    def probe(a: argparse.Namespace, base_url: str, rate: float, dataset: DatasetConfig,
              probes: list[Probe]) -> Probe:
        asked.append((rate, dataset.num_requests))
        result = Probe(rate, summary(rate, 300.0 if rate <= 7.3 else 2_500.0), a.ttft_slo_ms, a.tpot_slo_ms)
        probes.append(result)
        return result

    monkeypatch.setattr(replica, "_probe", probe)
    return asked


def test_doubles_from_the_best_fixed_rate_then_bisects_to_the_sustained_rate(
        capacity: list[tuple[float, int]]) -> None:
    a = args()
    fixed = [Probe(r, summary(r, 300.0 if r <= 4 else 1_800.0), 1000.0, 100.0) for r in (1.0, 4.0, 16.0)]
    probes = search_sustained(a, "http://127.0.0.1:1", fixed)
    assert [r for r, _ in capacity] == [4.0, 8.0, 6.0, 7.0, 7.5, 7.25]
    assert [n for _, n in capacity] == [80, 160, 120, 140, 150, 145]  # 20 s of arrivals each
    line = sustained_line(probes, a)
    assert line.startswith("sustained rate (TTFT p99 <= 1000 ms, TPOT p99 <= 100 ms, no failure, 20 s "
                           "probes): 7.25 req/s (464.0 output tok/s; TTFT p99 300.0 ms, TPOT p99 20.0 ms)")
    assert line.endswith("; 7.50 req/s missed (TTFT p99 2500.0 ms)")


def test_halves_when_even_the_lowest_fixed_rate_misses(capacity: list[tuple[float, int]]) -> None:
    a = args()
    fixed = [Probe(r, summary(r, 300.0, failed=1), 1000.0, 100.0) for r in (16.0, 32.0)]  # a failure
    search_sustained(a, "http://127.0.0.1:1", fixed)
    assert [r for r, _ in capacity][:2] == [16.0, 8.0] and capacity[2][0] == 4.0
    assert capacity[3][0] == 6.0  # then between 4 (held) and 8 (missed)


def test_a_replica_that_holds_nothing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(a: argparse.Namespace, base_url: str, rate: float, dataset: DatasetConfig,
              probes: list[Probe]) -> Probe:
        probes.append(Probe(rate, summary(rate, 5_000.0), a.ttft_slo_ms, a.tpot_slo_ms))
        return probes[-1]

    monkeypatch.setattr(replica, "_probe", never)
    a = args()
    probes = search_sustained(a, "http://127.0.0.1:1", [Probe(1.0, summary(1.0, 5_000.0), 1000.0, 100.0)])
    assert probes and probes[-1].rate >= replica.MIN_RATE / 2
    assert sustained_line(probes, a).endswith(": none of the rates probed held")
