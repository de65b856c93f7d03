"""``python -m controlplane.sim bench``: our policy against the HPA baseline on two traces.

The Azure conversation trace (one hour, compressed and token-scaled to fit a few replicas of the default
model) and seeded synthetic bursty traces (several seeds, each shown, then pooled), each through ``ours``
and ``hpa`` in the calibrated fleet simulation. Prints SLO attainment and replica-seconds side by side, their
ratio, direction reversals, and whether the target holds: at least the baseline's attainment with at most
85% of its replica-seconds, or +5 points of attainment at equal replica-seconds, and no reversal within the
stabilization window.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from controlplane.autoscale.profile import load_profile
from controlplane.sim.simulator import (
    PolicyReport,
    PolicySpec,
    SimSettings,
    Slo,
    compare,
    figure,
    format_table,
)
from controlplane.sim.trace import BurstyConfig, SimRequest, TraceShape, azure_trace, synthetic_bursty
from inference.bench.datasets import AZURE_TRACE

DEFAULT_TRACE = AZURE_TRACE  # the trace shipped with the load client (or $CONTROLPLANE_AZURE_TRACE)
REPLICA_SECONDS_SHARE = 0.85
ATTAINMENT_GAIN = 0.05


@dataclass(slots=True, frozen=True)
class Verdict:
    trace: str
    ours: PolicyReport
    hpa: PolicyReport

    @property
    def ratio(self) -> float:
        return (
            self.ours.replica_seconds / self.hpa.replica_seconds if self.hpa.replica_seconds else float("inf")
        )

    @property
    def is_met(self) -> bool:
        cheaper = self.ours.slo_attainment >= self.hpa.slo_attainment and self.ratio <= REPLICA_SECONDS_SHARE
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
    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help="Azure LLM trace CSV, or azure: the shipped one (default %(default)s)")
    p.add_argument("--compress", type=float, default=4.0, help="time compression (default %(default)s)")
    p.add_argument("--token-scale", type=float, default=0.25, help="token length scale (default %(default)s)")
    p.add_argument(
        "--seeds", type=int, default=6, help="synthetic bursty traces, seeds 0..N-1 (default %(default)s)"
    )
    p.add_argument("--profile", default=None, help="replica profile JSON (default: the shipped one)")
    p.add_argument("--html", default=None, help="write the timelines to this HTML file")


def shape_for(compress: float, token_scale: float, max_model_len: int) -> TraceShape:
    """Fit a trace to the replica: prompts and outputs capped so that both fit its context length."""
    return TraceShape(
        compress=compress,
        token_scale=token_scale,
        max_prompt_len=max_model_len * 3 // 4,
        max_output_len=max_model_len // 4,
    )


def traces(path: str, shape: TraceShape, seeds: int) -> dict[str, list[SimRequest]]:
    found = {"azure-conv-2023": azure_trace(path, shape)}
    for seed in range(seeds):
        found[f"bursty-seed{seed}"] = synthetic_bursty(BurstyConfig(seed=seed), shape)
    return found


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    profile = load_profile(args.profile)
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
