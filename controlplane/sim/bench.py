"""``python -m controlplane.sim bench``: our policy against the HPA baseline on two traces.

The Azure conversation trace (one hour, compressed and token-scaled to fit a few replicas of the default
model) and seeded synthetic bursty traces (several seeds, each shown, then pooled), each through ``ours``
and ``hpa`` in the calibrated fleet simulation. Prints SLO attainment and replica-seconds side by side, their
ratio, direction reversals, and whether the target holds: at least the baseline's attainment with at most
85% of its replica-seconds, or +5 points of attainment at equal replica-seconds, and no reversal within the
stabilization window.

``--set eval`` runs the evaluation set instead (``controlplane.sim.evalset``: seven one-hour traffic shapes
kept in the repo), shaped as ``controlplane simulate`` shapes a trace by default (no compression, token
scale 0.25, lengths capped to the replica's context), each through ``ours``, ``hpa`` and ``static:N`` where
N is the ceiling of HPA's mean replicas over the run (the fixed fleet HPA's cost buys). One table: per policy
SLO attainment, P95 TTFT and replica-seconds, ours/HPA replica-seconds, and the target, here with HPA's
attainment allowed 1 point below (``EVAL_ATTAINMENT_SLACK``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from controlplane.autoscale.profile import ReplicaProfile, load_profile, load_reference_profile
from controlplane.sim.evalset import NAMES as EVALSET_NAMES
from controlplane.sim.evalset import evalset_trace, load_evalset
from controlplane.sim.settings import PolicySpec, SimSettings, Slo
from controlplane.sim.simulator import (
    PolicyReport,
    Progress,
    compare,
    figure,
    format_seconds,
    format_share,
    format_table,
    simulate,
)
from controlplane.sim.trace import BurstyConfig, SimRequest, TraceShape, azure_trace, synthetic_bursty
from controlplane.vocabulary import HPA, OURS, STATIC
from inference.bench.datasets import AZURE_TRACE

DEFAULT_TRACE = AZURE_TRACE  # the trace shipped with the load client (or $CONTROLPLANE_AZURE_TRACE)
REPLICA_SECONDS_SHARE = 0.85
ATTAINMENT_GAIN = 0.05
AZURE_COMPRESS = 4.0
EVAL_ATTAINMENT_SLACK = 0.01  # on the eval set: "HPA's attainment or better (within 1 point)"
EVAL_COMPRESS = 1.0  # the eval set's shaping: controlplane simulate's default (its token scale, 0.25, too)


@dataclass(slots=True, frozen=True)
class Verdict:
    trace: str
    ours: PolicyReport
    hpa: PolicyReport
    attainment_slack: float = 0.0  # how far below HPA's attainment still counts as "at least" it

    @property
    def ratio(self) -> float:
        return (
            self.ours.replica_seconds / self.hpa.replica_seconds if self.hpa.replica_seconds else float("inf")
        )

    @property
    def is_met(self) -> bool:
        cheaper = (
            self.ours.slo_attainment >= self.hpa.slo_attainment - self.attainment_slack
            and self.ratio <= REPLICA_SECONDS_SHARE
        )
        better = self.ours.slo_attainment >= self.hpa.slo_attainment + ATTAINMENT_GAIN and self.ratio <= 1.0
        return (cheaper or better) and self.ours.reversals == 0

    def line(self) -> str:
        return (
            f"{self.trace:<16} attainment {self.ours.slo_attainment * 100:5.1f}% "
            f"vs {self.hpa.slo_attainment * 100:5.1f}%"
            f"   replica-s {self.ours.replica_seconds:7.0f} vs {self.hpa.replica_seconds:7.0f} "
            f"(ratio {self.ratio:.2f})   reversals {self.ours.reversals} vs {self.hpa.reversals}   "
            f"target {'MET' if self.is_met else 'NOT MET'}"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="trace_set", choices=("azure", "eval"), default="azure",
                   help="azure: the Azure trace and bursty seeds, eval: the evaluation set (default azure)")
    p.add_argument("--only", action="append", choices=EVALSET_NAMES, default=[],
                   help="--set eval: only this trace (repeatable; default all seven)")
    p.add_argument("--draw", type=int, default=0,
                   help="--set eval: regenerate each recipe with this draw of its random numbers instead of "
                        "the kept files (draw 0): traffic of the same shapes no policy was run on")
    p.add_argument("--duration-s", type=float, default=None,
                   help="--set eval: seconds of each trace kept, from its start (default: the hour)")
    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help="Azure LLM trace CSV, or azure: the shipped one (default %(default)s)")
    p.add_argument("--compress", type=float, default=None,
                   help=f"time compression (default {AZURE_COMPRESS:g}; {EVAL_COMPRESS:g} for --set eval)")
    p.add_argument("--token-scale", type=float, default=0.25, help="token length scale (default %(default)s)")
    p.add_argument(
        "--seeds", type=int, default=6, help="synthetic bursty traces, seeds 0..N-1 (default %(default)s)"
    )
    p.add_argument("--profile", default=None,
                   help="replica profile JSON (default: the reference replica the traffic is sized for, "
                        "controlplane/data/reference_profile.json)")
    p.add_argument("--html", default=None, help="write the timelines to this HTML file")


def bench_profile(path: str | None) -> ReplicaProfile:
    """The profile a policy benchmark runs on: ``path``, else the reference replica its traffic is sized for
    (fixed, so that a faster engine does not move every figure; ``controlplane.autoscale.profile``)."""
    return load_profile(path) if path else load_reference_profile()


def shape_for(compress: float, token_scale: float, max_model_len: int) -> TraceShape:
    """Fit a trace to the replica: prompts and outputs capped so that both fit its context length."""
    return TraceShape.fitted(max_model_len, compress=compress, token_scale=token_scale)


def traces(path: str, shape: TraceShape, seeds: int) -> dict[str, list[SimRequest]]:
    found = {"azure-conv-2023": azure_trace(path, shape)}
    for seed in range(seeds):
        found[f"bursty-seed{seed}"] = synthetic_bursty(BurstyConfig(seed=seed), shape)
    return found


def run(args: argparse.Namespace) -> int:
    if args.trace_set == "eval":
        return run_eval(args)
    if args.compress is None:
        args = argparse.Namespace(**{**vars(args), "compress": AZURE_COMPRESS})
    from tqdm import tqdm  # type: ignore[import-untyped]

    profile = bench_profile(args.profile)
    settings = SimSettings(slo=Slo())
    shape = shape_for(args.compress, args.token_scale, profile.max_model_len)
    verdicts: list[Verdict] = []
    figures = []
    print(f"profile: {profile.source}")
    for name, requests in traces(args.trace, shape, args.seeds).items():
        with tqdm(total=1000, desc=name, unit="‰", leave=False) as bar:

            def progress(f: float, bar: tqdm = bar) -> None:
                bar.update(round(f * 1000) - bar.n)

            reports = compare(
                requests,
                [PolicySpec("ours"), PolicySpec("hpa")],
                profile=profile,
                settings=settings,
                progress=progress,
            )
        print(
            f"\n{name}: {len(requests)} requests over {reports[0].duration_s:.0f}s simulated "
            f"(one hour of trace; compress {args.compress:g}, token scale {args.token_scale:g}); simulated "
            f"in {reports[0].wall_s:.2f}s (ours) and {reports[1].wall_s:.2f}s (hpa)"
        )
        print(format_table(reports, settings.slo))
        verdicts.append(Verdict(name, reports[0], reports[1]))
        figures.append((name, reports))
    print(
        "\nours vs hpa (target: >= baseline attainment at <= 85% of its replica-seconds, or +5 points at "
        "equal replica-seconds; no reversal within the stabilization window)"
    )
    for v in verdicts:
        print(v.line())
    bursty = [v for v in verdicts if v.trace.startswith("bursty")]
    if len(bursty) > 1:
        print(pooled("bursty, pooled", bursty).line())
    if args.html:
        _write_html(Path(args.html), figures)
    return 0 if all(v.is_met for v in verdicts) else 1


def run_eval(args: argparse.Namespace) -> int:
    """The evaluation set: ours, hpa and static:ceil(HPA's mean replicas) on each trace; one table."""
    from tqdm import tqdm

    if args.draw < 0:
        raise SystemExit(f"--draw: must be >= 0, got {args.draw}")
    profile = bench_profile(args.profile)
    settings = SimSettings(slo=Slo())
    compress = EVAL_COMPRESS if args.compress is None else args.compress
    shape = replace(shape_for(compress, args.token_scale, profile.max_model_len), duration_s=args.duration_s)
    rows: list[EvalRow] = []
    for name in args.only or EVALSET_NAMES:
        requests = evalset_trace(name, shape, args.draw) if args.draw else load_evalset(name, shape)
        with tqdm(total=1000, desc=name, unit="‰", leave=False) as bar:

            def progress(f: float, bar: tqdm = bar) -> None:
                bar.update(round(f * 1000) - bar.n)

            rows.append(eval_row(name, requests, profile=profile, settings=settings, progress=progress))
    print(f"profile: {profile.source}")
    window = "the hour" if args.duration_s is None else f"the first {args.duration_s:g}s"
    drawn = f"draw {args.draw} of the recipes" if args.draw else "the kept traces"
    print(
        f"evaluation set, {drawn} ({window} of each trace; compress {compress:g}, token scale "
        f"{args.token_scale:g}, prompts <= {shape.max_prompt_len} and outputs <= {shape.max_output_len} "
        "tokens)"
    )
    print(format_eval_table(rows, settings.slo))
    return 0 if all(r.verdict.is_met for r in rows) else 1


@dataclass(slots=True, frozen=True)
class EvalRow:
    """One trace of the evaluation set: the three reports and the verdict of ours against hpa."""

    trace: str
    ours: PolicyReport
    hpa: PolicyReport
    static: PolicyReport

    @property
    def verdict(self) -> Verdict:
        return Verdict(self.trace, self.ours, self.hpa, attainment_slack=EVAL_ATTAINMENT_SLACK)


def eval_row(
    name: str,
    requests: list[SimRequest],
    *,
    profile: ReplicaProfile,
    settings: SimSettings,
    progress: Progress | None = None,
) -> EvalRow:
    """ours and hpa, then static at the ceiling of HPA's mean replicas (known only after HPA's run)."""

    def part(start: float, share: float) -> Progress | None:
        return None if progress is None else (lambda f: progress(start + share * f))

    ours, hpa = compare(
        requests,
        [PolicySpec(OURS), PolicySpec(HPA)],
        profile=profile,
        settings=settings,
        progress=part(0.0, 2 / 3),
    )
    fixed = PolicySpec(STATIC, static_replicas(hpa, settings))
    static = simulate(requests, fixed, profile=profile, settings=settings, progress=part(2 / 3, 1 / 3))
    return EvalRow(name, ours, hpa, static)


def static_replicas(hpa: PolicyReport, settings: SimSettings) -> int:
    """The ceiling of HPA's mean replicas over the run, within the fleet's bounds."""
    mean = hpa.replica_seconds / hpa.duration_s if hpa.duration_s > 0 else settings.min_replicas
    return max(settings.min_replicas, min(settings.max_replicas, math.ceil(mean - 1e-6)))


def format_eval_table(rows: Sequence[EvalRow], slo: Slo) -> str:
    groups = ("ours", "hpa", "static:N, N = ceil(HPA mean replicas)")
    cols = f"{'SLO MET':>8} {'WORST 5M':>8} {'P95 TTFT':>9} {'REPLICA-S':>10}"
    lines = [
        f"SLO: TTFT <= {slo.ttft_s:g}s and TPOT <= {slo.tpot_s:g}s. Target: ours >= HPA's attainment - "
        f"{EVAL_ATTAINMENT_SLACK * 100:g} point at <= {REPLICA_SECONDS_SHARE:.0%} of its replica-seconds, "
        f"or +{ATTAINMENT_GAIN * 100:g} points at <= its replica-seconds; and no reversal "
        "(REV: ours' reversals within the stabilization window).",
        "WORST 5M: the lowest attainment over the hour's 5-minute windows (a burn-rate alert's short "
        "window).",
        f"{'':<16} {'':>8} | {groups[0]:<38} | {groups[1]:<38} | {groups[2]:<42} |",
        f"{'TRACE':<16} {'REQUESTS':>8} | {cols} | {cols} | {'N':>3} {cols} | "
        f"{'OURS/HPA':>8} {'REV':>3} TARGET",
    ]
    for r in rows:
        v = r.verdict
        lines.append(
            f"{r.trace:<16} {r.ours.num_requests:>8} | {_eval_cells(r.ours)} | {_eval_cells(r.hpa)} | "
            f"{r.static.policy.partition(':')[2]:>3} {_eval_cells(r.static)} | {v.ratio:>8.2f} "
            f"{r.ours.reversals:>3} {'MET' if v.is_met else 'NOT MET'}"
        )
    met = sum(r.verdict.is_met for r in rows)
    lines.append(f"target met on {met} of {len(rows)} traces")
    return "\n".join(lines)


def _eval_cells(r: PolicyReport) -> str:
    return (f"{r.slo_attainment * 100:>7.1f}% {format_share(r.worst_window_attainment):>8} "
            f"{format_seconds(r.ttft_p95_s):>9} {r.replica_seconds:>10.0f}")


def pooled(name: str, verdicts: Sequence[Verdict]) -> Verdict:
    """The verdicts of several traces as one: attainment over all requests, summed cost and reversals."""
    return Verdict(name, _pool([v.ours for v in verdicts]), _pool([v.hpa for v in verdicts]))


def _pool(reports: Sequence[PolicyReport]) -> PolicyReport:
    num = sum(r.num_requests for r in reports)
    met = sum(r.slo_attainment * r.num_requests for r in reports)
    return replace(
        reports[0],
        num_requests=num,
        slo_attainment=met / num if num else 1.0,
        replica_seconds=sum(r.replica_seconds for r in reports),
        scale_events=sum(r.scale_events for r in reports),
        reversals=sum(r.reversals for r in reports),
        missed_ttft=sum(r.missed_ttft for r in reports),
        missed_tpot=sum(r.missed_tpot for r in reports),
        worst_window_attainment=min((r.worst_window_attainment for r in reports
                                     if r.worst_window_attainment is not None), default=None),
    )


def _write_html(path: Path, figures: Sequence[tuple[str, list[PolicyReport]]]) -> None:
    parts = [
        figure(reports, title=f"{name}: load, replicas, P95 TTFT").to_html(
            full_html=False, include_plotlyjs=i == 0
        )
        for i, (name, reports) in enumerate(figures)
    ]
    path.write_text("<html><body>" + "\n".join(parts) + "</body></html>")
    print(f"timelines: {path}")
