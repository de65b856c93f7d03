"""``controlplane experiment slice|list|show|abort``: slice experiments over the REST API.

``slice`` colours ``--share`` of the traffic for the experiment and as much again for a control, puts
``--fault`` (``--set NAME=VALUE`` for its parameters) on the experiment colour only, and returns the run's
id at once; ``--wait`` follows it with a progress bar (the requests each side has seen) and prints the
report. The run stops itself on a deviation beyond the bounds (``--max-error-increase``,
``--max-latency-ratio``, at ``--alpha`` after ``--min-samples`` requests a side) or after ``--duration``.
With ``--wait`` the exit code is 0 when the run ended by itself (on the deviation or at its duration), 1
when it was aborted or failed. Errors come back as one line.
"""

from __future__ import annotations

import argparse
import time

from tqdm import tqdm  # type: ignore[import-untyped]

from controlplane.cli.exits import UsageError
from controlplane.cli.options import add_json_option, client, print_json, show
from controlplane.client import ControlPlaneClient, SliceExperiment, SliceExperimentSummary

SUMMARY = "slice experiments: chaos on a coloured share of traffic against a same-size control colour"
POLL_S = 1.0
FAULTS = ("error_rate", "token_latency", "prefill_delay")


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="experiment_action", required=True)
    run = actions.add_parser("slice", help="start a slice experiment (operator)")
    run.add_argument("--share", type=float, required=True,
                     help="share of all requests in each colour (experiment and control), e.g. 0.1")
    run.add_argument("--fault", choices=FAULTS, required=True, help="the coloured fault")
    run.add_argument("--set", action="append", metavar="NAME=VALUE", dest="params",
                     help="a fault parameter, e.g. probability=1.0 or seconds=0.2 (repeatable)")
    run.add_argument("--duration", type=float, default=60.0,
                     help="longest run, seconds (default %(default)s)")
    run.add_argument("--check-interval", type=float, default=1.0,
                     help="seconds between two comparisons (default %(default)s)")
    run.add_argument("--max-error-increase", type=float, default=None,
                     help="failure share above the control's that stops the run (default 0.05)")
    run.add_argument("--max-latency-ratio", type=float, default=None,
                     help="median TTFT over the control's that stops the run (default 1.5)")
    run.add_argument("--alpha", type=float, default=None, help="significance of each test (default 0.01)")
    run.add_argument("--min-samples", type=int, default=None, help="requests per side before a decision "
                                                                   "(default 10)")
    run.add_argument("--wait", action="store_true", help="follow it with a progress bar and print the report")
    add_json_option(run)
    listing = actions.add_parser("list", help="recent slice experiments")
    listing.add_argument("--limit", type=int, default=20)
    add_json_option(listing)
    shown = actions.add_parser("show", help="one slice experiment: its checks and report")
    shown.add_argument("id", type=int)
    add_json_option(shown)
    abort = actions.add_parser("abort", help="stop a running slice experiment (operator); fault reverted")
    abort.add_argument("id", type=int)


def run(args: argparse.Namespace) -> int:
    action = args.experiment_action
    params = dict(_param(p) for p in args.params or []) if action == "slice" else {}
    with client(args) as api:
        if action == "slice":
            return _start(api, args, params)
        if action == "list":
            show(args, api.slice_experiments(args.limit), _print_list)
        elif action == "show":
            show(args, api.slice_experiment(args.id), print_report)
        else:
            print_json(api.slice_experiment_abort(args.id))
    return 0


def _param(text: str) -> tuple[str, float | str | bool]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise UsageError(f"--set: expected NAME=VALUE, got {text!r}")
    if value in ("true", "false"):
        return name, value == "true"
    try:
        return name, float(value)
    except ValueError:
        return name, value


def _start(api: ControlPlaneClient, args: argparse.Namespace, params: dict[str, float | str | bool]) -> int:
    bounds = {name: value for name, value in (("max_error_increase", args.max_error_increase),
                                              ("max_latency_ratio", args.max_latency_ratio),
                                              ("alpha", args.alpha), ("min_samples", args.min_samples))
              if value is not None}
    started = api.slice_experiment_start(share=args.share, fault=args.fault, params=params,
                                         duration_s=args.duration, check_interval_s=args.check_interval,
                                         bounds=bounds)
    if not args.wait:
        print(f"slice experiment {started.id}: {args.fault} on {args.share:g} of the traffic against a "
              f"control of the same share; follow it with `controlplane experiment show {started.id}`")
        return 0
    result = follow(api, started.id, args.duration, quiet=args.json)
    show(args, result, print_report)
    return 0 if result.status in ("deviated", "completed") else 1


def follow(api: ControlPlaneClient, experiment_id: int, duration_s: float, *, quiet: bool = False,
           ) -> SliceExperiment:
    """Poll the run until it ends, with a bar of its time and each side's requests so far."""
    with tqdm(total=round(duration_s), desc=f"slice experiment {experiment_id}", unit="s", disable=quiet,
              bar_format="{l_bar}{bar}| {postfix}") as bar:
        while True:
            result = api.slice_experiment(experiment_id)
            if result.checks:
                last = result.checks[-1]
                bar.update(max(min(round(last.t), bar.total) - bar.n, 0))
                bar.set_postfix_str(f"experiment {last.experiment.failed}/{last.experiment.requests} failed, "
                                    f"control {last.control.failed}/{last.control.requests}, {last.verdict}")
            if result.finished:
                return result
            time.sleep(POLL_S)


def print_report(result: SliceExperiment) -> None:
    spec, stopped = result.spec, result.stopped
    print(f"slice experiment {result.id}: {result.status}; {spec.fault} {dict(spec.params)} on colour "
          f"{spec.colour} ({spec.share:g}) against {spec.control} ({spec.share:g})")
    if stopped is not None:
        after = "-" if stopped.after_s is None else f"{stopped.after_s:.1f} s"
        print(f"stopped: {stopped.reason} after {after}: {stopped.detail}")
    report = result.report
    if report is not None:
        print(f"{'SIDE':<12} {'REQUESTS':>8} {'FAILED':>7} {'TTFT P50 ms':>12} {'TTFT P99 ms':>12}")
        for name, side in (("experiment", report.experiment), ("control", report.control)):
            ttft = side.metrics.get("ttft")
            p50 = "-" if ttft is None or ttft.p50 is None else f"{ttft.p50:.1f}"
            p99 = "-" if ttft is None or ttft.p99 is None else f"{ttft.p99:.1f}"
            print(f"{name:<12} {side.requests:>8} {side.failed:>7} {p50:>12} {p99:>12}")
        print(f"{'uncoloured':<12} {report.uncoloured.requests:>8} {report.uncoloured.failed:>7}")
        for d in report.differences:
            print(f"difference {d.metric}: {d.estimate:+.4f} ({d.confidence:.0%} interval {d.low:+.4f} .. "
                  f"{d.high:+.4f}, {d.method})")
    print(f"faults reverted: {result.faults_reverted}; colours cleared: {result.colours_cleared}"
          + (f"; error: {result.error}" if result.error else ""))


def _print_list(rows: list[SliceExperimentSummary]) -> None:
    if not rows:
        print("no slice experiments yet")
        return
    print(f"{'ID':>5} {'STATUS':<12} {'FAULT':<14} {'SHARE':>6} {'EXP FAIL/REQ':>13} {'CTL FAIL/REQ':>13} "
          f"{'STOPPED':<10} STARTED")
    for r in rows:
        exp = "-" if r.experiment is None else f"{r.experiment.failed}/{r.experiment.requests}"
        ctl = "-" if r.control is None else f"{r.control.failed}/{r.control.requests}"
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.started_at))
        print(f"{r.id:>5} {r.status:<12} {r.fault:<14} {r.share:>6g} {exp:>13} {ctl:>13} "
              f"{r.stopped.reason if r.stopped else '-':<10} {started}")
