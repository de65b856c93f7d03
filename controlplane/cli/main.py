"""``controlplane``: start the control plane (``up``) or talk to a running one through its REST API.

Every command that reads something prints a table, or the same data as JSON with ``--json``; ``--url`` and
``--token`` go before the command or after it. Exit codes: :mod:`controlplane.cli.exits`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import httpx

from controlplane import __version__
from controlplane.cli import admin as cli_admin
from controlplane.cli import alerts as cli_alerts
from controlplane.cli import autoscaler as cli_autoscaler
from controlplane.cli import calibrate as cli_calibrate
from controlplane.cli import drill as cli_drill
from controlplane.cli import experiment as cli_experiment
from controlplane.cli import rollouts as cli_rollouts
from controlplane.cli import simulate as cli_simulate
from controlplane.cli.exits import EPILOG, FAILURES, UsageError, exit_code
from controlplane.cli.options import (
    add_connection_options,
    add_connection_options_below,
    add_json_option,
    client,
    print_json,
    resolve_token,
    show,
    sub_commands,
)
from controlplane.client import TOKEN_ENV, ActiveFault, FaultKind, FleetView, as_json
from controlplane.config import load_config

# they never talk to the API
LOCAL_COMMANDS = frozenset({"up", "simulate", "calibrate", "hash-password", "admin"})
CLI_TOKEN_SECRET = "controlplane_cli_token"  # `chaos run`: the operator's token, among the secrets redacted


def _up(args: argparse.Namespace) -> int:
    from controlplane.app import run_up

    config = load_config(args.config)
    return run_up(config)


def _status(args: argparse.Namespace) -> int:
    with client(args) as api:
        show(args, api.fleet(), _print_fleet)
    return 0


def _print_fleet(fleet: FleetView) -> None:
    rollout = f", rolling out {fleet.rollout.model}" if fleet.rollout else ""
    print(f"model {fleet.model} (generation {fleet.generation}); {fleet.ready_replicas}/"
          f"{fleet.desired_replicas} replicas ready{rollout}")
    print(f"{'REPLICA':<12} {'ZONE':<6} {'NODE':<15} {'STATE':<9} {'PID':>7}  URL")
    for r in sorted(fleet.replicas, key=lambda r: r.replica_id):
        where = r.node or "local"
        print(f"{r.replica_id:<12} {r.zone:<6} {where:<15} {r.state:<9} {r.pid or '-':>7}  {r.url}")
    for node in fleet.nodes:
        if not node.alive:
            print(f"node {node.address} (zone {node.zone or '-'}) is LOST")
    if fleet.zones_down:
        print(f"zones without a live node: {', '.join(fleet.zones_down)}")


def _scale(args: argparse.Namespace) -> int:
    with client(args) as api:
        api.scale(args.replicas)
    print(f"desired replicas: {args.replicas}")
    return 0


def _restart(args: argparse.Namespace) -> int:
    with client(args) as api:
        api.restart(args.replica)
    print(f"restarting {args.replica}")
    return 0


def _events(args: argparse.Namespace) -> int:
    with client(args) as api:
        for event in api.events(kind=args.kind, limit=args.limit):
            print(json.dumps(as_json(event), sort_keys=True))
    return 0


def _token(args: argparse.Namespace) -> int:
    with client(args) as api:
        print(api.issue_token(args.name, args.role, args.ttl))
    return 0


def _hash_password(args: argparse.Namespace) -> int:
    """A console user's password hash (or whole NAME:ROLE:HASH entry) for [console] users."""
    import getpass

    from controlplane.auth import hash_password

    password = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
    if not password:
        raise UsageError("hash-password: the password must not be empty")
    hashed = hash_password(password)
    print(f"{args.user}:{args.role}:{hashed}" if args.user else hashed)
    return 0


def _chaos(args: argparse.Namespace) -> int:
    if args.action == "run":
        return _chaos_run(args)
    params = dict(_param(p) for p in args.param or []) if args.action == "inject" else {}
    with client(args) as api:
        if args.action == "catalogue":
            show(args, api.chaos_catalogue(), _print_catalogue)
        elif args.action == "list":
            show(args, api.chaos_faults(), _print_faults)
        elif args.action == "inject":
            print_json(api.chaos_inject(args.kind, duration_s=args.duration, selector=args.selector,
                                        params=params, replicas=args.replica or [], zones=args.zone or [],
                                        allow_all=args.allow_all, dry_run=args.dry_run))
        elif args.action == "revert":
            print_json(api.chaos_revert(args.id))
        elif args.action == "halt":
            print_json(api.chaos_halt())
        else:
            print_json(api.chaos_release())
    return 0


def _print_catalogue(kinds: list[FaultKind]) -> None:
    print(f"{'KIND':<16} {'FAMILY':<8} AVAILABILITY")
    for kind in kinds:
        state = "available" if kind.available else kind.unavailable_reason
        print(f"{kind.kind:<16} {kind.family:<8} {state}")


def _print_faults(faults: list[ActiveFault]) -> None:
    if not faults:
        print("no active faults")
        return
    print(f"{'ID':>5} {'KIND':<16} {'TARGET':<12} {'LEFT':>8}")
    for fault in faults:
        print(f"{fault.id or '-':>5} {fault.kind:<16} {fault.target:<12} {fault.remaining_s:>7.1f}s")


def _chaos_run(args: argparse.Namespace) -> int:
    """Run a Chaos Toolkit-format experiment here with the native runner; its ``chaos.ctk`` activities and the
    stop conditions talk to the control plane at --url. Exit 0 when it completed, 1 otherwise (a malformed
    experiment too, before anything runs)."""
    import asyncio

    from tqdm import tqdm  # type: ignore[import-untyped]

    from chaos.experiment import ExperimentRunner, load_experiment, validate_experiment
    from chaos.safety import StopCondition, error_rate_above, p99_ttft_above, ready_replicas_below

    os.environ.setdefault("CONTROLPLANE_URL", args.url)  # chaos.ctk's fallback when the experiment has none
    if args.token:
        os.environ[TOKEN_ENV] = args.token  # never into the experiment's configuration (it is journaled)
    token = os.environ.get(TOKEN_ENV)
    # Redacted from the journal like the experiment's own secrets; under a key chaos.ctk does not read, so
    # an experiment's `controlplane_token` still wins over $CONTROLPLANE_TOKEN, as under `chaos run`.
    # Process providers never see it: their commands start without the environment's secrets.
    redacted = {CLI_TOKEN_SECRET: token} if token else {}
    experiment = load_experiment(args.experiment)
    validate_experiment(experiment)  # before the progress bar: a refusal is one line
    with client(args) as api:
        conditions: list[StopCondition] = []
        if args.max_error_rate is not None:
            conditions.append(error_rate_above(lambda: api.summary().error_rate, args.max_error_rate))
        if args.max_p99_ttft is not None:
            conditions.append(p99_ttft_above(lambda: api.summary().ttft.p99, args.max_p99_ttft))
        if args.min_ready is not None:
            conditions.append(ready_replicas_below(lambda: api.fleet().ready_replicas, args.min_ready))
        with tqdm(desc=str(experiment.get("title", "experiment"))[:40], unit="step",
                  disable=args.json) as bar:
            def progress(done: int, total: int, name: str) -> None:
                bar.total = total
                bar.set_postfix_str(name[:30])
                bar.update(done - bar.n)

            runner = ExperimentRunner(progress=progress, base_secrets=redacted)
            journal = asyncio.run(runner.run(experiment, dry_run=args.dry_run, stop_conditions=conditions,
                                             check_interval_s=args.check_interval,
                                             rollback_strategy=args.rollback_strategy))
    if args.journal:
        with open(args.journal, "w") as out:
            json.dump(journal, out, indent=2, default=str)
    if args.json:
        print(json.dumps(journal, indent=2, default=str))
    else:
        _print_journal(journal)
    return 0 if journal["status"] == "completed" else 1


def _print_journal(journal: dict[str, Any]) -> None:
    print(f"status: {journal['status']}  deviated: {journal['deviated']}  duration: {journal['duration']}s"
          + ("  (dry run)" if journal["dry"] else ""))
    if journal["dry"]:
        for step in journal["plan"]:
            arguments = json.dumps(step["arguments"])
            print(f"  {step['phase']:<20} {step['name']:<24} {step['provider']}  {arguments}")
    for phase in ("run", "rollbacks"):
        for record in journal[phase]:
            error = f"  {record['exception'][-1].strip()}" if record.get("exception") else ""
            print(f"  {phase:<9} {record['activity']['name']:<24} {record['status']}{error}")
    trip = journal.get("stop_condition")
    if trip:
        print(f"stopped by: {trip['description']}; reverted faults {journal['fault_ids']}")


def _param(text: str) -> tuple[str, float | str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise UsageError(f"--param: expected NAME=VALUE, got {text!r}")
    try:
        return name, float(value)
    except ValueError:
        return name, value


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "up": ("start replicas, gateway, API (and Prometheus when installed); Ctrl-C drains and stops", _up),
    "status": ("show the fleet", _status),
    "scale": ("set the desired number of replicas", _scale),
    "restart": ("restart one replica", _restart),
    "rollout": (cli_rollouts.ROLLOUT_SUMMARY, cli_rollouts.run_rollout),
    "versions": (cli_rollouts.VERSIONS_SUMMARY, cli_rollouts.run_versions),
    "events": ("print fleet events as JSON lines", _events),
    "token": ("issue an API token (admin)", _token),
    "hash-password": ("hash a console user's password (read from the terminal or stdin)", _hash_password),
    "chaos": ("fault injection: catalogue, inject, list, revert, halt, release; run an experiment", _chaos),
    "alerts": (cli_alerts.SUMMARY, cli_alerts.run),
    "autoscaler": (cli_autoscaler.SUMMARY, cli_autoscaler.run),
    "simulate": (cli_simulate.SUMMARY, cli_simulate.run),
    "calibrate": (cli_calibrate.SUMMARY, cli_calibrate.run),
    "drill": (cli_drill.SUMMARY, cli_drill.run),
    "experiment": (cli_experiment.SUMMARY, cli_experiment.run),
    "admin": (cli_admin.SUMMARY, cli_admin.run),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="controlplane", description=__doc__.split("\n\n")[0], epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_connection_options(p, defaults=True)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (summary, _) in COMMANDS.items():
        cmd = sub.add_parser(name, help=summary, description=summary, epilog=EPILOG)
        if name == "status":
            add_json_option(cmd)
        elif name == "up":
            cmd.add_argument("--config", default=None, help="TOML file overriding the defaults")
        elif name == "scale":
            cmd.add_argument("replicas", type=int)
        elif name == "restart":
            cmd.add_argument("replica")
        elif name == "rollout":
            cli_rollouts.add_rollout_arguments(cmd)
        elif name == "versions":
            cli_rollouts.add_versions_arguments(cmd)
        elif name == "events":
            cmd.add_argument("--kind", default=None, help="prefix such as replica. or rollout.")
            cmd.add_argument("--limit", type=int, default=200)
        elif name == "chaos":
            actions = cmd.add_subparsers(dest="action", required=True)
            add_json_option(actions.add_parser("catalogue", help="fault kinds, with the reason when one is "
                                                                 "unavailable"))
            add_json_option(actions.add_parser("list", help="active faults"))
            inject = actions.add_parser("inject", help="inject a fault (reverts itself after --duration)")
            inject.add_argument("kind")
            inject.add_argument("--duration", type=float, default=30.0, help="seconds (default %(default)s)")
            inject.add_argument("--selector", default="COUNT(1)", help="ALL, COUNT(n) or PERCENT(n)")
            inject.add_argument("--replica", action="append", help="limit to this replica (repeatable)")
            inject.add_argument("--zone", action="append", help="limit to this zone (repeatable)")
            inject.add_argument("--param", action="append", help="NAME=VALUE (repeatable)")
            inject.add_argument("--allow-all", action="store_true", help="allow taking down every replica")
            inject.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
            revert = actions.add_parser("revert", help="revert one fault now")
            revert.add_argument("id", type=int)
            actions.add_parser("halt", help="revert every fault and refuse new ones until release")
            actions.add_parser("release", help="accept new faults again after a halt")
            run = actions.add_parser("run", help="run a Chaos Toolkit-format experiment (JSON or YAML)")
            run.add_argument("experiment", help="experiment file; chaos.ctk activities reach --url")
            run.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
            run.add_argument("--journal", default=None, help="write the journal (JSON) to this file")
            run.add_argument("--json", action="store_true", help="print the whole journal as JSON")
            run.add_argument("--max-error-rate", type=float, default=None, help="stop condition (0..1)")
            run.add_argument("--max-p99-ttft", type=float, default=None, help="stop condition (seconds)")
            run.add_argument("--min-ready", type=int, default=None, help="stop condition: ready replicas")
            run.add_argument("--check-interval", type=float, default=1.0, help="stop-condition period (s)")
            run.add_argument("--rollback-strategy", default="always",
                             choices=["always", "never", "deviated", "default"])
        elif name == "token":
            cmd.add_argument("name")
            cmd.add_argument("--role", choices=["viewer", "operator", "admin"], default="viewer")
            cmd.add_argument("--ttl", type=float, default=None, help="seconds until it expires")
        elif name == "hash-password":
            cmd.add_argument("--user", default=None, help="print a whole NAME:ROLE:HASH entry for this user")
            cmd.add_argument("--role", choices=["viewer", "operator", "admin"], default="viewer")
        elif name == "alerts":
            cli_alerts.add_arguments(cmd)
        elif name == "autoscaler":
            cli_autoscaler.add_arguments(cmd)
        elif name == "drill":
            cli_drill.add_arguments(cmd)
        elif name == "experiment":
            cli_experiment.add_arguments(cmd)
        elif name == "simulate":
            cli_simulate.add_arguments(cmd)
        elif name == "calibrate":
            cli_calibrate.add_arguments(cmd)
        elif name == "admin":
            cli_admin.add_arguments(cmd)
    add_connection_options_below(p, skip=LOCAL_COMMANDS)
    for _, sub_parser in sub_commands(p):
        sub_parser.epilog = sub_parser.epilog or EPILOG
    return p


def main(argv: list[str] | None = None, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run one command; its exit code (``controlplane.cli.exits``). ``transport`` replaces the network
    (tests drive the CLI against an in-process API)."""
    args = parser().parse_args(argv)
    args.transport = transport
    try:
        resolve_token(args)  # a --token argument is warned about on stderr
    except UsageError as exc:
        print(f"controlplane: {exc}", file=sys.stderr)
        return exit_code(exc)
    logging.basicConfig(level=logging.INFO if args.command == "up" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per health probe otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return COMMANDS[args.command][1](args)
    except FAILURES as exc:  # one line, no traceback
        print(f"controlplane: {exc}", file=sys.stderr)
        return exit_code(exc)

