"""``controlplane drill schedule add|list|show|edit|pause|resume|run|delete|runs``: scheduled drills.

The ``drill`` command group hooks this in: ``cli_schedules.add_arguments(schedule_parser)`` for the
``schedule`` sub-command and ``cli_schedules.run(args)`` to handle it. Every action goes through the REST
API (``/api/v1/drills/schedules``); changes need an operator token.

``--replica`` / ``--zone`` aim a schedule's drills and ``--trace`` (with ``--compress``, ``--token-scale``,
``--trace-start``) replays an Azure LLM trace, as for ``drill run``; :func:`trace_load` reads those options
for both commands.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from controlplane.cli.exits import UsageError
from controlplane.cli.options import add_json_option, client, print_json, show
from controlplane.client import DrillSchedule, ScheduleRun

SUMMARY = "cron schedules of drills: add, list, show, edit, pause, resume, run now, delete, run history"


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="schedule_action", required=True)
    add = actions.add_parser("add", help="schedule a drill scenario on a cron expression (operator)")
    add.add_argument("name")
    add.add_argument("--scenario", required=True, help="a drill scenario id, such as replica-crash")
    add.add_argument("--cron", required=True, help="minute hour day month weekday, e.g. '0 3 * * 1'")
    add.add_argument("--paused", action="store_true", help="create it paused")
    _spec_options(add)
    add_json_option(actions.add_parser("list", help="every schedule with its next run time"))
    for name, summary in (("show", "one schedule as JSON"), ("pause", "stop firing (operator)"),
                          ("resume", "fire again from the next cron time (operator)"),
                          ("run", "fire now; the cron continues afterwards (operator)"),
                          ("delete", "forget a schedule; its run history stays (operator)")):
        actions.add_parser(name, help=summary).add_argument("id")
    edit = actions.add_parser("edit", help="change a schedule's fields (operator)")
    edit.add_argument("id")
    edit.add_argument("--name", default=None)
    edit.add_argument("--scenario", default=None)
    edit.add_argument("--cron", default=None)
    _spec_options(edit)
    edit.add_argument("--any-replica", action="store_true",
                      help="drop --replica and --zone: the fault hits the busiest replica at t0 again")
    edit.add_argument("--poisson", action="store_true",
                      help="drop --trace: back to the scenario's Poisson arrivals")
    runs = actions.add_parser("runs", help="a schedule's firings, newest first")
    runs.add_argument("id")
    runs.add_argument("--limit", type=int, default=20)
    add_json_option(runs)


def _spec_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--timezone", default=None, help="IANA name (default: drills.schedule_timezone)")
    cmd.add_argument("--overlap", choices=["skip", "wait"], default=None,
                     help="when a drill is already running (default: drills.schedule_overlap)")
    cmd.add_argument("--max-wait", type=float, default=None, help="overlap wait: seconds before giving up")
    cmd.add_argument("--misfire-grace", type=float, default=None,
                     help="a firing missed while down still runs within this many seconds")
    cmd.add_argument("--rate", type=float, default=None, help="load: requests per second")
    cmd.add_argument("--duration", type=float, default=None, help="load duration in seconds")
    cmd.add_argument("--set", action="append", default=None, metavar="NAME=VALUE",
                     help="any scenario override, e.g. targets.rto_service_s=0.5 (repeatable)")
    add_aim_and_load_options(cmd, aim_note="checked when it fires; ")


def add_aim_and_load_options(cmd: argparse.ArgumentParser, *, aim_note: str = "") -> None:
    """``--replica``, ``--zone`` and the trace options of ``drill run`` and ``drill schedule add|edit``
    (read back by :func:`trace_load` and ``args.replica`` / ``args.zone``)."""
    cmd.add_argument("--replica", action="append", default=None, metavar="ID",
                     help=f"the replica a single-replica fault hits ({aim_note}default: the busiest at t0)")
    cmd.add_argument("--zone", action="append", default=None, metavar="NAME",
                     help="the zone a zone fault takes, or whose busiest replica a single-replica fault hits")
    cmd.add_argument("--trace", default=None, metavar="PATH|azure",
                     help="replay an Azure LLM trace instead of Poisson arrivals ('azure': the one shipped "
                          "with the control plane, or the server's $CONTROLPLANE_AZURE_TRACE)")
    cmd.add_argument("--compress", type=float, default=None, help="trace replay speed-up (default 1)")
    cmd.add_argument("--token-scale", type=float, default=None, help="multiplies trace token counts")
    cmd.add_argument("--trace-start", type=float, default=None, help="seconds into the trace")


def overrides(args: argparse.Namespace) -> dict[str, float] | None:
    """The scenario overrides from --rate, --duration and --set; None when none was given."""
    found: dict[str, float] = {}
    for text in args.set or []:
        name, sep, value = text.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError(text)
            found[name.strip()] = float(value)
        except ValueError:
            raise UsageError(f"--set: expected NAME=NUMBER, got {text!r}") from None
    if args.rate is not None:
        found["rate"] = args.rate
    if args.duration is not None:
        found["duration_s"] = args.duration
    return found or None


def trace_load(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``load`` of a drill run or schedule: a trace replay with ``--trace``, else None (``--rate`` goes
    as is). The trace options without ``--trace``, or ``--rate`` with it, are one-line errors."""
    trace_options = {"compress": args.compress, "token_scale": args.token_scale,
                     "trace_start_s": args.trace_start}
    if args.trace is None:
        given = [name for name, value in trace_options.items() if value is not None]
        if given:
            raise UsageError(f"--{given[0].removesuffix('_s').replace('_', '-')}: only with --trace")
        return None
    if args.rate is not None:
        raise UsageError("--rate: a trace replay takes its arrivals from the trace; leave --rate out")
    return {"kind": "trace", "trace": args.trace, **{k: v for k, v in trace_options.items() if v is not None}}


def _cleared(args: argparse.Namespace) -> dict[str, Any]:
    """What ``edit --any-replica`` and ``--poisson`` take back (the API's ``[]`` and ``{"kind": "rate"}``)."""
    out: dict[str, Any] = {}
    if args.any_replica:
        if args.replica or args.zone:
            raise UsageError("--any-replica: leave --replica and --zone out")
        out.update(replicas=[], zones=[])
    if args.poisson:
        if args.trace is not None:
            raise UsageError("--poisson: leave --trace out")
        out["load"] = {"kind": "rate"}
    return out


def run(args: argparse.Namespace) -> int:
    action = args.schedule_action
    changes = _changes(args) if action == "edit" else {}
    with client(args) as api:
        if action == "add":
            created = api.add_drill_schedule(
                name=args.name, scenario_id=args.scenario, cron=args.cron, timezone=args.timezone,
                overrides=overrides(args), overlap=args.overlap, max_wait_s=args.max_wait,
                misfire_grace_s=args.misfire_grace, paused=args.paused, replicas=args.replica,
                zones=args.zone, load=trace_load(args))
            print(f"{created.id}: {created.name} next run {_when(created)}")
        elif action == "list":
            show(args, api.drill_schedules(), _print_schedules)
        elif action == "show":
            print_json(api.drill_schedule(args.id))
        elif action == "edit":
            edited = api.edit_drill_schedule(args.id, **changes)
            print(f"{edited.id}: {edited.name} next run {_when(edited)}")
        elif action in ("pause", "resume", "run"):
            call = {"pause": api.pause_drill_schedule, "resume": api.resume_drill_schedule,
                    "run": api.run_drill_schedule}[action]
            result = call(args.id)
            print(f"{result.id}: {'paused' if result.paused else 'next run ' + _when(result)}")
        elif action == "delete":
            api.delete_drill_schedule(args.id)
            print(f"{args.id}: deleted")
        else:
            show(args, api.drill_schedule_runs(args.id, limit=args.limit), _print_runs)
    return 0


def _changes(args: argparse.Namespace) -> dict[str, Any]:
    """What ``edit`` changes; UsageError when nothing."""
    changes = {k: v for k, v in (("name", args.name), ("scenario_id", args.scenario), ("cron", args.cron),
                                 ("timezone", args.timezone), ("overrides", overrides(args)),
                                 ("replicas", args.replica), ("zones", args.zone), ("load", trace_load(args)),
                                 ("overlap", args.overlap), ("max_wait_s", args.max_wait),
                                 ("misfire_grace_s", args.misfire_grace)) if v is not None}
    changes.update(_cleared(args))
    if not changes:
        raise UsageError("edit: nothing to change (give --cron, --timezone, --rate, --replica, ...)")
    return changes


def _when(schedule: DrillSchedule) -> str:
    return "paused" if schedule.paused else str(schedule.next_run_time)


def _print_schedules(schedules: list[DrillSchedule]) -> None:
    if not schedules:
        print("no drill schedules")
        return
    print(f"{'ID':<17} {'NAME':<20} {'SCENARIO':<15} {'CRON':<16} {'TIMEZONE':<16} {'OVERLAP':<7} "
          f"{'NEXT RUN':<26} AIM AND LOAD")
    for s in schedules:
        print(f"{s.id:<17} {s.name[:20]:<20} {s.scenario_id:<15} {s.cron:<16} {s.timezone:<16} "
              f"{s.overlap:<7} {_when(s):<26} {s.aim_and_load}")


def _print_runs(runs: list[ScheduleRun]) -> None:
    if not runs:
        print("no runs yet")
        return
    print(f"{'FIRED AT (UTC)':<20} {'OUTCOME':<8} {'DRILL':<18} REASON")
    for r in runs:
        fired = dt.datetime.fromtimestamp(r.fired_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{fired:<20} {r.outcome:<8} {r.drill_id or '-':<18} {r.reason}")
