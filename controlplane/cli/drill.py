"""``controlplane drill run|list|show|compare|abort|scenarios|schedule``: failover drills over the REST API.

``run`` starts a drill and returns its id at once; ``--wait`` follows it with a progress bar and prints the
report. ``--replica`` / ``--zone`` aim it (the control plane checks them against the fleet); ``--trace``
replays an Azure LLM trace (``azure``: the control plane's default copy) instead of Poisson arrivals at
``--rate``. ``schedule`` is handled by ``controlplane.cli.schedules``. Errors come back as one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]

from controlplane.cli import schedules as cli_schedules
from controlplane.cli.exits import UsageError
from controlplane.cli.options import add_json_option, client, print_json, show
from controlplane.client import ControlPlaneClient, DrillReport, DrillSummary, Scenario, Unreachable, as_json
from controlplane.drills.report import compare_markdown

SUMMARY = "failover drills: run a scenario under load, list, show (JSON or Markdown), compare, schedule"
POLL_S = 1.0
OUTAGE_PATIENCE_S = 300.0  # a control plane down this long during a drill: give up following it
FINISHED = ("passed", "failed", "aborted", "error", "interrupted")


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="drill_action", required=True)
    run = actions.add_parser("run", help="run a drill scenario (operator); see `drill scenarios`")
    run.add_argument("scenario")
    run.add_argument("--rate", type=float, default=None, help="requests per second (default: the scenario's)")
    run.add_argument("--duration", type=float, default=None, help="load seconds (default: the scenario's)")
    run.add_argument("--fault-at", type=float, default=None, help="t0, seconds into the load")
    run.add_argument("--max-tokens", type=int, default=None, help="tokens per request (a trace: the cap)")
    cli_schedules.add_aim_and_load_options(run)  # the same options a schedule takes
    run.add_argument("--target", action="append", help="NAME=VALUE target override, e.g. rto_service_s=0.5")
    run.add_argument("--steady-timeout", type=float, default=None, metavar="S",
                     help="wait this long at most for the steady state, e.g. right after `controlplane up` "
                     "while the replicas start (default: the scenario's, 180 s)")
    run.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    run.add_argument("--wait", action="store_true", help="follow it with a progress bar and print the report")
    add_json_option(actions.add_parser("scenarios", help="the shipped scenarios with their defaults and "
                                                         "targets"))
    listing = actions.add_parser("list", help="recent drills")
    listing.add_argument("--limit", type=int, default=20)
    add_json_option(listing)
    show = actions.add_parser("show", help="one drill's report (JSON, or Markdown)")
    show.add_argument("id", type=int)
    show.add_argument("--markdown", action="store_true")
    compare = actions.add_parser("compare", help="figures of several drills side by side")
    compare.add_argument("ids", type=int, nargs="+")
    add_json_option(compare)
    abort = actions.add_parser("abort", help="abort the running drill (operator); its faults are reverted")
    abort.add_argument("id", type=int)
    cli_schedules.add_arguments(actions.add_parser("schedule", help=cli_schedules.SUMMARY))


def run(args: argparse.Namespace) -> int:
    if args.drill_action == "schedule":
        return cli_schedules.run(args)
    action = args.drill_action
    if action == "compare" and len(args.ids) < 2:
        raise UsageError("compare: give at least two drill ids")
    with client(args) as api:
        if action == "run":
            return _run(api, args)
        if action == "scenarios":
            show(args, api.drill_scenarios(), _print_scenarios)
        elif action == "list":
            show(args, api.drills(args.limit), _print_list)
        elif action == "show":
            if args.markdown:
                sys.stdout.write(api.drill_markdown(args.id))
            else:  # the whole report as stored
                print(json.dumps(api.drill(args.id).document, indent=2, sort_keys=True))
        elif action == "compare":
            show(args, api.drill_compare(args.ids), lambda t: sys.stdout.write(compare_markdown(as_json(t))))
        else:
            print_json(api.drill_abort(args.id))
    return 0


def _targets(pairs: list[str] | None) -> dict[str, float]:
    out = {}
    for text in pairs or []:
        name, sep, value = text.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise UsageError(f"--target: expected NAME=NUMBER, got {text!r}") from None
        if not sep or not name:
            raise UsageError(f"--target: expected NAME=NUMBER, got {text!r}")
    return out


def _run(api: ControlPlaneClient, args: argparse.Namespace) -> int:
    aimed: dict[str, Any] = {"rate": args.rate, "duration_s": args.duration, "fault_at_s": args.fault_at,
                             "max_tokens": args.max_tokens, "targets": _targets(args.target),
                             "replicas": args.replica, "zones": args.zone,
                             "load": cli_schedules.trace_load(args)}
    if args.dry_run:
        print_json(api.drill_plan(args.scenario, **aimed))
        return 0
    drill_id = api.drill_run(args.scenario, **aimed, steady_state_timeout_s=args.steady_timeout).id
    print(f"drill {drill_id}: {args.scenario} started; follow it with `controlplane drill show {drill_id}`")
    if not args.wait:
        return 0
    report = follow(api, drill_id)
    sys.stdout.write(api.drill_markdown(drill_id))
    return 0 if report.status == "passed" else 1


def follow(api: ControlPlaneClient, drill_id: int, *, outage_s: float = OUTAGE_PATIENCE_S) -> DrillReport:
    """Poll the drill until it finishes, with a tqdm bar of its progress. A control plane that stops
    answering (the control-plane-crash drill kills it on purpose) is waited for up to ``outage_s``."""
    with tqdm(total=100, desc=f"drill {drill_id}", unit="%", bar_format="{l_bar}{bar}| {postfix}") as bar:
        gone_since: float | None = None
        while True:
            try:
                report = api.drill(drill_id)
            except Unreachable:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > outage_s:
                    raise
                bar.set_postfix_str("control plane unreachable, waiting for it")
                time.sleep(POLL_S)
                continue
            gone_since = None
            progress = report.progress
            done = 100 if report.status in FINISHED else int(100 * (progress.fraction if progress else 0.0))
            bar.update(max(done - bar.n, 0))
            bar.set_postfix_str(progress.phase if progress else report.status)
            if report.status in FINISHED:
                return report
            time.sleep(POLL_S)


def _print_scenarios(scenarios: list[Scenario]) -> None:
    for s in scenarios:
        faults = ", ".join(f.kind for f in s.faults) or s.action
        print(f"{s.id:<16} {faults:<16} {s.rate:g} req/s x {s.duration_s:g}s  {s.title}")


def _print_list(drills: list[DrillSummary]) -> None:
    if not drills:
        print("no drills yet")
        return
    print(f"{'ID':>5} {'SCENARIO':<16} {'STATUS':<11} {'RTO_SVC':>8} {'RTO_SLO':>8} {'RTO_CAP':>8} "
          f"{'FAILED':>6}  STARTED")
    for d in drills:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.started_at)) if d.started_at else "-"
        print(f"{d.id:>5} {d.scenario:<16} {d.status:<11} {_num(d.rto_service_s):>8} {_num(d.rto_slo_s):>8} "
              f"{_num(d.rto_capacity_s):>8} {_num(d.requests_failed):>6}  {started}")


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
