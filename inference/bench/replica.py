"""``python -m inference.bench replica``: one real replica under the load client at three request rates.

In the same run it measures the engine alone (in this process, before the replica starts, each prompt of
the lowest-rate run submitted alone) and reports the server's own overhead: client-side TTFT minus the
engine's offline TTFT for the same prompts, as a share of the client-side TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from inference.bench.datasets import DatasetConfig, build_requests, render_prompt
from inference.bench.report import LoadReport, format_table
from inference.bench.serve import LoadConfig, run_load
from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.launcher import ReplicaProcess, free_port, unwind_on_sigterm
from inference.models.default import ensure_default_model
from inference.sampling_params import SamplingParams

OVERHEAD_TARGET = 0.10


@dataclass(slots=True)
class RateResult:
    rate: float
    report: LoadReport


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="1,4,16", help="request rates (req/s), comma-separated")
    p.add_argument("--num-requests", type=int, default=60, help="requests per rate")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the engine and the replica")
    p.add_argument("--seed", type=int, default=0)


def offline_ttfts(dataset: DatasetConfig, threads: int) -> dict[int, float]:
    """Engine-only TTFT of each request, submitted alone (no HTTP, no serialization)."""
    engine = LLMEngine("default", EngineConfig(num_threads=threads))
    result: dict[int, float] = {}
    for request in build_requests(dataset):
        prompt = render_prompt(request, "token_ids", seed=dataset.seed, vocab_size=dataset.vocab_size)
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"offline-{request.index}", prompt, params)
        while True:
            outs = engine.step()
            if outs:
                result[request.index] = outs[0].metrics.ttft
                engine.abort_request(f"offline-{request.index}")
                break
    return result


def run_rates(args: argparse.Namespace, datasets: list[DatasetConfig],
              rates: list[float]) -> list[RateResult]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        replica = ReplicaProcess(free_port(), replica_id="bench-0", log_path=Path(tmp) / "replica.log",
                                 extra_args=["--num-threads", str(args.threads), "--max-waiting-requests",
                                             "100000", "--max-waiting-tokens", "100000000"])
        with replica:
            replica.wait_ready()
            for rate, dataset in zip(rates, datasets):
                cfg = LoadConfig(dataset=dataset, base_url=replica.base_url, request_rate=rate)
                report = asyncio.run(run_load(cfg))
                print(f"\n== {rate:g} req/s ==\n{format_table(report)}")
                results.append(RateResult(rate, report))
    return results


def overhead_line(lowest: RateResult, offline: dict[int, float]) -> tuple[str, float]:
    """Server overhead = client TTFT - the engine's own TTFT for that request (queue + prefill)."""
    rows = [(r.first_token_time - r.send_time, r.timings.queue + r.timings.prefill, offline[r.index])
            for r in lowest.report.records
            if r.first_token_time is not None and r.timings is not None and r.index in offline
            and r.timings.queue is not None and r.timings.prefill is not None]
    client = statistics.median(c for c, _, _ in rows)
    served = statistics.median(e for _, e, _ in rows)
    alone = statistics.median(o for _, _, o in rows)
    overhead = statistics.median(c - e for c, e, _ in rows)
    share = overhead / client
    verdict = "PASS" if share < OVERHEAD_TARGET else "FAIL"
    return (f"at {lowest.rate:g} req/s, medians over {len(rows)} requests: "
            f"client TTFT {client * 1000:.1f} ms; "
            f"engine TTFT inside the server (queue + prefill) {served * 1000:.1f} ms; the same prompts on "
            f"the engine alone, offline {alone * 1000:.1f} ms\nserver overhead (HTTP, tokenization, "
            f"serialization) {overhead * 1000:.1f} ms = {share:.1%} of TTFT "
            f"(target < {OVERHEAD_TARGET:.0%}: {verdict})", share)


def summary_table(results: list[RateResult]) -> str:
    head = (f"{'rate':>6} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
            f"{'TPOT p99':>9} {'E2EL p50':>9} {'E2EL p99':>9} {'errors':>6}")
    lines = [head]
    for res in results:
        s = res.report.summary
        ms = [_ms(x) for x in (s.ttft.p50, s.ttft.p99, s.tpot.p50, s.tpot.p99, s.e2el.p50, s.e2el.p99)]
        lines.append(f"{res.rate:>6g} {s.request_throughput:>7.2f} {s.output_throughput:>8.1f} "
                     + " ".join(f"{m:>9}" for m in ms) + f" {s.num_failed:>6}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:  # report distributions are in ms already
    return "-" if value is None else f"{value:.1f}"


def main(args: argparse.Namespace) -> int:
    unwind_on_sigterm()  # a SIGTERM stops the replica it started too
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("interrupted: the benchmark stopped its replica", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    ensure_default_model()
    rates = [float(r) for r in args.rates.split(",")]
    datasets = [DatasetConfig(num_requests=args.num_requests, input_len=args.input_len,
                              output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed + i)
                for i in range(len(rates))]
    lowest = min(range(len(rates)), key=rates.__getitem__)
    offline = offline_ttfts(datasets[lowest], args.threads)
    results = run_rates(args, datasets, rates)
    print("\n" + summary_table(results))
    line, _ = overhead_line(results[lowest], offline)
    print(line)
    return 0
