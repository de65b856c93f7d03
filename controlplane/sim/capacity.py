"""``python -m controlplane.sim capacity``: what a fixed fleet gives on one recipe's requests at steady rates.

The requests of an evaluation-set recipe (``controlplane.sim.evalset``: their prompt and output lengths and
shared prefixes, in order, at the benchmark's shaping) re-timed as Poisson arrivals at each rate asked, run
under ``static:N`` in the fleet simulator on the reference profile (or ``--profile``): SLO attainment, P95
TTFT and TPOT, how many requests missed the TTFT SLO and how many the TPOT SLO (a request may miss both),
and what our work model (``controlplane.autoscale.work``) sizes at that rate and at the rate plus the
policy's tolerance (what a scale-down must leave), with the share of requests its TPOT tail term
expects over the TPOT SLO at N replicas beside the share that missed it. Where the work model says N
suffices and attainment falls, the table says which SLO the model does not see.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass

from controlplane.autoscale.decide import offered_work
from controlplane.autoscale.profile import ReplicaProfile
from controlplane.sim.bench import EVAL_COMPRESS, bench_profile, shape_for
from controlplane.sim.evalset import NAMES, Row, evalset_rows
from controlplane.sim.policies import autoscaler_config
from controlplane.sim.settings import PolicySpec, SimSettings, Slo
from controlplane.sim.simulator import PolicyReport, format_seconds, format_share, simulate
from controlplane.sim.trace import SimRequest, shaped
from controlplane.vocabulary import STATIC

DURATION_S = 1800.0


@dataclass(slots=True, frozen=True)
class CapacityRow:
    rate: float  # requests/s
    report: PolicyReport
    work: int | None  # replicas the work model sizes at the rate (None: it cannot tell)
    work_margin: int | None  # at the rate plus the tolerance
    tpot_model: float | None = None  # the share of requests the TPOT tail term expects over the SLO at N


def steady_rows(name: str, rate: float, duration_s: float = DURATION_S, draw: int = 0) -> list[Row]:
    """Recipe ``name``'s requests, in order (repeated if the recipe has too few), arriving as a Poisson
    process at ``rate`` requests/s for ``duration_s`` seconds; the same arguments give the same rows."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"rate and duration must be > 0, got {rate:g} and {duration_s:g}")
    rows = evalset_rows(name, draw)
    rng = random.Random(f"capacity:{name}:{draw}:{rate!r}")
    out: list[Row] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append((t, *rows[len(out) % len(rows)][1:]))
        t += rng.expovariate(rate)
    return out


def capacity_row(name: str, rate: float, replicas: int, *, profile: ReplicaProfile,
                 duration_s: float = DURATION_S, draw: int = 0, token_scale: float = 0.25) -> CapacityRow:
    """``static:replicas`` on recipe ``name``'s requests at ``rate`` (:func:`steady_rows`, shaped as the
    evaluation set is), and what the work model sizes for the same requests' means and spread."""
    settings = SimSettings(slo=Slo())
    shape = shape_for(EVAL_COMPRESS, token_scale, profile.max_model_len)
    requests = shaped(steady_rows(name, rate, duration_s, draw), shape)
    report = simulate(requests, PolicySpec(STATIC, replicas), profile=profile, settings=settings)
    work = offered_work(profile, autoscaler_config(profile, settings), request_rate=rate,
                        mean_prompt_tokens=statistics.fmean(r.prompt_len for r in requests),
                        mean_output_tokens=statistics.fmean(r.output_len for r in requests),
                        prefix_hit_share=_prefix_share(requests),
                        prompt_tokens_sd=statistics.pstdev(r.prompt_len for r in requests),
                        output_tokens_sd=statistics.pstdev(r.output_len for r in requests))
    if work is None:
        return CapacityRow(rate, report, None, None)
    return CapacityRow(rate, report, work.replicas, work.with_margin,
                       None if work.tail is None else work.tail.miss_share(replicas))


def _prefix_share(requests: list[SimRequest]) -> float | None:
    """Of the prompt tokens, the share in shared prefixes (what a warm prefix cache holds); None: none."""
    shared = sum(r.prefix_len for r in requests)
    return shared / sum(r.prompt_len for r in requests) if shared else None


def format_table(name: str, replicas: int, rows: list[CapacityRow]) -> str:
    slo = Slo()
    lines = [f"{name} under static:{replicas}, Poisson arrivals at each rate "
             f"(SLO: TTFT <= {slo.ttft_s:g}s, TPOT <= {slo.tpot_s:g}s)",
             f"{'REQ/S':>6} {'REQUESTS':>8} {'SLO MET':>8} {'P95 TTFT':>9} {'P95 TPOT':>9} "
             f"{'MISSED TTFT':>11} {'MISSED TPOT':>16} {'MODEL TPOT':>10} {'WORK SIZES':>10} "
             f"{'+TOLERANCE':>10}"]
    for row in rows:
        r = row.report
        tpot = f"{r.missed_tpot} ({format_share(r.missed_tpot / r.num_requests if r.num_requests else None)})"
        lines.append(f"{row.rate:>6g} {r.num_requests:>8} {r.slo_attainment * 100:>7.1f}% "
                     f"{format_seconds(r.ttft_p95_s):>9} {format_seconds(r.tpot_p95_s):>9} "
                     f"{r.missed_ttft:>11} {tpot:>16} "
                     f"{format_share(row.tpot_model):>10} {_n(row.work):>10} {_n(row.work_margin):>10}")
    return "\n".join(lines)


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", choices=NAMES, help="the evaluation-set recipe whose requests are replayed")
    p.add_argument("--replicas", type=int, required=True, help="the fixed fleet (static:N)")
    p.add_argument("--rates", required=True, help="requests/s, comma-separated, e.g. 4.4,4.8,5.0")
    p.add_argument("--duration-s", type=float, default=DURATION_S, help="seconds at each rate (%(default)g)")
    p.add_argument("--draw", type=int, default=0,
                   help="the recipe's draw (0: the kept file's random numbers)")
    p.add_argument("--profile", default=None, help="replica profile JSON (default: the reference replica)")


def run(args: argparse.Namespace) -> int:
    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--rates: comma-separated numbers, got {args.rates!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise SystemExit(f"--rates: each must be a number > 0, got {args.rates!r}")
    if args.replicas < 1 or not args.duration_s > 0 or args.draw < 0:
        raise SystemExit("--replicas must be >= 1, --duration-s > 0 and --draw >= 0")
    profile = bench_profile(args.profile)
    rows = [capacity_row(args.recipe, rate, args.replicas, profile=profile, duration_s=args.duration_s,
                         draw=args.draw) for rate in rates]
    print(f"profile: {profile.source}")
    print(format_table(args.recipe, args.replicas, rows))
    return 0
