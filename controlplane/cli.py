"""``controlplane``: start the control plane (``up``) or talk to a running one through its REST API."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable

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


def _chaos(args: argparse.Namespace) -> int:
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
    "chaos": ("fault injection: catalogue, inject, list, revert, halt, release", _chaos),
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
        elif name == "token":
            cmd.add_argument("name")
            cmd.add_argument("--role", choices=["viewer", "operator", "admin"], default="viewer")
            cmd.add_argument("--ttl", type=float, default=None, help="seconds until it expires")
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


if __name__ == "__main__":
    sys.exit(main())
