"""The gateway bench's results and how they read: per level and route, the added latency, the verdict.

Where it sits: :mod:`controlplane.bench.gateway` runs the levels and builds a :class:`GatewayBenchResult`
from the load client's samples (:mod:`controlplane.bench.load`); here they become percentiles, resampled
intervals (:mod:`controlplane.bench.stats`), a pass or fail against the targets and the printed report.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from controlplane.bench.layout import CpuLayout, GatewayMode
from controlplane.bench.load import ROUTES, RequestSample, Route
from controlplane.bench.stats import AddedIntervals, Interval, Percentiles, added_interval

TARGET_ADDED_P50_S = 0.002
TARGET_ADDED_P99_S = 0.010


@dataclass(slots=True, frozen=True)
class RouteStats:
    """One route at one level: successful requests only."""

    num_requests: int
    num_succeeded: int
    ttft: Percentiles
    e2e: Percentiles
    overhead: Percentiles  # per request: client TTFT - replica queue - replica prefill

    @classmethod
    def of(cls, samples: Sequence[RequestSample]) -> RouteStats:
        ok = [s for s in samples if s.is_success]
        return cls(num_requests=len(samples), num_succeeded=len(ok),
                   ttft=Percentiles.of([s.ttft_s for s in ok if s.ttft_s is not None]),
                   e2e=Percentiles.of([s.e2e_s for s in ok if s.e2e_s is not None]),
                   overhead=Percentiles.of([s.overhead_s for s in ok]))


@dataclass(slots=True, frozen=True)
class LevelResult:
    concurrency: int
    samples: tuple[RequestSample, ...]
    wall_s: float
    gateway_cpu_s: float | None = None  # the gateway process's CPU time over the level (None: unknown)
    direct: RouteStats = field(init=False)
    gateway: RouteStats = field(init=False)

    def __post_init__(self) -> None:
        for route in ROUTES:
            object.__setattr__(self, route, RouteStats.of([s for s in self.counted if s.route == route]))

    @property
    def counted(self) -> list[RequestSample]:
        return [s for s in self.samples if s.counted]

    @property
    def added_ttft(self) -> Percentiles:
        """The estimate judged against the targets: gateway TTFT percentile - direct TTFT percentile."""
        return self.gateway.ttft.minus(self.direct.ttft)

    @property
    def added_ttft_interval(self) -> AddedIntervals:
        """95% intervals of :attr:`added_ttft`, from resampling rounds (:mod:`controlplane.bench.stats`)."""
        rounds: dict[Route, dict[int, list[float]]] = {route: {} for route in ROUTES}
        for s in self.counted:
            if s.is_success and s.ttft_s is not None:
                rounds[s.route].setdefault(s.round_index, []).append(s.ttft_s)
        in_order = {route: [rounds[route][i] for i in sorted(rounds[route])] for route in ROUTES}
        return added_interval(in_order["direct"], in_order["gateway"])

    @property
    def added_overhead(self) -> Percentiles:
        return self.gateway.overhead.minus(self.direct.overhead)

    @property
    def added_e2e(self) -> Percentiles:
        return self.gateway.e2e.minus(self.direct.e2e)

    @property
    def gateway_cpu_per_request_s(self) -> float | None:
        """The gateway's CPU time per request it relayed, warm-up included (it spent CPU on those too)."""
        relayed = sum(1 for s in self.samples if s.route == "gateway")
        return None if self.gateway_cpu_s is None or not relayed else self.gateway_cpu_s / relayed

    @property
    def failures(self) -> list[RequestSample]:
        return [s for s in self.samples if not s.is_success]

    @property
    def outcomes(self) -> tuple[Outcome, Outcome]:
        """The p50 and the p99 judged by their 95% intervals (:func:`judge_interval`)."""
        interval = self.added_ttft_interval
        return (judge_interval(interval.p50, TARGET_ADDED_P50_S),
                judge_interval(interval.p99, TARGET_ADDED_P99_S))

    @property
    def outcome(self) -> Outcome:
        """fail when a request failed or an interval lies wholly above its target; else not resolved when
        an interval straddles its target (or there were too few rounds to draw one); else pass."""
        if self.failures:
            return "fail"
        return worst(self.outcomes)

    @property
    def is_pass(self) -> bool:
        return self.outcome == "pass"


Outcome = Literal["pass", "fail", "not resolved"]
_SEVERITY: dict[Outcome, int] = {"pass": 0, "not resolved": 1, "fail": 2}


def judge_interval(interval: Interval, target: float) -> Outcome:
    """pass when the whole 95% interval is within the target (its upper end), fail when the whole interval
    is above it, not resolved when it straddles the target or could not be drawn: one run cannot say."""
    if math.isnan(interval.low) or math.isnan(interval.high):
        return "not resolved"
    if interval.high <= target:
        return "pass"
    return "fail" if interval.low > target else "not resolved"


def worst(outcomes: Sequence[Outcome]) -> Outcome:
    return max(outcomes, key=_SEVERITY.__getitem__, default="pass")


@dataclass(slots=True, frozen=True)
class MachineNote:
    num_cpus: int
    num_usable_cpus: int  # this process's affinity
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]

    def line(self) -> str:
        def load(values: tuple[float, float, float]) -> str:
            return " ".join(f"{v:.2f}" for v in values)

        return (f"machine: {self.num_cpus} CPUs ({self.num_usable_cpus} usable); load average 1/5/15 min "
                f"before {load(self.load_before)}, after {load(self.load_after)}")


@dataclass(slots=True, frozen=True)
class GatewayBenchResult:
    levels: tuple[LevelResult, ...]
    machine: MachineNote
    gateway_mode: GatewayMode
    round_size: int
    max_tokens: int
    replica_threads: int
    replica_max_num_seqs: int
    layout: CpuLayout
    gateway_counters: dict[str, float]  # retries, resumes, rejected: all should be 0
    client_policy: str = "default"  # the load client's scheduling policy (see bench.layout.load_thread)
    control_plane: str = "idle"  # idle, or busy: bench.busy ran beside the gateway on its CPUs
    control_plane_note: str = ""  # what the busy control plane did meanwhile

    @property
    def outcome(self) -> Outcome:
        """The worst level's outcome; fail when the gateway retried, resumed or refused anything."""
        if any(self.gateway_counters.values()):
            return "fail"
        return worst([level.outcome for level in self.levels])

    @property
    def is_pass(self) -> bool:
        return self.outcome == "pass"


def sample_lines(result: GatewayBenchResult) -> Iterator[str]:
    """Every request of a run as one JSON object each (``--samples``): enough to draw the figures again."""
    for level in result.levels:
        for s in level.samples:
            yield json.dumps({"control_plane": result.control_plane, "concurrency": level.concurrency,
                              "route": s.route, "round": s.round_index, "counted": s.counted,
                              "ttft_s": s.ttft_s, "e2e_s": s.e2e_s, "replica_queue_s": s.replica_queue_s,
                              "replica_prefill_s": s.replica_prefill_s, "error": s.error})


def format_report(result: GatewayBenchResult) -> str:
    where = ("in its own process" if result.gateway_mode == "process"
             else "on a thread of the load client's process")
    lines = [f"gateway bench: 1 replica ({result.replica_threads} torch threads, max "
             f"{result.replica_max_num_seqs} seqs), gateway {where}; streaming /v1/completions, max_tokens "
             f"{result.max_tokens}, greedy, ignore_eos; closed loop, rounds of max({result.round_size}, 4 C) "
             "requests alternating direct and gateway (ABBA), with no barrier between rounds; n counts "
             "neither a warm-up of C per route nor the first C of each round",
             f"CPU layout: {result.layout.describe()}",
             f"load client scheduling: {result.client_policy}{_POLICY_NOTES.get(result.client_policy, '')}",
             f"control plane: {result.control_plane}"
             + (f" ({result.control_plane_note})" if result.control_plane_note else ""),
             "",
             *_table(result.levels), "",
             "TTFT: send -> first chunk with a token; E2E: send -> [DONE]. added = gateway - direct, "
             "percentile by percentile;",
             "per-request = client TTFT - replica (queue + prefill), gateway median/p99 - direct median/p99.",
             "95% CI: from resampling pairs of neighbouring rounds, one of each route (the spread one run "
             "leaves); the verdict "
             "judges the upper end of each interval: PASS when it is within the target, FAIL when the whole "
             "interval is above it, NOT RESOLVED when it straddles the target (more requests narrow it).",
             ""]
    lines += [_verdict(level) for level in result.levels]
    lines.append("gateway CPU per request relayed: " + ", ".join(
        f"C={level.concurrency} {_cpu_ms(level.gateway_cpu_per_request_s)}" for level in result.levels))
    counters = ", ".join(f"{name} {value:g}" for name, value in result.gateway_counters.items())
    lines += [f"gateway counters (should all be 0): {counters}", result.machine.line(),
              f"overall: {result.outcome.upper()}"]
    return "\n".join(lines)


_POLICY_NOTES = {"SCHED_BATCH": " (does not preempt the gateway on wake-up)"}


def _table(levels: Sequence[LevelResult]) -> list[str]:
    groups = ("direct TTFT", "gateway TTFT", "added TTFT", "added per-req", "added E2E")
    head1 = f"{'':>4} {'':>5} {'':>6}  " + "  ".join(f"{g:^15}" for g in groups)
    names = (("p50", "p99"),) * 3 + (("median", "p99"), ("p50", "p99"))
    head2 = f"{'C':>4} {'n':>5} {'failed':>6}  " + "  ".join(f"{a:>7} {b:>7}" for a, b in names)
    rows = [head1, head2 + "   (ms)"]
    for level in levels:
        pairs = (level.direct.ttft, level.gateway.ttft, level.added_ttft, level.added_overhead,
                 level.added_e2e)
        cells = "  ".join(f"{_ms(p.p50):>7} {_ms(p.p99):>7}" for p in pairs)
        rows.append(f"{level.concurrency:>4} {len(level.counted):>5} {len(level.failures):>6}  {cells}")
    return rows


def _verdict(level: LevelResult) -> str:
    added, interval = level.added_ttft, level.added_ttft_interval
    p50, p99 = level.outcomes
    failed = f"; {len(level.failures)} failed requests" if level.failures else ""
    return (f"C={level.concurrency}: added TTFT p50 {_ms(added.p50)} ms {_interval(interval.p50)} (target <= "
            f"{TARGET_ADDED_P50_S * 1000:g}: {p50}), p99 {_ms(added.p99)} ms {_interval(interval.p99)} "
            f"(target <= {TARGET_ADDED_P99_S * 1000:g}: {p99}){failed}: {level.outcome.upper()}")


def _interval(interval: Interval) -> str:
    if math.isnan(interval.low):
        return "[95% CI: too few rounds]"
    return f"[95% CI {_ms(interval.low)} to {_ms(interval.high)}]"


def _cpu_ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1000:.2f} ms"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"
