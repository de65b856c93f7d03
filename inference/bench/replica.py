"""``python -m inference.bench replica``: one real replica under the load client at three request rates.

In the same run it measures the engine alone (in this process, before the replica starts, each prompt of
the lowest-rate run submitted alone) and reports the server's own overhead: client-side TTFT minus the
engine's offline TTFT for the same prompts, as a share of the client-side TTFT.

``--sustained`` then searches, on the same replica, the highest Poisson rate it serves within the SLO
(TTFT p99 <= 1 s and TPOT p99 <= 100 ms by default, no failed request): doubling from the highest fixed
rate that held until a rate misses, then halving the gap between the last rate that held and the first
that missed. Each probe sends ``--probe-s`` seconds' worth of requests (at least ``--num-requests``), so
that a queue that grows without bound has time to show.
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
from inference.bench.load_client import run_load
from inference.bench.load_config import LoadConfig
from inference.bench.report import LoadReport, LoadSummary, format_table
from inference.config import EngineConfig, switch_args
from inference.engine import LLMEngine
from inference.launcher import ReplicaProcess, free_port, unwind_on_sigterm
from inference.models.default import ensure_default_model
from inference.sampling_params import SamplingParams

OVERHEAD_TARGET = 0.10
BISECTIONS = 4  # after the first miss: the sustained rate is known to within 1/16 of the doubling step
MIN_RATE = 0.05  # req/s: below this the search gives up (nothing is served within the SLO)


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
    p.add_argument("--device", default="auto", help="for the engine and the replica: auto, cpu, cuda[:N]")
    p.add_argument("--decode-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine and the replica replay decode steps as CUDA graphs (default: with CUDA)")
    p.add_argument("--cpu-decode-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine and the replica decode attention by the C++ paged kernel (CPU; default: "
                        "on where it applies)")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine and the replica pack their linear weights at load (CPU: the C++ "
                        "kernel's blocks, or oneDNN's; default: on where it applies)")
    p.add_argument("--sustained", action="store_true",
                   help="then search the highest rate served within --ttft-slo-ms and --tpot-slo-ms at p99")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--probe-s", type=float, default=20.0, help="seconds of arrivals per probe of --sustained")


@dataclass(slots=True, frozen=True)
class Probe:
    rate: float
    summary: LoadSummary
    ttft_slo_ms: float
    tpot_slo_ms: float

    @property
    def held(self) -> bool:
        s = self.summary
        return (s.num_failed == 0 and s.ttft.p99 is not None and s.ttft.p99 <= self.ttft_slo_ms
                and (s.tpot.p99 is None or s.tpot.p99 <= self.tpot_slo_ms))

    def describe(self) -> str:
        s = self.summary
        return (f"{self.rate:.2f} req/s: TTFT p99 {_ms(s.ttft.p99)} ms, TPOT p99 {_ms(s.tpot.p99)} ms, "
                f"{s.num_failed} failed of {s.num_requests}, served {s.request_throughput:.2f} req/s "
                f"-> {'held' if self.held else 'missed'}")


def offline_ttfts(dataset: DatasetConfig, args: argparse.Namespace) -> dict[int, float]:
    """Engine-only TTFT of each request, submitted alone (no HTTP, no serialization)."""
    engine = LLMEngine("default", EngineConfig(num_threads=args.threads, device=args.device,
                                               decode_graphs=args.decode_graphs,
                                               cpu_decode_kernel=args.cpu_decode_kernel,
                                               pack_linear_weights=args.packed_weights))
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
              rates: list[float]) -> tuple[list[RateResult], list[Probe]]:
    results: list[RateResult] = []
    probes: list[Probe] = []
    with tempfile.TemporaryDirectory() as tmp:
        replica = ReplicaProcess(free_port(), replica_id="bench-0", log_path=Path(tmp) / "replica.log",
                                 extra_args=["--num-threads", str(args.threads), "--max-waiting-requests",
                                             "100000", "--max-waiting-tokens", "100000000",
                                             "--device", args.device,
                                             *switch_args("--decode-graphs", args.decode_graphs),
                                             *switch_args("--cpu-decode-kernel", args.cpu_decode_kernel),
                                             *switch_args("--packed-weights", args.packed_weights)])
        with replica:
            replica.wait_ready()
            for rate, dataset in zip(rates, datasets):
                cfg = LoadConfig(dataset=dataset, base_url=replica.base_url, request_rate=rate)
                report = asyncio.run(run_load(cfg))
                print(f"\n== {rate:g} req/s ==\n{format_table(report)}")
                results.append(RateResult(rate, report))
            if args.sustained:
                fixed = [Probe(r.rate, r.report.summary, args.ttft_slo_ms, args.tpot_slo_ms) for r in results]
                probes = search_sustained(args, replica.base_url, fixed)
    return results, probes


def search_sustained(args: argparse.Namespace, base_url: str, fixed: list[Probe]) -> list[Probe]:
    """Long probes from the highest fixed rate that held (the fixed runs are short: a hint, not a verdict):
    double while they hold, or halve while they miss, until one rate held and one missed; then bisect."""
    rate = max((p.rate for p in fixed if p.held), default=min(p.rate for p in fixed))
    probes: list[Probe] = []
    held: float | None = None
    missed: float | None = None
    while held is None or missed is None:
        ok = _probe(args, base_url, rate, _probe_dataset(args, rate, len(probes)), probes).held
        held, missed = (rate, missed) if ok else (held, rate)
        if held is None or missed is None:
            rate = rate * 2 if ok else rate / 2
            if rate < MIN_RATE:
                return probes  # not even one request every 20 s is served within the SLO
    for _ in range(BISECTIONS):
        middle = (held + missed) / 2
        if _probe(args, base_url, middle, _probe_dataset(args, middle, len(probes)), probes).held:
            held = middle
        else:
            missed = middle
    return probes


def _probe_dataset(args: argparse.Namespace, rate: float, index: int) -> DatasetConfig:
    """``--probe-s`` seconds of arrivals at ``rate`` (at least ``--num-requests``), fresh prompts each."""
    return DatasetConfig(num_requests=max(args.num_requests, round(rate * args.probe_s)),
                         input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                         seed=args.seed + 1000 + index)


def _probe(args: argparse.Namespace, base_url: str, rate: float, dataset: DatasetConfig,
           probes: list[Probe]) -> Probe:
    report = asyncio.run(run_load(LoadConfig(dataset=dataset, base_url=base_url, request_rate=rate)))
    result = Probe(rate, report.summary, args.ttft_slo_ms, args.tpot_slo_ms)
    probes.append(result)
    print(f"probe {len(probes)}: {result.describe()}", flush=True)
    return result


def sustained_line(probes: list[Probe], args: argparse.Namespace) -> str:
    """The highest rate a long probe held, and the lowest above it that missed."""
    best = max((p for p in probes if p.held), key=lambda p: p.rate, default=None)
    above = min((p for p in probes if not p.held and (best is None or p.rate > best.rate)),
                key=lambda p: p.rate, default=None)
    slo = (f"TTFT p99 <= {args.ttft_slo_ms:g} ms, TPOT p99 <= {args.tpot_slo_ms:g} ms, no failure, "
           f"{args.probe_s:g} s probes")
    if best is None:
        return f"sustained rate ({slo}): none of the rates probed held"
    s = best.summary
    line = (f"sustained rate ({slo}): {best.rate:.2f} req/s ({s.output_throughput:.1f} output tok/s; "
            f"TTFT p99 {_ms(s.ttft.p99)} ms, TPOT p99 {_ms(s.tpot.p99)} ms)")
    if above is not None:
        line += f"; {above.rate:.2f} req/s missed (TTFT p99 {_ms(above.summary.ttft.p99)} ms)"
    return line


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
    offline = offline_ttfts(datasets[lowest], args)
    results, probes = run_rates(args, datasets, rates)
    print("\n" + summary_table(results))
    line, share = overhead_line(results[lowest], offline)
    print(line)
    if args.sustained:
        print(sustained_line(probes, args))
    return 0 if share < OVERHEAD_TARGET else 1  # a missed target is the benchmark's failure
