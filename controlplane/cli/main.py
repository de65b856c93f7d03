"""``controlplane``: start the control plane (``up``) or talk to a running one through its REST API."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from controlplane.cli import alerts as cli_alerts
from controlplane.cli import autoscaler as cli_autoscaler
from controlplane.cli import drill as cli_drill
from controlplane.cli import simulate as cli_simulate
from controlplane.client import DEFAULT_URL, TOKEN_ENV, ApiError, ControlPlaneClient
from controlplane.config import ConfigError, load_config


def _client(args: argparse.Namespace) -> ControlPlaneClient:
    return ControlPlaneClient(args.url, args.token)


def _up(args: argparse.Namespace) -> int:
    from controlplane.app import run_up

    config = load_config(args.config)
    return run_up(config)


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        fleet = client.fleet()
    rollout = f", rolling out {fleet.rollout['model']}" if fleet.rollout else ""
    print(f"model {fleet.model} (generation {fleet.generation}); {fleet.ready_replicas}/"
          f"{fleet.desired_replicas} replicas ready{rollout}")
    print(f"{'REPLICA':<12} {'ZONE':<6} {'STATE':<9} {'PID':>7}  URL")
    for r in sorted(fleet.replicas, key=lambda r: r.replica_id):
        print(f"{r.replica_id:<12} {r.zone:<6} {r.state:<9} {r.pid or '-':>7}  {r.url}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.scale(args.replicas)
    print(f"desired replicas: {args.replicas}")
    return 0


def _restart(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.restart(args.replica)
    print(f"restarting {args.replica}")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    with _client(args) as client:
        result = client.rollout(args.model)
    print(f"rolling out {result['model']} (generation {result['generation']}); follow it with "
          "`controlplane status` or `controlplane events --kind rollout`")
    return 0


def _events(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for event in client.events(kind=args.kind, limit=args.limit):
            print(json.dumps(event, sort_keys=True))
    return 0


def _token(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.issue_token(args.name, args.role, args.ttl))
    return 0


def _hash_password(args: argparse.Namespace) -> int:
    """A console user's password hash (or whole NAME:ROLE:HASH entry) for [console] users."""
    import getpass

    from controlplane.auth import hash_password

    password = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
    if not password:
        raise ApiError("hash-password: the password must not be empty")
    hashed = hash_password(password)
    print(f"{args.user}:{args.role}:{hashed}" if args.user else hashed)
    return 0


def _chaos(args: argparse.Namespace) -> int:
    if args.action == "run":
        return _chaos_run(args)
    with _client(args) as client:
        if args.action == "catalogue":
            for kind in client.chaos_catalogue():
                state = "available" if kind["available"] else kind["unavailable_reason"]
                print(f"{kind['kind']:<16} {kind['family']:<8} {state}")
        elif args.action == "list":
            for fault in client.chaos_faults():
                print(f"{fault['id']:>5} {fault['kind']:<16} {fault['target']:<12} "
                      f"{fault['remaining_s']:>7.1f}s left")
        elif args.action == "inject":
            params = dict(_param(p) for p in args.param or [])
            result = client.chaos_inject(args.kind, duration_s=args.duration, selector=args.selector,
                                         params=params, replicas=args.replica or [], zones=args.zone or [],
                                         allow_all=args.allow_all, dry_run=args.dry_run)
            print(json.dumps(result, indent=2))
        elif args.action == "revert":
            print(json.dumps(client.chaos_revert(args.id)))
        elif args.action == "halt":
            print(json.dumps(client.chaos_halt()))
        else:
            print(json.dumps(client.chaos_release()))
    return 0


def _chaos_run(args: argparse.Namespace) -> int:
    """Run a Chaos Toolkit-format experiment here with the native runner; its ``chaos.ctk`` activities and the
    stop conditions talk to the control plane at --url. Exit 0 when it completed, 1 otherwise."""
    import asyncio

    from tqdm import tqdm  # type: ignore[import-untyped]

    from chaos.experiment import ExperimentRunner, InvalidExperiment, load_experiment, validate_experiment
    from chaos.safety import StopCondition, error_rate_above, p99_ttft_above, ready_replicas_below

    os.environ.setdefault("CONTROLPLANE_URL", args.url)  # chaos.ctk's fallback when the experiment has none
    if args.token:
        os.environ[TOKEN_ENV] = args.token  # never into the experiment's configuration (it is journaled)
    with _client(args) as client:
        conditions: list[StopCondition] = []
        if args.max_error_rate is not None:
            conditions.append(error_rate_above(lambda: client.summary().get("error_rate"),
                                               args.max_error_rate))
        if args.max_p99_ttft is not None:
            conditions.append(p99_ttft_above(lambda: (client.summary().get("ttft") or {}).get("p99"),
                                             args.max_p99_ttft))
        if args.min_ready is not None:
            conditions.append(ready_replicas_below(lambda: client.fleet().ready_replicas, args.min_ready))
        try:
            experiment = load_experiment(args.experiment)
            validate_experiment(experiment)  # before the progress bar: a refusal is one line
            with tqdm(desc=str(experiment.get("title", "experiment"))[:40], unit="step",
                      disable=args.json) as bar:
                def progress(done: int, total: int, name: str) -> None:
                    bar.total = total
                    bar.set_postfix_str(name[:30])
                    bar.update(done - bar.n)

                runner = ExperimentRunner(progress=progress)
                journal = asyncio.run(runner.run(experiment, dry_run=args.dry_run, stop_conditions=conditions,
                                                 check_interval_s=args.check_interval,
                                                 rollback_strategy=args.rollback_strategy))
        except InvalidExperiment as exc:
            print(f"controlplane: {exc}", file=sys.stderr)
            return 2
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
        raise ApiError(f"--param: expected NAME=VALUE, got {text!r}")
    try:
        return name, float(value)
    except ValueError:
        return name, value


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "up": ("start replicas, gateway, API (and Prometheus when installed); Ctrl-C drains and stops", _up),
    "status": ("show the fleet", _status),
    "scale": ("set the desired number of replicas", _scale),
    "restart": ("restart one replica", _restart),
    "rollout": ("rolling update to another model folder", _rollout),
    "events": ("print fleet events as JSON lines", _events),
    "token": ("issue an API token (admin)", _token),
    "hash-password": ("hash a console user's password (read from the terminal or stdin)", _hash_password),
    "chaos": ("fault injection: catalogue, inject, list, revert, halt, release; run an experiment", _chaos),
    "alerts": (cli_alerts.SUMMARY, cli_alerts.run),
    "autoscaler": (cli_autoscaler.SUMMARY, cli_autoscaler.run),
    "simulate": (cli_simulate.SUMMARY, cli_simulate.run),
    "drill": (cli_drill.SUMMARY, cli_drill.run),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="controlplane", description=__doc__)
    p.add_argument("--url", default=os.environ.get("CONTROLPLANE_URL", DEFAULT_URL),
                   help="REST API address (default: $CONTROLPLANE_URL or %(default)s)")
    p.add_argument("--token", default=None, help=f"API token (default: ${TOKEN_ENV})")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (summary, _) in COMMANDS.items():
        cmd = sub.add_parser(name, help=summary)
        if name == "up":
            cmd.add_argument("--config", default=None, help="TOML file overriding the defaults")
        elif name == "scale":
            cmd.add_argument("replicas", type=int)
        elif name == "restart":
            cmd.add_argument("replica")
        elif name == "rollout":
            cmd.add_argument("--model", required=True, help="a Hugging Face model folder, or 'default'")
        elif name == "events":
            cmd.add_argument("--kind", default=None, help="prefix such as replica. or rollout.")
            cmd.add_argument("--limit", type=int, default=200)
        elif name == "chaos":
            actions = cmd.add_subparsers(dest="action", required=True)
            actions.add_parser("catalogue", help="fault kinds, with the reason when one is unavailable")
            actions.add_parser("list", help="active faults")
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
        elif name == "simulate":
            cli_simulate.add_arguments(cmd)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command == "up" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per health probe otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return COMMANDS[args.command][1](args)
    except (ApiError, ConfigError) as exc:
        print(f"controlplane: {exc}", file=sys.stderr)
        return 2

