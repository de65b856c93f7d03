"""``controlplane simulate``: a what-if run of autoscaling policies on a trace, locally (no API needed).

controlplane simulate --trace azure --policy ours --compare hpa --compress 4
controlplane simulate --trace synthetic-bursty --policy static:4 --html timeline.html
"""

from __future__ import annotations

import argparse
import sys

from controlplane.cli.exits import UsageError
from controlplane.vocabulary import SYNTHETIC_BURSTY

SUMMARY = "what-if: run autoscaling policies on a trace in the fleet simulator (local, no API)"


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--trace", required=True,
                     help=f"an Azure LLM trace CSV, azure (the shipped one), or {SYNTHETIC_BURSTY}")
    cmd.add_argument("--policy", default="ours", help="ours, hpa or static:N (default %(default)s)")
    cmd.add_argument("--compare", action="append", default=[], help="another policy to run (repeatable)")
    cmd.add_argument("--compress", type=float, default=1.0, help="time compression (4: 4x the request rate)")
    cmd.add_argument(
        "--token-scale", type=float, default=0.25, help="token length scale (default %(default)s)"
    )
    cmd.add_argument(
        "--duration", type=float, default=None, help="seconds of the trace to keep (before compression)"
    )
    cmd.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    cmd.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default %(default)s)")
    cmd.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (default %(default)s)")
    cmd.add_argument("--max-replicas", type=int, default=12)
    cmd.add_argument(
        "--crash-at",
        type=float,
        action="append",
        default=[],
        help="simulated second at which the busiest replica crashes (repeatable)",
    )
    cmd.add_argument("--profile", default=None,
                     help="replica profile JSON (default: the one the --config file's control plane runs on)")
    cmd.add_argument("--config", default=None,
                     help="the TOML file `controlplane up` runs with: without --profile, its [autoscaler] "
                     "replica_profile, else the profile `controlplane calibrate` wrote into its state "
                     "folder, else the shipped one for its [fleet] (as the live autoscaler and the "
                     "console's what-if)")
    cmd.add_argument("--html", default=None, help="write the plotly timeline to this HTML file")


def run(args: argparse.Namespace) -> int:
    """A bad policy or trace (a ValueError or an unreadable file) is a usage error: nothing ran."""
    try:
        return _run(args)
    except (ValueError, OSError) as exc:
        raise UsageError(f"simulate: {exc}") from exc


def control_plane_profile(config_file: str | None) -> str:
    """The profile a control plane started with ``config_file`` runs on ("" for the shipped fallback)."""
    from controlplane.autoscale.profile import resolve_profile_path
    from controlplane.config import load_config

    cfg = load_config(config_file)
    return resolve_profile_path(cfg.autoscaler.replica_profile, cfg.state_path,
                                cpu_decode_kernel=cfg.fleet.cpu_decode_kernel,
                                packed_weights=cfg.fleet.packed_weights)


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from controlplane.autoscale.profile import describe, load_profile
    from controlplane.sim.settings import PolicySpec, SimSettings
    from controlplane.sim.simulator import compare, figure, format_table
    from controlplane.sim.trace import BurstyConfig, TraceShape, azure_trace, synthetic_bursty

    specs = [PolicySpec.parse(p) for p in [args.policy, *args.compare]]
    path = args.profile or control_plane_profile(args.config)
    profile = load_profile(path or None)
    about = describe(profile, path)
    print(f"profile: {about['path']} ({about['source']}; {about['fit']})")
    shape = TraceShape.fitted(profile.max_model_len, compress=args.compress, token_scale=args.token_scale,
                              duration_s=args.duration)
    if args.trace == SYNTHETIC_BURSTY:
        requests = synthetic_bursty(BurstyConfig(seed=args.seed), shape)
    else:
        requests = azure_trace(args.trace, shape)
    if not requests:
        raise ValueError(f"--trace {args.trace}: no request in the selected window")
    settings = SimSettings.what_if(ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo,
                                   max_replicas=args.max_replicas, crashes=args.crash_at)
    with tqdm(total=1000, desc="simulating", unit="‰", leave=False, file=sys.stderr) as bar:

        def progress(fraction: float) -> None:
            bar.update(round(fraction * 1000) - bar.n)

        reports = compare(requests, specs, profile=profile, settings=settings, progress=progress)
    print(
        f"{args.trace}: {len(requests)} requests over {reports[0].duration_s:.0f}s simulated "
        f"(compress {args.compress:g}, token scale {args.token_scale:g})"
    )
    print(format_table(reports, settings.slo))
    if args.html:
        figure(reports).write_html(args.html)
        print(f"timeline: {args.html}")
    return 0
